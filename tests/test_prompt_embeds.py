"""Prompt embeddings through the engine: round trip, batching with token prompts, caching, validation."""

from __future__ import annotations

import base64
import io
import warnings

import anyio
import pytest
import torch
from safetensors.torch import load_file

from engine import InvalidRequestError, SamplingParams, open_engine
from engine.render.prompt_embeds import EmbedsLimits, decode_prompt_embeds
from tests.conftest import TEST_SPEC, engine_config
from tests.helpers import final_output, greedy

PROMPTS = [[5, 17, 99, 3, 250, 8, 41], list(range(30, 70)), [400, 2, 9]]


def embedding_table(model_dir: str) -> torch.Tensor:
    return load_file(f"{model_dir}/model.safetensors")["model.embed_tokens.weight"]


def encode(tensor: torch.Tensor) -> str:
    """What a client sends: base64 of a torch.save file."""
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture
async def embeds_engine(tiny_model_dir):
    async with open_engine(engine_config(tiny_model_dir, enable_prompt_embeds=True)) as engine:
        yield engine


async def test_embeddings_of_a_token_prompt_generate_what_the_tokens_do(embeds_engine, tiny_model_dir):
    table = embedding_table(tiny_model_dir)
    for ids in PROMPTS:
        from_tokens = await final_output(embeds_engine, ids, greedy(12, ignore_eos=True))
        from_tensor = await final_output(embeds_engine, table[ids], greedy(12, ignore_eos=True))
        from_payload = await final_output(embeds_engine, {"prompt_embeds": encode(table[ids].unsqueeze(0))},
                                          greedy(12, ignore_eos=True))
        assert from_tensor.outputs[0].token_ids == from_tokens.outputs[0].token_ids
        assert from_payload.outputs[0].token_ids == from_tokens.outputs[0].token_ids
        assert from_tensor.prompt_token_ids == [] and from_tensor.num_prompt_tokens == len(ids)


async def test_embeddings_and_token_prompts_share_steps(tiny_model_dir):
    """Mixed in one batch (and chunked: a budget of 16 tokens splits the long prompt), each
    embeddings prompt still generates exactly what its token twin does."""
    table = embedding_table(tiny_model_dir)
    config = engine_config(tiny_model_dir, enable_prompt_embeds=True, max_num_batched_tokens=16)
    async with open_engine(config) as engine:
        prompts = [p for ids in PROMPTS for p in (ids, table[ids])]
        finals = {}
        async for index, output in engine.generate_batch(prompts, greedy(10, ignore_eos=True)):
            finals[index] = output
        # One prompt at a time would take about 64 steps (prefill chunks plus 9 decodes each); batched
        # together they take about 20.
        assert engine.core.num_steps < 40
    for i in range(0, len(prompts), 2):
        assert finals[i + 1].outputs[0].token_ids == finals[i].outputs[0].token_ids


async def test_embeddings_never_hit_the_prefix_cache_of_token_prompts(embeds_engine, tiny_model_dir):
    ids = list(range(100, 164))  # four full blocks
    await final_output(embeds_engine, ids, greedy(2))
    out = await final_output(embeds_engine, embedding_table(tiny_model_dir)[ids] * 0.5, greedy(2))
    assert out.num_cached_tokens == 0
    again = await final_output(embeds_engine, ids, greedy(2))
    assert again.num_cached_tokens == 48  # token prompts still share their own prefix


async def test_disabled_by_default_with_a_message_saying_how_to_enable(engine):
    with pytest.raises(InvalidRequestError, match="--enable-prompt-embeds") as info:
        await final_output(engine, torch.zeros(3, TEST_SPEC.hidden), greedy(2))
    assert info.value.param == "prompt_embeds"


async def test_prompt_logprobs_are_refused_for_embeddings(embeds_engine):
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        await final_output(embeds_engine, torch.zeros(3, TEST_SPEC.hidden), greedy(2, prompt_logprobs=1))


async def test_batch_results_come_back_in_input_order_whatever_the_decode_cost(embeds_engine, tiny_model_dir):
    """Payloads of very different sizes decode concurrently; outputs are matched to their input."""
    table = embedding_table(tiny_model_dir)
    sizes = [200, 3, 120, 1, 60]
    prompts = [encode(table[list(range(10, 10 + n))]) for n in sizes]
    finals = {}
    async for index, output in embeds_engine.generate_batch([{"prompt_embeds": p} for p in prompts], greedy(1)):
        finals[index] = output
    assert [finals[i].num_prompt_tokens for i in range(len(sizes))] == sizes


async def test_one_bad_payload_fails_the_batch_and_runs_nothing(embeds_engine):
    good = encode(torch.zeros(4, TEST_SPEC.hidden))
    bad = encode(torch.zeros(4, TEST_SPEC.hidden + 1))
    with pytest.raises(InvalidRequestError, match="hidden size is 65"):
        async for _ in embeds_engine.generate_batch([{"prompt_embeds": good}, {"prompt_embeds": bad}], greedy(2)):
            pass
    assert embeds_engine.core.num_requests == 0 and embeds_engine.core.num_steps == 0


# ---- payload validation (the decoder alone) -------------------------------------------------------
LIMITS = EmbedsLimits.for_model(hidden_size=8, max_model_len=16, dtype=torch.float32)


