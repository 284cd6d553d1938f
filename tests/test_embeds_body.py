"""Taking prompt_embeds payloads out of a JSON body as views: every shape it accepts or hands back."""

from __future__ import annotations

import json

import pytest

from web.http.bodies import parse_body
from web.http.embeds_body import split_prompt_embeds
from web.http.errors import APIError
from web.openai.protocol import CompletionRequest


def as_text(views) -> list[str]:
    return [bytes(v).decode() for v in views]


@pytest.mark.parametrize("body, payloads, rest", [
    (b'{"prompt_embeds": "QUJD", "max_tokens": 3}', ["QUJD"], {"prompt_embeds": "", "max_tokens": 3}),
    (b'{"max_tokens":3,"prompt_embeds":"QUJD"}', ["QUJD"], {"prompt_embeds": "", "max_tokens": 3}),
    (b'{"prompt_embeds" :\n [ "QQ==" ,"Qg==",\t"Qw==" ] , "n": 1}', ["QQ==", "Qg==", "Qw=="],
     {"prompt_embeds": [], "n": 1}),
    (b'{"prompt_embeds": [], "prompt": "x"}', [], {"prompt_embeds": [], "prompt": "x"}),
])
def test_payloads_come_out_as_views_and_the_rest_still_parses(body, payloads, rest):
    skeleton, views = split_prompt_embeds(body)
    assert as_text(views) == payloads
    assert all(isinstance(v, memoryview) for v in views)
    assert json.loads(skeleton) == rest


@pytest.mark.parametrize("body", [
    b'{"prompt": "no embeddings here"}',
    b'{"prompt_embeds": "QUJD", "prompt_embeds": "QUJD"}',  # duplicated: the ordinary parser decides
    b'{"prompt_embeds": "QU\\"JD"}',  # an escaped quote: not plain base64
    b'{"prompt_embeds": ["QUJD", 5]}',
    b'{"prompt_embeds": null}',
    b'{"prompt_embeds": "unterminated',
    b'{"user": "prompt_embeds", "prompt": "x"}',  # the word as a value, not a key
])
def test_anything_unexpected_is_left_to_the_ordinary_parser(body):
    assert split_prompt_embeds(body) is None


def test_parse_body_uses_views_for_large_bodies_and_agrees_with_the_ordinary_parse():
    body = json.dumps({"prompt_embeds": ["QUJD", "REVG"], "max_tokens": 5, "prompt": ""}).encode()
    ordinary = parse_body(CompletionRequest, body)
    split = parse_body(CompletionRequest, body, split_embeds_bytes=0)
    assert as_text(split.prompt_embeds) == ordinary.prompt_embeds == ["QUJD", "REVG"]
    assert split.max_tokens == ordinary.max_tokens == 5
    assert len(split.prompts()) == 2


def test_a_bad_skeleton_is_still_a_400_naming_the_field():
    with pytest.raises(APIError) as info:
        parse_body(CompletionRequest, b'{"prompt_embeds": "QUJD", "max_tokens": "many"}', split_embeds_bytes=0)
    assert info.value.status == 400 and info.value.param == "max_tokens"
