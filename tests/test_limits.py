"""Every number and size a request can carry is bounded: a clear 400 (or 413), and the server
keeps serving. The numbers here are the ones a fuzzer used to kill the engine with."""

from __future__ import annotations

import pytest
import torch
import trio

from bench.http import Reader, address, read_response, request, request_bytes
from engine import InvalidRequestError, SamplingParams, open_engine
from engine.render.prompt_embeds import EmbedsLimits, check_prompt_embeds
from tests.conftest import TEST_SPEC, engine_config
from tests.server_fixtures import running_server
from web.http.settings import ServerSettings

BODY_LIMIT = 4096


@pytest.fixture
async def server(tiny_model_dir):
    config = engine_config(tiny_model_dir, enable_prompt_embeds=True, max_model_len=128, max_num_seqs=8)
    async with running_server(config, ServerSettings(max_body_bytes=BODY_LIMIT)) as running:
        yield running


COMPLETION = {"prompt": "Hello", "max_tokens": 4}


@pytest.mark.parametrize("path, body, param, phrase", [
    ("/v1/completions", {**COMPLETION, "seed": 2**64}, "seed", "fit 64 bits"),
    ("/v1/completions", {**COMPLETION, "seed": -(2**63) - 1}, "seed", "fit 64 bits"),
    ("/v1/completions", {**COMPLETION, "seed": 2**64 - 1, "n": 2}, "seed", "fit 64 bits"),
    ("/v1/completions", {**COMPLETION, "top_k": 2**64}, "top_k", "top_k"),
    ("/v1/completions", {**COMPLETION, "top_k": 10**6}, "top_k", "more than the limit"),
    ("/v1/completions", {**COMPLETION, "n": 2**31}, "n", "n=2147483648 is more than the limit of 8"),
    ("/v1/completions", {**COMPLETION, "n": 10**6}, "n", "more than the limit"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 2**70}, "max_tokens", "max_tokens"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 500}, "max_tokens", "maximum context length is 128"),
    ("/v1/completions", {**COMPLETION, "logprobs": 2**64}, "logprobs", "logprobs"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [2**64]}, "stop_token_ids", "stop_token_ids"),
    ("/v1/completions", {**COMPLETION, "stop": ["x"] * 65}, "stop", "at most 64 stop strings"),
    ("/v1/completions", {**COMPLETION, "temperature": 1e308 * 10}, "temperature", "finite"),
    ("/v1/completions", {"prompt": [2**64], "max_tokens": 4}, "prompt", "out of vocabulary"),
    ("/v1/completions", {**COMPLETION, "cache_salt": ""}, "cache_salt", "at least 1 character"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "seed": 2**64}, "seed", "64 bits"),
    ("/v1/embeddings", {"input": "Hello", "truncate_prompt_tokens": 2**70}, "truncate_prompt_tokens",
     "cannot be greater than max_model_len - max_tokens = 128"),
    ("/v1/embeddings", {"input": [[2**64]]}, "prompt", "out of vocabulary"),
    ("/v1/embeddings", {"input": "Hello", "dimensions": 2**64}, "dimensions", "dimensions"),
])
async def test_out_of_range_numbers_are_400s_naming_the_field(server, path, body, param, phrase):
    response = await request(server.url, "POST", path, body)
    error = response.json()["error"]
    assert response.status == 400, error
    assert error["param"] == param and phrase in error["message"], error
    healthy = await request(server.url, "POST", "/v1/completions", COMPLETION)
    assert healthy.status == 200 and server.engine.is_running