class RunsCode:
    """Pickles to a call of `marker.touch()`: loading it with plain pickle would create the file."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (type(self.marker).touch, (self.marker,))


def saved(obj) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return encode(obj) if isinstance(obj, torch.Tensor) else _encode_object(obj)


def _encode_object(obj) -> str:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


BAD_PAYLOADS = {
    "sparse out of bounds": (lambda tmp: saved(torch.sparse_coo_tensor(
        torch.tensor([[0, 99], [0, 1]]), torch.ones(2), (4, 8), check_invariants=False)), "invalid sparse tensor"),
    "not a tensor": (lambda tmp: saved({"weights": [1, 2, 3]}), "holds a dict, not a tensor"),
    "3-D": (lambda tmp: saved(torch.zeros(2, 3, 8)), "must have 2 dimensions"),
    "1-D": (lambda tmp: saved(torch.zeros(8)), "must have 2 dimensions"),
    "hidden size": (lambda tmp: saved(torch.zeros(3, 7)), "hidden size is 7, the model's is 8"),
    "integer dtype": (lambda tmp: saved(torch.zeros(3, 8, dtype=torch.int32)), "floating-point"),
    "bool dtype": (lambda tmp: saved(torch.zeros(3, 8, dtype=torch.bool)), "floating-point"),
    "invalid base64": (lambda tmp: "not*base64!", "not valid base64"),
    "over the byte limit": (lambda tmp: "A" * (LIMITS.max_payload_bytes * 2), "larger than the limit"),
    "more rows than the context": (lambda tmp: saved(torch.zeros(16, 8)), "at most 15"),
    "no rows": (lambda tmp: saved(torch.zeros(0, 8)), "no rows"),
    "legacy format": (lambda tmp: base64.b64encode(b"\x80\x02}q\x00.").decode(), "not a torch.save archive"),
}


@pytest.mark.parametrize("name", BAD_PAYLOADS)
def test_bad_payloads_are_refused_with_the_reason(name, tmp_path):
    make, reason = BAD_PAYLOADS[name]
    with pytest.raises(InvalidRequestError, match=reason) as info:
        decode_prompt_embeds(make(tmp_path), LIMITS)
    assert info.value.param == "prompt_embeds"


def test_a_pickle_that_would_run_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    payload = saved(RunsCode(marker))
    torch.load(io.BytesIO(base64.b64decode(payload)), weights_only=False)  # the payload is live: plain loading runs it
    assert marker.exists()
    marker.unlink()
    with pytest.raises(InvalidRequestError, match="may not"):
        decode_prompt_embeds(payload, LIMITS)
    assert not marker.exists()


def test_valid_payloads_decode_to_the_model_dtype():
    rows = torch.randn(1, 5, 8, dtype=torch.bfloat16)  # leading batch dimension of 1 is dropped
    out = decode_prompt_embeds(saved(rows), LIMITS)
    assert out.shape == (5, 8) and out.dtype == torch.float32 and torch.equal(out, rows[0].float())
    dense = torch.zeros(4, 8)
    dense[1, 3], dense[2, 0] = 1.5, -2.0
    assert torch.equal(decode_prompt_embeds(saved(dense.to_sparse()), LIMITS), dense)
    strided = torch.randn(8, 6)[:, 1:].t()[:, :]  # a non-contiguous view saves its whole storage
    assert strided.shape == (5, 8)
    assert torch.equal(decode_prompt_embeds(saved(strided), LIMITS), strided)


async def test_concurrent_decodes_in_threads_give_each_caller_its_own_tensor():
    payloads = [saved(torch.full((3, 8), float(i))) for i in range(24)]
    results: dict[int, torch.Tensor] = {}
    limiter = anyio.CapacityLimiter(6)

    async def decode(i: int) -> None:
        results[i] = await anyio.to_thread.run_sync(decode_prompt_embeds, payloads[i], LIMITS, limiter=limiter)

    async with anyio.create_task_group() as tg:
        for i in range(len(payloads)):
            tg.start_soon(decode, i)
    assert all(torch.equal(results[i], torch.full((3, 8), float(i))) for i in range(len(payloads)))


def test_sampling_params_penalties_ignore_placeholder_prompt_ids(tiny_model_dir):
    """Repetition penalty on an embeddings prompt must not penalise the placeholder id 0."""
    from engine.worker.model_runner import RequestState
    state = RequestState([0, 0, 0], SamplingParams(repetition_penalty=2.0), None, torch.zeros(3, 4))
    assert state.penalty_prompt_ids == []


def test_out_of_memory_while_loading_is_reraised_not_reported_as_a_bad_payload(monkeypatch):
    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 99 bytes")

    monkeypatch.setattr(torch, "sparse_coo_tensor", no_memory)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        decode_prompt_embeds(saved(torch.zeros(4, 8).to_sparse()), LIMITS)


async def test_a_bad_prompt_cancels_the_siblings_still_rendering(tiny_model_dir, autojump_clock):
    """The long text waits for the renderer's only thread slot (held here); the bad token
    prompt fails at once, which must cancel that wait rather than leave it queued."""
    import trio

    from engine.render.renderer import INLINE_TOKENIZE_CHARS, Renderer
    from engine.render.tokenizer import Tokenizer
    limiter = anyio.CapacityLimiter(1)
    renderer = Renderer(Tokenizer(tiny_model_dir), TEST_SPEC.vocab, limiter, LIMITS)
    await limiter.acquire()
    with trio.fail_after(1):
        with pytest.raises(InvalidRequestError, match="out of vocabulary"):
            await renderer.render(["x" * INLINE_TOKENIZE_CHARS, [TEST_SPEC.vocab + 7]])
    assert limiter.statistics().tasks_waiting == 0
    limiter.release()
