"""prompt_embeds over HTTP: the openai client's form, hostile payloads answered 400, the server still serving."""

from __future__ import annotations

import base64
import io
import pickle
import zipfile
from dataclasses import replace

import openai
import pytest
import torch

from bench.http import request
from tests.conftest import TEST_SPEC, engine_config
from tests.server_fixtures import running_server
from tests.test_prompt_embeds import RunsCode, embedding_table, encode, saved

HIDDEN = TEST_SPEC.hidden
MAX_MODEL_LEN = 128
MAX_PAYLOAD = 200_000


@pytest.fixture
async def server(tiny_model_dir):
    config = engine_config(tiny_model_dir, enable_prompt_embeds=True, max_model_len=MAX_MODEL_LEN,
                           max_prompt_embeds_bytes=MAX_PAYLOAD)
    async with running_server(config) as running:
        yield running


async def test_the_openai_client_form_generates_what_the_token_prompt_does(server, tiny_model_dir):
    ids = [7, 300, 12, 45, 45, 9]
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    async with client:
        model = server.state.model_name
        by_tokens = await client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0,
                                                    extra_body={"ignore_eos": True})
        payload = encode(embedding_table(tiny_model_dir)[ids])
        by_embeds = await client.completions.create(model=model, prompt="", max_tokens=8, temperature=0,
                                                    extra_body={"ignore_eos": True, "prompt_embeds": payload})
    assert by_embeds.choices[0].text == by_tokens.choices[0].text
    assert by_embeds.usage.prompt_tokens == len(ids) and len(by_embeds.choices) == 1