async def test_a_chunked_body_is_cut_off_with_413_at_the_limit(server):
    host = server.url.removeprefix("http://")
    stream = await _open_chunked(server.url, host)
    async with stream:
        chunk = b"x" * 1024
        for _ in range(BODY_LIMIT // len(chunk) + 2):  # a little past the limit, never the end of the body
            await stream.send_all(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        response = await read_response(Reader(stream))
    assert response.status == 413 and str(BODY_LIMIT) in response.json()["error"]["message"]
    assert (await request(server.url, "POST", "/v1/completions", COMPLETION)).status == 200


async def _open_chunked(url, host):
    stream = await trio.open_tcp_stream(*address(url))
    head = request_bytes(host, "POST", "/v1/completions", None, {"Transfer-Encoding": "chunked",
                                                                  "Content-Type": "application/json"})
    await stream.send_all(head)
    return stream


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
async def test_prompt_embeds_with_nan_or_inf_are_refused(tiny_model_dir, bad):
    embeds = torch.zeros(4, TEST_SPEC.hidden)
    embeds[2, 3] = bad
    async with open_engine(engine_config(tiny_model_dir, enable_prompt_embeds=True)) as engine:
        with pytest.raises(InvalidRequestError, match="NaN or infinite"):
            async for _ in engine.generate(embeds, SamplingParams(max_tokens=2)):
                pass


def test_values_finite_in_float32_but_not_in_the_model_dtype_are_refused():
    limits = EmbedsLimits.for_model(8, 16, torch.float16)
    with pytest.raises(InvalidRequestError, match="out of the range"):
        check_prompt_embeds(torch.full((2, 8), 1e6), limits)


async def test_cache_salt_is_accepted_on_completions_and_chat(server):
    salted = await request(server.url, "POST", "/v1/completions", {**COMPLETION, "cache_salt": "tenant-a"})
    chat = await request(server.url, "POST", "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "cache_salt": "t"})
    assert salted.status == 200 and chat.status == 200


async def test_the_number_of_prompts_in_one_request_is_bounded(engine):
    with pytest.raises(InvalidRequestError, match="2049 prompts in one request is more than the limit of 2048"):
        async for _ in engine.generate_batch([[5]] * 2049, SamplingParams(max_tokens=1)):
            pass
    with pytest.raises(InvalidRequestError, match="more than the limit of 2048"):
        await engine.encode(["a"] * 2049)
    assert engine.is_running and engine.stats().num_waiting == 0


async def test_a_prompt_that_cannot_fit_is_refused_after_tokenizing_a_prefix_only(tiny_model_dir):
    """A 15 MiB prompt took 15 s to refuse: the whole text was tokenized before the context check.
    Now only a bounded prefix is (PROBE_CHARS_PER_TOKEN per token of context), for completions and
    chat, while other requests are served; with truncate_prompt_tokens the whole text is needed and
    tokenized."""
    from engine.render.renderer import PROBE_CHARS_PER_TOKEN

    limit = 128
    huge = "hello world the engine says " * 40_000  # ~1.1 MB: 70x the probe, ~600k tokens
    config = engine_config(tiny_model_dir, max_model_len=limit, max_num_seqs=8)
    async with running_server(config, ServerSettings(max_body_bytes=4 << 20)) as server:
        tokenizer = server.engine.tokenizer
        encoded: list[int] = []
        original = tokenizer.encode

        def recording(text, *args):
            encoded.append(len(text))
            return original(text, *args)

        tokenizer.encode = recording
        async with trio.open_nursery() as nursery:
            small: list[int] = []

            async def small_requests():
                for _ in range(3):
                    small.append((await request(server.url, "POST", "/v1/completions", COMPLETION)).status)

            nursery.start_soon(small_requests)
            for path, body in (("/v1/completions", {"prompt": huge, "max_tokens": 2}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}],
                                                         "max_tokens": 2})):
                refused = await request(server.url, "POST", path, body)
                error = refused.json()["error"]
                assert refused.status == 400 and error["param"] == "prompt", refused.body[:300]
                assert f"maximum context length is {limit} tokens. However, your request has more than" in \
                    error["message"]
        assert small == [200, 200, 200]
        assert max(encoded) == PROBE_CHARS_PER_TOKEN * limit  # the prefix, never the whole text
        cut = await request(server.url, "POST", "/v1/completions",
                            {"prompt": huge, "max_tokens": 2, "truncate_prompt_tokens": 8})
        assert cut.status == 200 and cut.json()["usage"]["prompt_tokens"] == 8
        assert max(encoded) == len(huge)
