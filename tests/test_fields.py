"""No silent ignoring: every field is implemented, or refused with 400 naming it; unknown fields are
refused unless the server allows them (then logged); docs/api.md matches the table."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from bench.http import request
from tests.conftest import engine_config
from tests.server_fixtures import running_server
from web.fields import REFUSED, api_reference
from web.settings import ServerSettings

DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def test_docs_api_md_is_generated_from_the_table():
    assert DOC.read_text() == api_reference() + "\n", "run: python -m web.fields > docs/api.md"


@pytest.fixture
async def server(tiny_model_dir):
    async with running_server(engine_config(tiny_model_dir)) as running:
        yield running


BASE = {"completions": {"prompt": "hello", "max_tokens": 2},
        "chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
SAMPLE_VALUES = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                 "response_format": {"type": "json_object"}, "logit_bias": {"5": 10}, "best_of": 2,
                 "structured_outputs": {"regex": "a+"}, "guided_json": {"type": "object"}, "suffix": "end"}


async def test_every_refused_field_is_a_400_naming_it(server):
    for endpoint in BASE:
        for field in sorted(REFUSED[endpoint]):
            body = {**BASE[endpoint], field: SAMPLE_VALUES.get(field, "x")}
            response = await request(server.url, "POST", f"/v1/{endpoint}", body)
            assert response.status == 400, (field, response.body)
            error = json.loads(response.body)["error"]
            assert error["param"] == field and "not supported" in error["message"], (field, error)


async def test_empty_values_of_refused_fields_ask_for_nothing(server):
    body = {**BASE["chat/completions"], "tools": [], "best_of": None, "parallel_tool_calls": False}
    response = await request(server.url, "POST", "/v1/chat/completions", body)
    assert response.status == 200, response.body


async def test_unknown_fields_and_nested_ones_are_refused(server):
    nested = {**BASE["completions"], "stream": True, "stream_options": {"frobnicate": True}}
    for body, param in (({**BASE["completions"], "frobnicate": 1}, "frobnicate"),
                        (nested, "stream_options.frobnicate")):
        response = await request(server.url, "POST", "/v1/completions", body)
        assert response.status == 400
        assert json.loads(response.body)["error"]["param"] == param


async def test_allow_unknown_fields_logs_them_instead(tiny_model_dir, caplog):
    settings = ServerSettings(allow_unknown_fields=True)
    async with running_server(engine_config(tiny_model_dir), settings) as server:
        body = {**BASE["completions"], "frobnicate": 1, "vendor_x": "y"}
        with caplog.at_level(logging.WARNING, logger="trio_llm.requests"):
            response = await request(server.url, "POST", "/v1/completions", body)
        assert response.status == 200
        assert "frobnicate" in caplog.text and "vendor_x" in caplog.text
        refused = {**BASE["completions"], "best_of": 3}  # known and unimplemented: still a 400
        response = await request(server.url, "POST", "/v1/completions", refused)
        assert response.status == 400