async def test_a_chat_prompt_embeds_part_generates_what_its_text_does(server, tiny_model_dir):
    """vLLM's `{"type": "prompt_embeds", "data": ...}` content part: the template is rendered
    around it, its rows take the place of the text it embeds."""
    text = "tell me a story about the sea"
    ids = (await request(server.url, "POST", "/tokenize", {"prompt": text, "add_special_tokens": False})).json()
    part = {"type": "prompt_embeds", "data": encode(embedding_table(tiny_model_dir)[ids["tokens"]])}
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    by_text = (await request(server.url, "POST", "/v1/chat/completions", {
        **body, "messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": [{"type": "text", "text": text}]}]})).json()
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    async with client:
        by_embeds = await client.chat.completions.create(
            model=server.state.model_name, max_tokens=8, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": [part]}])
    assert by_embeds.choices[0].message.content == by_text["choices"][0]["message"]["content"]
    assert by_embeds.usage.prompt_tokens == by_text["usage"]["prompt_tokens"]
    broken = await request(server.url, "POST", "/v1/chat/completions", {
        **body, "messages": [{"role": "user", "content": [{"type": "prompt_embeds", "data": "not base64!"}]}]})
    assert broken.status == 400 and broken.json()["error"]["param"] == "prompt_embeds"
    missing = await request(server.url, "POST", "/v1/chat/completions", {
        **body, "messages": [{"role": "user", "content": [{"type": "prompt_embeds"}]}]})
    assert missing.status == 400 and "needs its data" in missing.json()["error"]["message"]


def hostile_payloads(marker) -> dict[str, tuple[str, str]]:
    """name -> (base64 payload, a phrase the 400 must contain)"""
    def raw_b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    # A torch.save archive whose data.pkl is replaced by a pickle that runs code on load.
    buffer = io.BytesIO()
    torch.save(torch.zeros(2, HIDDEN), buffer)
    evil = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as src, zipfile.ZipFile(evil, "w") as dst:
        for info in src.infolist():
            data = pickle.dumps(RunsCode(marker)) if info.filename.endswith("data.pkl") else src.read(info)
            dst.writestr(info, data)
    return {
        "code-running pickle in an archive": (raw_b64(evil.getvalue()), "may not"),
        "code-running torch.save": (saved(RunsCode(marker)), "may not"),
        "sparse with out-of-bounds indices": (saved(torch.sparse_coo_tensor(
            torch.tensor([[0, 500], [0, 1]]), torch.ones(2), (4, HIDDEN), check_invariants=False)), "sparse"),
        "not a tensor": (saved([1.0, 2.0]), "not a tensor"),
        "3-D": (saved(torch.zeros(2, 3, HIDDEN)), "2 dimensions"),
        "1-D": (saved(torch.zeros(HIDDEN)), "2 dimensions"),
        "wrong hidden size": (saved(torch.zeros(3, HIDDEN // 2)), "hidden size"),
        "integer dtype": (saved(torch.zeros(3, HIDDEN, dtype=torch.int64)), "floating-point"),
        "invalid base64": ("@@@@not base64", "base64"),
        "over the byte limit": (raw_b64(b"\0" * (MAX_PAYLOAD + 10)), "larger than the limit"),
        "more rows than the context": (saved(torch.zeros(MAX_MODEL_LEN, HIDDEN)), "rows"),
    }


async def test_hostile_payloads_get_a_400_naming_the_reason_and_nothing_runs(server, tmp_path):
    marker = tmp_path / "code-ran"
    for name, (payload, phrase) in hostile_payloads(marker).items():
        response = await request(server.url, "POST", "/v1/completions",
                                 {"prompt_embeds": payload, "max_tokens": 2})
        assert response.status == 400, (name, response.body[:300])
        error = response.json()["error"]
        assert phrase in error["message"], (name, error)
        assert error["param"] == "prompt_embeds" and error["type"] == "BadRequestError" and error["code"] == 400
    assert not marker.exists()
    assert server.engine.core.num_steps == 0 and server.engine.core.num_requests == 0
    healthy = await request(server.url, "POST", "/v1/completions",
                            {"prompt_embeds": saved(torch.zeros(3, HIDDEN)), "max_tokens": 2})
    assert healthy.status == 200 and healthy.json()["usage"]["prompt_tokens"] == 3


async def test_embeddings_and_text_prompts_in_one_request_come_back_in_order(server):
    payloads = [saved(torch.randn(n, HIDDEN)) for n in (40, 2, 17)]
    response = await request(server.url, "POST", "/v1/completions",
                             {"prompt_embeds": payloads, "prompt": "and some text", "max_tokens": 1})
    assert response.status == 200
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert response.json()["usage"]["prompt_tokens"] == 40 + 2 + 17 + len(
        server.engine.tokenizer.encode("and some text"))


async def test_echo_with_embeddings_is_refused(server):
    response = await request(server.url, "POST", "/v1/completions",
                             {"prompt_embeds": saved(torch.zeros(2, HIDDEN)), "echo": True})
    assert response.status == 400 and response.json()["error"]["param"] == "echo"


async def test_a_server_without_the_flag_says_how_to_enable_it(tiny_model_dir):
    async with running_server(engine_config(tiny_model_dir)) as plain:
        response = await request(plain.url, "POST", "/v1/completions",
                                 {"prompt_embeds": saved(torch.zeros(2, HIDDEN)), "max_tokens": 2})
        chat = await request(plain.url, "POST", "/v1/chat/completions", {
            "max_tokens": 2, "messages": [{"role": "user", "content": [
                {"type": "prompt_embeds", "data": saved(torch.zeros(2, HIDDEN))}]}]})
    assert response.status == 400
    assert "--enable-prompt-embeds" in response.json()["error"]["message"]
    assert chat.status == 400 and "--enable-prompt-embeds" in chat.json()["error"]["message"]


async def test_large_bodies_take_the_view_path_with_the_same_results(server, tiny_model_dir, monkeypatch, tmp_path):
    """With the split threshold at 0, every body goes through `web.http.embeds_body`: the outputs
    and the errors are those of the ordinary parse."""
    ids = [11, 12, 13, 14]
    payload = {"prompt_embeds": [encode(embedding_table(tiny_model_dir)[ids])], "max_tokens": 5,
               "temperature": 0, "ignore_eos": True}
    ordinary = await request(server.url, "POST", "/v1/completions", payload)
    monkeypatch.setattr(server.state, "settings", replace(server.state.settings, split_embeds_bytes=0))
    split = await request(server.url, "POST", "/v1/completions", payload)
    assert split.status == ordinary.status == 200
    assert split.json()["choices"][0]["text"] == ordinary.json()["choices"][0]["text"]
    marker = tmp_path / "code-ran"
    evil, phrase = hostile_payloads(marker)["code-running torch.save"]
    refused = await request(server.url, "POST", "/v1/completions", {"prompt_embeds": evil})
    assert refused.status == 400 and phrase in refused.json()["error"]["message"] and not marker.exists()


def test_the_body_limit_grows_to_fit_the_largest_accepted_payload():
    from web.http.settings import DEFAULT_BODY_BYTES, ServerSettings
    assert ServerSettings().body_limit(None) == DEFAULT_BODY_BYTES
    assert ServerSettings().body_limit(30 << 20) == (40 << 20) + (1 << 20)
    assert ServerSettings(max_body_bytes=1000).body_limit(30 << 20) == 1000  # an explicit limit wins
