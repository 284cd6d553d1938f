"""The compiled decode graphs (engine.worker.decode_graphs) against transformers and the eager model.

These are the only tests that compile (conftest sets TRIO_LLM_ENFORCE_EAGER for the rest); they
compile one graph per checkpoint (batch sizes up to 8 at most) to keep the suite fast.
"""

from __future__ import annotations

import copy
import ctypes
import os
import random
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import trio
from torch._dynamo.utils import counters

from bench.together import tokens_together
from engine import EngineConfig, open_engine
from engine.config import CompilationConfig
from engine.cpu_binding import CpuLayout, available_cpus
from engine.models import attention, layers, packed_linear
from engine.models.attention import (
    PROMPT_QUERY_BLOCK,
    DecodeMetadata,
    SequenceChunk,
    build_metadata,
    causal_prompt_attention,
    gathered_decode_attention,
    paged_attention,
    paged_decode_attention,
)
from engine.paths import cache_root
from engine.sampling_params import SamplingParams
from engine.worker import aoti_runner, precompiled_graph
from engine.worker.decode_graphs import TRACE_ROWS, DecodeGraphs, compile_estimate, keep_headers_in, use_compile_cache
from engine.worker.step_graph import StepGraph
from engine.worker.worker import Worker
from tests.helpers import final_output, greedy
from tests.model_helpers import decided_prefix, decode_package_code, save_hf_checkpoint, transformers_greedy
from tests.test_moe_eplb import FAMILIES as MOE_FAMILIES
from tests.test_moe_eplb import hf_moe
from tests.test_reference_transformers import COMMON, FAMILIES, VOCAB

BF16_TIE = 0.02  # top two logits within 2% of the largest are a tie in bfloat16 (8 significant bits)


def compiled_config(path, sizes=(2, 8), compile_prompts=False, **options) -> EngineConfig:
    """Compiled decodes; prompts on the step graph only where a test asks (each is ~10 s to compile)."""
    options = {"enforce_eager": False, **options}
    options = {"dtype": "float32", **options}
    compilation = CompilationConfig(cudagraph_capture_sizes=sizes, compile_prompts=compile_prompts)
    options = {"max_num_batched_tokens": 48, **options}
    return EngineConfig(model=str(path), num_kv_blocks=128, compilation_config=compilation, **options)


ARCHITECTURES = [*sorted(FAMILIES), "mixtral"]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoint(request, tmp_path_factory):
    """A tiny random checkpoint saved by transformers, and transformers' model of it."""
    if request.param in MOE_FAMILIES:
        return hf_moe(tmp_path_factory, request.param)
    config_cls, model_cls, extra = FAMILIES[request.param]
    return save_hf_checkpoint(tmp_path_factory, request.param, config_cls, model_cls, {**COMMON, **extra})


async def engine_greedy(config: EngineConfig, prompts: list[list[int]], max_tokens: int, together: bool = True,
                        prompt_steps: list[int] | None = None):
    """Greedy tokens per prompt (all at once, or one after another), and the compiled decode steps
    run (the steps the step graph ran are appended to `prompt_steps`, if given)."""
    got: dict[int, list[int]] = {}
    async with open_engine(config) as engine:
        async def run(i):
            got[i] = (await final_output(engine, prompts[i], greedy(max_tokens, ignore_eos=True))).outputs[0].token_ids

        if together:
            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(run, i)
        else:
            for i in range(len(prompts)):
                await run(i)
        runner = engine.core.executor.worker.runner
        steps = runner.decode_graphs.steps_run if runner.decode_graphs is not None else 0
        if prompt_steps is not None:
            prompt_steps.append(runner.step_graph.steps_run if runner.step_graph is not None else 0)
    return [got[i] for i in range(len(prompts))], steps


@pytest.fixture
def weights(request, monkeypatch):
    """How the linears hold their weights: as stored (the tiny models' own: too small to pack), or
    every one packed for oneDNN, as a real model's are (engine/models/packed_linear.py)."""
    if request.param == "packed":
        monkeypatch.setattr(packed_linear, "PACK_MIN_ELEMENTS", 0)
    return request.param


# Every architecture's graph ops, compiled, with its linears packed (as a real model's are); weights
# as stored once, on llama: the stored linear is the same op in every architecture, and llama's own
# ops (its rope scaling lives in the tables) are all in the others' graphs. Mistral's one addition,
# the window in the decode graph's attention, is phi3's too. Each compile costs ~25 s of the suite cold.
COMPILED_PACKED = [a for a in ARCHITECTURES if a not in ("llama", "mistral")]
# The step graph holds the same layers as the decode graph, attention left out as one opaque op
# whose only family-dependent inputs are the window and the KV cache group: compiled for the hybrid
# layout (gemma3), the most ops (qwen3) and the MoE model (whose prompts stay eager), not for every
# family (another ~10 s each cold).
STEP_GRAPH_FAMILIES = ("gemma3", "qwen3", "mixtral")


# (llama with its weights as stored is compiled by the background compile's test below)
@pytest.mark.parametrize(("checkpoint", "weights"), [(a, "packed") for a in COMPILED_PACKED], indirect=True)
async def test_compiled_and_eager_give_transformers_greedy_tokens(checkpoint, weights, request):
    """With every linear packed, as a real model's are, the prompts run on the step graph too
    (a dense model's: an MoE model's prompts stay eager)."""
    path, hf_model = checkpoint
    rng = random.Random(2)
    prompts = [rng.choices(range(3, VOCAB), k=n) for n in (3, 11, 17, 29, 40)]
    expected = transformers_greedy(hf_model, prompts, 24)
    prompt_steps: list[int] = []
    compile_prompts = weights == "packed" and request.node.callspec.params["checkpoint"] in STEP_GRAPH_FAMILIES
    config = compiled_config(path, compile_prompts=compile_prompts)
    compiled, compiled_steps = await engine_greedy(config, prompts, 24, prompt_steps=prompt_steps)
    eager, eager_steps = await engine_greedy(compiled_config(path, enforce_eager=True), prompts, 24)
    assert compiled == expected
    assert eager == expected
    assert compiled_steps >= 20 and eager_steps == 0  # the decode steps did run compiled
    dense = request.node.callspec.params["checkpoint"] != "mixtral"
    assert (prompt_steps[0] > 0) == (compile_prompts and dense)


@pytest.fixture
def fresh_package_dir(tmp_path, monkeypatch) -> Path:
    """An empty directory for compiled packages (a rerun must compile again), whose inductor
    headers and probe are the other tests' (a link: building them is ~28 s); inductor's own
    directory is given back after the test (an engine's cache_dir becomes it)."""
    shared = Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(use_compile_cache(None))))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared))
    (shared / "precompiled_headers").mkdir(parents=True, exist_ok=True)
    (tmp_path / "precompiled_headers").symlink_to(shared / "precompiled_headers")
    for memo in shared.glob("vec-isa-probe-*"):
        shutil.copy(memo, tmp_path / memo.name)
    return tmp_path


async def test_a_first_start_serves_on_the_eager_model_while_a_child_compiles_then_on_the_graphs(
        tmp_path_factory, fresh_package_dir):
    """`compile_in_background` (`serve`'s default): the engine serves once the model is loaded; a
    child process compiles and saves the decode and step graphs meanwhile, and the worker switches
    to them between two steps. The tokens are transformers' before and after the switch."""
    config_cls, model_cls, extra = FAMILIES["llama"]
    path, hf_model = save_hf_checkpoint(tmp_path_factory, "llama-stored", config_cls, model_cls, {**COMMON, **extra})
    rng = random.Random(2)
    prompts = [rng.choices(range(3, VOCAB), k=n) for n in (3, 11, 17, 29, 40)]
    expected = transformers_greedy(hf_model, prompts, 24)
    config = compiled_config(path, compile_prompts=True, compile_in_background=True)
    config = replace(config, compilation_config=replace(config.compilation_config, cache_dir=str(fresh_package_dir)))
    async with open_engine(config) as engine:
        runner = engine.core.executor.worker.runner
        assert (runner.decode_graphs, runner.step_graph) == (None, None)  # serving before any graph exists
        assert not engine.core.graphs_settled.is_set()
        eager = [(await final_output(engine, p, greedy(24, ignore_eos=True))).outputs[0].token_ids for p in prompts]
        with trio.fail_after(600):
            await engine.core.graphs_settled.wait()
        graphs, step_graph = runner.decode_graphs, runner.step_graph
        assert graphs is not None and step_graph is not None
        assert graphs.loaded_from_disk and step_graph.loaded_from_disk  # the child's, loaded
        compiled = await tokens_together(engine, prompts, greedy(24, ignore_eos=True))
        assert graphs.steps_run >= 20 and step_graph.steps_run > 0
    assert eager == expected
    assert compiled == expected


# Compiled in bfloat16: one dense architecture (qwen3, with the most ops: q/k norms) and the MoE one;
# the float32 test compiles every architecture, and the eager model runs every one in bfloat16 here.
BF16_COMPILED = ("qwen3", "mixtral")


async def test_bfloat16_compiled_and_eager_give_transformers_bfloat16_greedy_tokens(checkpoint, monkeypatch):
    """In bfloat16, every linear packed (oneDNN's bfloat16 path where the CPU has one). Tokens are
    compared up to transformers' first near tie (top two logits within BF16_TIE): there bfloat16
    rounding decides, in transformers as in us (qwen3's eager path parted at token 10 of 16 from
    transformers with weights as stored, at a tie of this size). The test asks for a third of the
    tokens decided, so it cannot pass by deciding nothing."""
    path, hf_model = checkpoint
    monkeypatch.setattr(packed_linear, "PACK_MIN_ELEMENTS", 0)
    hf_bf16 = copy.deepcopy(hf_model).to(torch.bfloat16)
    rng = random.Random(3)
    prompts = [rng.choices(range(3, VOCAB), k=n) for n in (5, 19, 33)]
    expected = transformers_greedy(hf_bf16, prompts, 16)
    decided = [decided_prefix(hf_bf16, p, e, BF16_TIE) for p, e in zip(prompts, expected, strict=True)]
    assert sum(decided) >= 16 * len(prompts) // 3
    runs = [await engine_greedy(compiled_config(path, dtype="bfloat16", enforce_eager=True), prompts, 16)]
    if any(name in Path(path).name for name in BF16_COMPILED):
        runs.append(await engine_greedy(compiled_config(path, dtype="bfloat16"), prompts, 16))
        assert runs[-1][1] >= 12  # the decodes did run compiled
    for got, _ in runs:
        assert [g[:n] for g, n in zip(got, decided, strict=True)] == [e[:n] for e, n in zip(expected, decided,
                                                                                            strict=True)]


async def test_a_batch_of_three_equals_three_batches_of_one(tmp_path_factory):
    """Three sequences run as a batch of 3 on the one graph; alone, each is padded to two rows (one
    scratch row). Different contexts make the block tables differ in width within the batch."""
    path, _ = _dense(tmp_path_factory)
    rng = random.Random(5)
    prompts = [rng.choices(range(3, VOCAB), k=n) for n in (5, 21, 38)]
    config = compiled_config(path, sizes=(1, 4), enable_prefix_caching=False)
    together, steps_together = await engine_greedy(config, prompts, 30)
    alone, steps_alone = await engine_greedy(config, prompts, 30, together=False)
    assert together == alone
    assert steps_together >= 25 and steps_alone >= 3 * 29


async def _tokens_and_lean_steps(config: EngineConfig, prompts: list[list[int]],
                                 params: list[SamplingParams]) -> tuple[list[list[int]], int]:
    """Each prompt's tokens (run together), and the burst steps run on `LeanBurst`."""
    got: dict[int, list[int]] = {}
    async with open_engine(config) as engine:
        async def run(i):
            got[i] = list((await final_output(engine, prompts[i], params[i])).outputs[0].token_ids)

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(run, i)
        lean_steps = engine.core.executor.worker.runner.lean_burst_steps
    return [got[i] for i in range(len(prompts))], lean_steps


async def test_bursts_run_on_the_graphs_alone_unless_a_request_needs_more_than_its_logits(tmp_path_factory):
    """Requests whose tokens come from their logits alone (greedy, or drawn with temperature, top-p
    and a seed) run a streamed burst's later steps on `LeanBurst` (graph, head, choice) and get the
    tokens of the engine that runs one decode a step. Beside a request that wants logprobs a burst
    keeps the general step; so does one whose `min_tokens` still masks a stop token, until it is
    reached; every request still gets the one-step engine's tokens."""
    path, _ = _dense(tmp_path_factory)
    rng = random.Random(8)
    prompts = [rng.choices(range(3, VOCAB), k=n) for n in (6, 19, 33)]

    async def both(prompts, params):
        want, _ = await _tokens_and_lean_steps(compiled_config(path, num_scheduler_steps=1), prompts, params)
        got, lean_steps = await _tokens_and_lean_steps(compiled_config(path), prompts, params)
        assert got == want
        return want, lean_steps

    plain, lean_steps = await both(prompts, [greedy(40, ignore_eos=True)] * 3)
    assert lean_steps >= 30  # most of each request's 40 decodes, three requests a step

    drawn = [SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=40, ignore_eos=True),
             SamplingParams(temperature=1.0, top_k=20, seed=4, max_tokens=40, ignore_eos=True),
             greedy(40, ignore_eos=True)]
    sampled, lean_steps = await both(prompts, drawn)
    assert lean_steps >= 30 and sampled[0] != plain[0]  # drawn, not greedy, and on `LeanBurst`

    beside_logprobs = [greedy(48, ignore_eos=True, logprobs=1), *[greedy(40, ignore_eos=True)] * 2]
    _, lean_steps = await both(prompts, beside_logprobs)
    assert lean_steps == 0  # the logprobs request, the longest, shares every burst

    # Greedy's seventh token, masked while fewer than 30 are out: a burst that ran on `LeanBurst`
    # from the first decode on would choose it there.
    stop = plain[1][6]
    masked, _ = await both(prompts[1:2], [greedy(48, min_tokens=30, stop_token_ids=[stop])])
    assert masked[0][6] != stop and len(masked[0]) >= 30


async def test_every_batch_size_runs_the_one_graph_compiled_at_start_up(tmp_path_factory):
    """Batches of 1 to 6 sequences (requests finishing at different lengths shrink the batch step
    by step) and growing block tables compile nothing after start-up."""
    path, _ = _dense(tmp_path_factory)
    rng = random.Random(11)
    prompts = [rng.choices(range(3, VOCAB), k=n) for n in (4, 9, 15, 22, 30, 37)]
    config = compiled_config(path, sizes=(1, 8), enable_prefix_caching=False)
    graphs_before = None
    async with open_engine(config) as engine:
        graphs_before = counters["stats"]["unique_graphs"]
        async with trio.open_nursery() as nursery:
            for i, prompt in enumerate(prompts):
                nursery.start_soon(final_output, engine, prompt, greedy(6 + 5 * i, ignore_eos=True))
        steps_run = engine.core.executor.worker.runner.decode_graphs.steps_run
    assert counters["stats"]["unique_graphs"] == graphs_before
    assert steps_run >= 30  # the decodes did run compiled, at sizes 6 down to 1


@pytest.mark.parametrize("compile_prompts", [False, True])
async def test_decodes_of_mixed_steps_run_compiled_beside_the_prompt_chunks(tmp_path_factory, compile_prompts):
    """A long prompt arrives while another request decodes: its chunks (48 tokens a step) run
    eager or on the step graph, the decode beside them on its graph, and both requests get
    transformers' tokens."""
    path, hf_model = _dense(tmp_path_factory)
    rng = random.Random(9)
    short, long = rng.choices(range(3, VOCAB), k=3), rng.choices(range(3, VOCAB), k=130)
    expected = transformers_greedy(hf_model, [short, long], 20)
    # One decode a step (no CPU burst while the short one decodes alone): steps are counted below.
    config = compiled_config(path, sizes=(1, 2), compile_prompts=compile_prompts, num_scheduler_steps=1)
    async with open_engine(config) as engine:
        got = {}
        started = trio.Event()

        async def run(name, prompt):
            async for output in engine.generate(prompt, greedy(20, ignore_eos=True)):
                started.set()
                got[name] = output.outputs[0].token_ids

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "short", short)
            await started.wait()  # decoding when the long prompt comes
            nursery.start_soon(run, "long", long)
        runner = engine.core.executor.worker.runner
        steps, compiled = engine.core.num_steps, runner.decode_graphs.steps_run
        prompt_steps = runner.step_graph.steps_run if compile_prompts else 0
    assert [got["short"], got["long"]] == expected
    assert compiled == steps - 1  # every step but the short prompt's own ran its decodes compiled
    # the short prompt, and the long one's three chunks (130 tokens, 48 a step)
    assert prompt_steps == (4 if compile_prompts else 0)


F16_TIE = 0.002  # top two logits within 0.2% of the largest: a float16 cache's rounding may decide


async def test_a_float16_kv_cache_under_a_float32_model_decodes_compiled_as_eagerly(tmp_path_factory):
    """--kv-cache-dtype float16 (llama.cpp's cache) under a float32 model: the compiled decode
    graph reads the 16-bit cache and computes what the eager path does, both transformers' tokens
    up to its first near tie (keys and values rounded to float16 move the logits by ~1e-3)."""
    path, hf_model = _dense(tmp_path_factory)
    rng = random.Random(13)
    prompts = [rng.choices(range(3, VOCAB), k=n) for n in (6, 23, 35)]
    expected = transformers_greedy(hf_model, prompts, 16)
    decided = [decided_prefix(hf_model, p, e, F16_TIE) for p, e in zip(prompts, expected, strict=True)]
    assert sum(decided) >= 16 * len(prompts) // 3
    compiled, steps = await engine_greedy(compiled_config(path, sizes=(1, 4), kv_cache_dtype="float16"), prompts, 16)
    eager, _ = await engine_greedy(compiled_config(path, enforce_eager=True, kv_cache_dtype="float16"), prompts, 16)
    assert steps >= 12  # the decodes did run compiled
    for got in (compiled, eager):
        assert [g[:n] for g, n in zip(got, decided, strict=True)] == [e[:n] for e, n in zip(expected, decided,
                                                                                            strict=True)]


def test_a_16_bit_kv_cache_holds_twice_a_float32_models_tokens_in_the_same_bytes(tmp_path_factory):
    path, _ = _dense(tmp_path_factory)
    infos, caches = {}, {}
    for choice in ("auto", "float16", "bfloat16"):
        worker = Worker(EngineConfig(model=str(path), dtype="float32", enforce_eager=True, kv_cache_dtype=choice))
        infos[choice] = worker.load_model()
        worker.initialize_kv_cache(4)
        caches[choice] = {t.dtype for pair in worker.runner.kv_caches for t in pair}
    assert caches == {"auto": {torch.float32}, "float16": {torch.float16}, "bfloat16": {torch.bfloat16}}
    assert infos["float16"].kv_bytes_per_block * 2 == infos["auto"].kv_bytes_per_block
    assert infos["bfloat16"].kv_bytes_per_block == infos["float16"].kv_bytes_per_block
    assert (infos["auto"].kv_cache_dtype, infos["float16"].kv_cache_dtype) == ("float32", "float16")


def decode_graphs(path, cache_dir) -> DecodeGraphs:
    """The decode graph (batches up to 4) of the checkpoint at `path` over a small KV cache,
    saved under `cache_dir`; not yet compiled."""
    config = EngineConfig(model=str(path), dtype="float32", enforce_eager=True, num_kv_blocks=16, max_num_seqs=4)
    worker = Worker(config)
    worker.load_model()
    worker.initialize_kv_cache(17)  # the last: the graph's scratch block
    runner = worker.runner
    return DecodeGraphs(runner.model, runner.kv_caches, config.block_size, 16, (1, 4), cache_dir)


def decode_step(graphs: DecodeGraphs, seed: int):
    """Final hidden states of three sequences at positions 0-2 of blocks 0-2 (random inputs)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, graphs.model.config.hidden_size, generator=generator)
    size = graphs.block_size
    with torch.inference_mode():
        return graphs.run(hidden, torch.tensor([0, 1, 2]), [0, size + 1, 2 * size + 2], [1, 2, 3], [[0], [1], [2]])


@pytest.fixture(scope="module")
def first_start(tmp_path_factory) -> tuple[DecodeGraphs, Path]:
    """The Llama's decode graph compiled on a first start, and the cache directory it was saved in
    (shared: compiling costs ~10 s; tests copy the directory before changing it)."""
    llama, _ = _dense(tmp_path_factory)
    cache = tmp_path_factory.mktemp("first-start-cache")
    graphs = decode_graphs(llama, cache)
    graphs.compile_all()
    assert not graphs.loaded_from_disk
    return graphs, cache


def test_a_restart_loads_the_saved_graph_and_an_unreadable_or_wrong_one_is_compiled_again(
        tmp_path_factory, tmp_path, first_start, caplog):
    """The first start compiles and saves; the next loads it (no tracing) and computes the same;
    a file that cannot be read, or one whose graph disagrees with the model, is replaced."""
    llama, _ = _dense(tmp_path_factory)
    first, cache = first_start
    shutil.copytree(cache, tmp_path, dirs_exist_ok=True)
    (saved,) = (tmp_path / "decode-graphs").iterdir()
    second = decode_graphs(llama, tmp_path)
    traced_before = counters["stats"]["unique_graphs"]
    second.compile_all()
    assert (first.loaded_from_disk, second.loaded_from_disk) == (False, True)
    assert counters["stats"]["unique_graphs"] == traced_before
    assert torch.equal(decode_step(first, 1), decode_step(second, 1))

    # What compile_all asks first: an unreadable file is refused under its own path, where the graph
    # is then compiled and saved (as the first start did: ~20 s of the suite cold, so not again here)
    package = saved.read_bytes()
    saved.write_bytes(b"not a graph")
    third = decode_graphs(llama, tmp_path)
    with torch.inference_mode():
        path, step = precompiled_graph.saved(tmp_path, third.model, third.kv_caches, third.block_size,
                                             TRACE_ROWS, "decode", third._agrees_with_eager)
    assert (path, step) == (saved, None) and "could not load the compiled decode graph" in caplog.text

    # Qwen2 has the same shapes as this Llama, plus q/k/v biases the Llama graph never reads
    # (non-zero here): a graph filed under the wrong name runs, and the check against the eager
    # model catches it.
    config_cls, model_cls, extra = FAMILIES["qwen2"]
    qwen2, _ = save_hf_checkpoint(tmp_path_factory, "qwen2-same-shapes", config_cls, model_cls, {**COMMON, **extra})
    fourth = decode_graphs(qwen2, tmp_path)
    biases = [p for name, p in fourth.model.named_parameters() if name.endswith("bias")]
    assert biases
    with torch.no_grad():
        for bias in biases:
            bias.normal_(generator=torch.Generator().manual_seed(3))
    own = precompiled_graph.artefact_path(tmp_path, fourth.model, fourth.kv_caches, fourth.block_size, TRACE_ROWS)
    own.write_bytes(package)
    # What compile_all asks first: the saved graph is refused (so it compiles again, as the third did)
    with torch.inference_mode():
        path, step = precompiled_graph.saved(tmp_path, fourth.model, fourth.kv_caches, fourth.block_size,
                                             TRACE_ROWS, "decode", fourth._agrees_with_eager)
    assert (path, step) == (own, None) and "disagrees with the model" in caplog.text


def step_graph(path, cache_dir) -> StepGraph:
    """The step graph of the checkpoint at `path` over a small KV cache, saved under `cache_dir`;
    not yet compiled."""
    config = EngineConfig(model=str(path), dtype="float32", enforce_eager=True, num_kv_blocks=16)
    worker = Worker(config)
    worker.load_model()
    worker.initialize_kv_cache(17)  # the last: the graph's scratch block
    runner = worker.runner
    return StepGraph(runner.model, runner.kv_caches, config.block_size, 16, cache_dir)


def test_the_step_graph_equals_the_eager_model_on_a_mixed_batch_and_a_restart_loads_it(tmp_path_factory, tmp_path):
    """One graph for any batch: a decode over a cached context, a prompt chunk continuing a cached
    sequence and a fresh prompt, in one step, compute what the eager model does (attention runs
    eagerly inside the graph, on the step's metadata). The next start loads the saved graph."""
    llama, _ = _dense(tmp_path_factory)
    first = step_graph(llama, tmp_path)
    first.compile()
    second = step_graph(llama, tmp_path)
    traced_before = counters["stats"]["unique_graphs"]
    second.compile()
    assert (first.loaded_from_disk, second.loaded_from_disk) == (False, True)
    assert counters["stats"]["unique_graphs"] == traced_before
    size = second.block_size
    chunks = [SequenceChunk(20, 1, [0, 1]), SequenceChunk(size, 9, [2, 3]), SequenceChunk(0, 7, [4])]
    generator = torch.Generator().manual_seed(4)
    for k_cache, v_cache in second.kv_caches:  # cached contexts that are not zeros
        k_cache.normal_(generator=generator)
        v_cache.normal_(generator=generator)
    hidden = torch.randn(17, second.model.config.hidden_size, generator=generator)
    positions = torch.tensor([p for c in chunks for p in range(c.start_position, c.start_position + c.num_tokens)])
    meta = build_metadata(chunks, size, torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        want = second.model(hidden, positions, second.kv_caches, meta)
        got = second.run(hidden, positions, meta)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert second.steps_run == 1
    assert not second.takes(1) and second.takes(2)  # one token is a size export specialises: eager


def _dense(tmp_path_factory):
    config_cls, model_cls, extra = FAMILIES["llama"]
    return save_hf_checkpoint(tmp_path_factory, "llama-pad", config_cls, model_cls, {**COMMON, **extra}, seed=1)


@pytest.mark.parametrize(("text", "message"), [
    ('{"cudagraph_capture_sizes": []}', "non-empty list of positive integers"),
    ('{"cudagraph_capture_sizes": [0, 2]}', "non-empty list of positive integers"),
    ('{"backend": "inductor"}', "unknown key 'backend'"),
    ('{"mode": "max"}', "compilation_config.mode must be 0, 1, 2 or 3"),
    ("[1]", "must be a JSON object"),
])
def test_bad_compilation_config_is_refused_naming_the_problem(text, message):
    with pytest.raises(ValueError, match=message):
        CompilationConfig.from_json(text)


def test_decode_batch_sizes_default_to_powers_of_two_capped_by_max_num_seqs():
    assert EngineConfig(model="m", max_num_seqs=256).decode_batch_sizes == (1, 2, 4, 8, 16, 32, 64)
    assert EngineConfig(model="m", max_num_seqs=12).decode_batch_sizes == (1, 2, 4, 8, 12)
    sizes = CompilationConfig(cudagraph_capture_sizes=[8, 1, 8])
    assert EngineConfig(model="m", compilation_config=sizes).decode_batch_sizes == (1, 8)


def test_serve_flags_reach_the_engine_config():
    from web.cli import _parser
    from web.options import engine_config

    args = _parser().parse_args(["serve", "m", "--enforce-eager", "-cc", '{"cudagraph_capture_sizes": [4, 1]}'])
    config = engine_config("m", args)
    assert config.enforce_eager is True and config.eager
    assert config.decode_batch_sizes == (1, 4)
    default = engine_config("m", _parser().parse_args(["serve", "m"]))
    assert default.enforce_eager is None  # compile, unless TRIO_LLM_ENFORCE_EAGER says otherwise
    assert default.compilation_config == CompilationConfig()


def test_the_vector_isa_probe_runs_once_per_machine_and_its_answer_is_kept(tmp_path, monkeypatch):
    """The first start probes and records; a later one reads the record instead of probing, and
    a recorded failure leaves inductor probing as it would."""
    import platform

    from torch._inductor import config as inductor_config
    from torch._inductor import cpu_vec_isa

    from engine.worker.decode_graphs import settle_vector_isa

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.fail("this test's machine is expected to be x86 (CI's is)")
    # inductor's own patch restores the setting on exit: pytest 9.2's monkeypatch (CI installs the
    # latest; 9.0 did not) records a config module's setting as unset and deletes it on undo,
    # which hides it from every later reader in the process.
    with inductor_config.patch({"cpp.vec_isa_ok": None}):
        settle_vector_isa(tmp_path)
        (memo,) = tmp_path.iterdir()
        assert memo.read_text() in ("passed", "failed")
        assert inductor_config.cpp.vec_isa_ok == (True if memo.read_text() == "passed" else None)

    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", lambda: pytest.fail("probed again"))
    with inductor_config.patch({"cpp.vec_isa_ok": None}):
        memo.write_text("failed")
        settle_vector_isa(tmp_path)
        assert inductor_config.cpp.vec_isa_ok is None
        memo.write_text("passed")
        settle_vector_isa(tmp_path)
        assert inductor_config.cpp.vec_isa_ok is True


LOAD_SAVED_GRAPH = """
import sys
from engine import EngineConfig
from engine.worker.decode_graphs import DecodeGraphs, use_compile_cache
from engine.worker.worker import Worker
config = EngineConfig(model=sys.argv[1], dtype="float32", enforce_eager=True, num_kv_blocks=16, max_num_seqs=4)
worker = Worker(config)
worker.load_model()
worker.initialize_kv_cache(17)
cache_dir = use_compile_cache(None)
graphs = DecodeGraphs(worker.runner.model, worker.runner.kv_caches, config.block_size, 16, (1, 4), cache_dir)
graphs.compile_all()
compiler = ("torch._dynamo.aot_compile", "torch._inductor.codecache")
print(graphs.loaded_from_disk, cache_dir, *(m in sys.modules for m in compiler))
"""


def test_a_warm_start_loads_the_graph_without_importing_the_compiler(tmp_path_factory, tmp_path, first_start):
    """What spares a warm start ~2 s: the saved package loads through torch's C++ loader, and
    neither dynamo nor inductor is imported. The cache is found under XDG_CACHE_HOME, where the
    default model lives too (inductor would otherwise fix its own default, /tmp), and the start
    leaves no unpacked package of the loader's in TMPDIR."""
    llama, _ = _dense(tmp_path_factory)
    ours = tmp_path / "xdg" / "trio-llm" / "torch_compile"
    shutil.copytree(first_start[1], ours)  # what the first start saved
    (ours.parent / "kernels").symlink_to(cache_root() / "kernels")  # our C kernels, built already
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env.update(HOME=str(tmp_path / "home"), XDG_CACHE_HOME=str(tmp_path / "xdg"), TMPDIR=str(scratch))
    run = subprocess.run([sys.executable, "-c", LOAD_SAVED_GRAPH, str(llama)], capture_output=True, text=True,
                         timeout=300, check=True, env=env).stdout.split()
    assert run == ["True", str(ours), "False", "False"]  # loaded, and no compiler imported
    assert [p.name for p in scratch.iterdir() if p.name.startswith("aotinductor")] == []


def test_the_saved_decode_graph_attends_on_our_kernel_through_its_c_shim(first_start):
    """On CPU the package's decode attention is our kernel (engine/kernels/paged_decode.c), called
    by name through its C shim: no Python and no proxy executor in the step, so our GIL-free
    runner still runs the package."""
    graphs, _ = first_start
    assert decode_package_code(graphs).count("aoti_torch_cpu_paged_decode(") >= graphs.model.config.num_layers


def test_a_saved_graph_runs_through_ctypes_and_computes_what_torchs_loader_does(first_start, monkeypatch):
    """Torch's loader holds the GIL while a packaged graph runs, which stalled the engine's loop
    for every step; ours calls the library's C interface through a `ctypes.CDLL`, which releases
    the GIL for each call (a `PyDLL` would not). How much that frees the loop is measured by
    `python -m bench.gil_release`, not here."""
    graphs, cache = first_start
    (package,) = (cache / "decode-graphs").glob("*.pt2")
    tensors = precompiled_graph._model_tensors(graphs.model)
    ours = precompiled_graph._loaded(package, tensors, torch.device("cpu"))
    monkeypatch.setattr(aoti_runner, "load", lambda path, tensors: None)
    torchs = precompiled_graph._loaded(package, tensors, torch.device("cpu"))
    assert isinstance(ours, aoti_runner.GilFreeModel) and type(ours._lib) is ctypes.CDLL
    assert not isinstance(torchs, aoti_runner.GilFreeModel)
    torch.manual_seed(0)
    meta = graphs._metadata(4, [3, 16, 37, 49], [4, 1, 6, 2], [[0], [1], [2], [3]], 2)
    flat = [torch.randn(4, graphs.model.config.hidden_size), torch.tensor([3, 0, 5, 1]),
            *(t for pair in graphs.kv_caches for t in pair), meta.slot_mapping, meta.block_table, meta.seq_lens]
    with torch.inference_mode():
        want = torchs.run(flat)
        got = ours.run(flat)
        assert len(got) == len(want) == 1 and torch.equal(got[0], want[0])
        # The weights are the model's own tensors, not copies: a change to one changes the output.
        graphs.model.norm.weight.mul_(2)
        try:
            assert not torch.equal(ours.run(flat)[0], want[0])
        finally:
            graphs.model.norm.weight.div_(2)
        assert torch.equal(ours.run(flat)[0], want[0])


def test_a_package_our_runner_cannot_load_runs_on_torchs_loader_with_a_warning(first_start, monkeypatch, caplog):
    graphs, cache = first_start
    (package,) = (cache / "decode-graphs").glob("*.pt2")

    def refuse(path, tensors):
        raise AttributeError("undefined symbol: AOTInductorModelContainerRun")  # a torch that renamed it

    monkeypatch.setattr(aoti_runner, "load", refuse)
    runner = precompiled_graph._loaded(package, precompiled_graph._model_tensors(graphs.model), torch.device("cpu"))
    assert not isinstance(runner, aoti_runner.GilFreeModel) and runner.get_constant_fqns()
    assert "the GIL-free runner could not load" in caplog.text and "AOTInductorModelContainerRun" in caplog.text


def test_a_process_that_holds_the_gil_during_steps_loads_packages_with_torchs_loader(first_start, monkeypatch):
    """The engine process, whose loop shares the compute CPUs, wants its loop to wait for a step
    rather than preempt it (engine/core/engine_main.py)."""
    monkeypatch.setattr(aoti_runner, "_releasing", True)  # given back after the test
    graphs, cache = first_start
    (package,) = (cache / "decode-graphs").glob("*.pt2")
    tensors = precompiled_graph._model_tensors(graphs.model)
    assert isinstance(precompiled_graph._loaded(package, tensors, torch.device("cpu")), aoti_runner.GilFreeModel)
    aoti_runner.hold_the_gil_during_steps()
    assert not isinstance(precompiled_graph._loaded(package, tensors, torch.device("cpu")), aoti_runner.GilFreeModel)


def test_a_package_calling_kernels_outside_its_library_keeps_torchs_loader():
    library = "p/data/aotinductor/model/c1.wrapper.so"
    assert aoti_runner._library_member([library, "p/data/aotinductor/model/c1.wrapper_metadata.json"]) == library
    assert aoti_runner._library_member([library, "p/data/aotinductor/model/c1.wrapper.json"]) is None
    assert aoti_runner._library_member(["p/data/aotinductor/model/c1.wrapper_metadata.json"]) is None


def test_the_compile_cache_keeps_the_most_recently_used_packages(tmp_path):
    for i in range(precompiled_graph.KEEP_PACKAGES + 3):
        package = tmp_path / f"{i}.pt2"
        package.write_bytes(b"")
        os.utime(package, (1000 + i, 1000 + i))
    os.utime(tmp_path / "0.pt2", (5000, 5000))  # the oldest, just loaded again
    precompiled_graph.prune(tmp_path)
    kept = {p.name for p in tmp_path.iterdir()}
    assert len(kept) == precompiled_graph.KEEP_PACKAGES and "0.pt2" in kept and "1.pt2" not in kept


def test_a_model_that_does_not_export_runs_on_torch_compile(tmp_path_factory, tmp_path, monkeypatch, caplog):
    """Export refuses what dynamo takes (a fake refusal here): the graph is compiled by
    `torch.compile` instead, computes what the eager model does, and no package is saved: only the
    note that this graph did not export, so the next start goes to torch.compile at once."""
    caplog.set_level("INFO", logger="engine.worker.decode_graphs")
    llama, _ = _dense(tmp_path_factory)
    tries = []

    def refuse(*args):
        tries.append(args[0])
        raise RuntimeError("export refused")

    monkeypatch.setattr(precompiled_graph, "compile_and_save", refuse)
    graphs = decode_graphs(llama, tmp_path)
    graphs.compile_all()
    assert "does not export (RuntimeError: export refused)" in caplog.text
    assert not graphs.loaded_from_disk and not list((tmp_path / "decode-graphs").glob("*.pt2"))
    [note] = (tmp_path / "decode-graphs").iterdir()
    assert note.name == tries[0].name + ".torch-compile" and "export refused" in note.read_text()
    decode_graphs(llama, tmp_path).compile_all()
    assert len(tries) == 1 and "it did not export or load here before" in caplog.text
    got = decode_step(graphs, 4)
    size = graphs.block_size
    hidden = torch.randn(3, graphs.model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        meta = graphs._metadata(3, [0, size + 1, 2 * size + 2], [1, 2, 3], [[0], [1], [2]], 2)
        want = graphs.model(hidden, torch.tensor([0, 1, 2]), graphs.kv_caches, meta)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("decode_attention", [paged_decode_attention, gathered_decode_attention])
def test_decode_attention_equals_the_eager_attention_over_ragged_sequences(dtype, num_kv_heads, decode_attention):
    """The compiled graphs' attention formula (run eagerly here), and the captured CUDA graphs',
    against the eager path's SDPA:
    sequences of different lengths, some ending mid-block and one of a single token, grouped
    query heads, tables padded with a scratch block, and a padding row past the real ones."""
    generator = torch.Generator().manual_seed(0)
    block_size, num_heads, dim = 4, 4, 8
    lengths = [1, 4, 7, 13]  # tokens each sequence attends to, the new one included
    tables = [[1], [2], [3, 4], [5, 6, 7, 8]]
    width = max(len(t) for t in tables)
    k_cache, v_cache = (torch.randn(9 * block_size, num_kv_heads, dim, generator=generator).to(dtype)
                        for _ in range(2))
    q = torch.randn(len(lengths) + 1, num_heads, dim, generator=generator).to(dtype)  # the last row pads
    scale = dim ** -0.5

    chunks = [SequenceChunk(n - 1, 1, t) for n, t in zip(lengths, tables, strict=True)]
    last = [t[(n - 1) // block_size] * block_size + (n - 1) % block_size for n, t in zip(lengths, tables, strict=True)]
    eager_meta = build_metadata(chunks, block_size, torch.device("cpu"), dtype)
    new_k, new_v = k_cache[last], v_cache[last]
    expected = paged_attention(q[:-1], new_k, new_v, k_cache, v_cache, eager_meta, scale)

    padded = [t + [0] * (width - len(t)) for t in tables] + [[0] * width]
    meta = DecodeMetadata(torch.tensor([*last, 0]), torch.tensor(padded), torch.tensor([*lengths, 1]), block_size)
    got = decode_attention(q, k_cache, v_cache, meta, scale)

    assert got.dtype == dtype and got.shape == q.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[:-1].float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("decode_attention", [paged_decode_attention, gathered_decode_attention])
def test_a_16_bit_kv_cache_under_float32_queries_is_attended_in_float32(cache_dtype, decode_attention):
    """--kv-cache-dtype: keys and values are rounded once, when written; every path then computes
    in the queries' float32 over the rounded values, as over a float32 cache holding them. The
    eager path (a decode beside a prompt chunk over cached positions) and both decode formulas."""
    generator = torch.Generator().manual_seed(7)
    block_size, num_heads, num_kv_heads, dim = 4, 4, 2, 8
    narrow = [torch.zeros(12 * block_size, num_kv_heads, dim, dtype=cache_dtype) for _ in range(2)]
    wide = [torch.zeros(12 * block_size, num_kv_heads, dim) for _ in range(2)]
    chunks = [SequenceChunk(9, 1, [1, 2, 3]), SequenceChunk(5, 6, [4, 5, 6])]  # a decode, a prompt chunk
    meta = build_metadata(chunks, block_size, torch.device("cpu"), torch.float32)
    cached = [SequenceChunk(0, 9, [1, 2, 3]), SequenceChunk(0, 5, [4, 5, 6])]  # their earlier positions
    earlier = build_metadata(cached, block_size, torch.device("cpu"), torch.float32)
    for slots in (earlier.slot_mapping, meta.slot_mapping):  # float32 rows written to both
        k, v = torch.randn(2, slots.numel(), num_kv_heads, dim, generator=generator)
        attention.write_kv(*narrow, slots, k, v)
        attention.write_kv(*wide, slots, k, v)
    for rounded, exact in zip(narrow, wide, strict=True):
        assert rounded.dtype == cache_dtype and torch.equal(rounded, exact.to(cache_dtype))  # rounded as written
        exact.copy_(rounded)  # the float32 cache now holds what the narrow one does
    scale = dim ** -0.5
    q = torch.randn(7, num_heads, dim, generator=generator)
    new_k, new_v = (c[meta.slot_mapping].float() for c in narrow)
    got = paged_attention(q, new_k, new_v, *narrow, meta, scale)
    want = paged_attention(q, new_k, new_v, *wide, meta, scale)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    decode_meta = DecodeMetadata(meta.slot_mapping[:1], torch.tensor([[1, 2, 3]]), torch.tensor([10]), block_size)
    got = decode_attention(q[:1], *narrow, decode_meta, scale)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want[:1], rtol=1e-5, atol=1e-5)


def test_one_fresh_prompt_attends_causally_without_a_mask_and_matches_the_masked_path():
    """A single sequence from position 0 takes SDPA's causal path (no mask built); beside a second
    fresh sequence it takes the masked path. Both give the same rows."""
    generator = torch.Generator().manual_seed(4)
    heads, kv_heads, dim, block_size = 4, 2, 16, 4
    lengths = (9, 6)
    total = sum(lengths)
    q = torch.randn(total, heads, dim, generator=generator)
    k = torch.randn(total, kv_heads, dim, generator=generator)
    v = torch.randn(total, kv_heads, dim, generator=generator)
    cache = torch.zeros(32 * block_size, kv_heads, dim)
    chunks = [SequenceChunk(0, lengths[0], list(range(0, 3))), SequenceChunk(0, lengths[1], list(range(3, 5)))]
    alone = build_metadata(chunks[:1], block_size, torch.device("cpu"))
    assert alone.groups[0].mask is None
    together = build_metadata(chunks, block_size, torch.device("cpu"))
    assert together.groups[0].mask is not None
    one = paged_attention(q[:9], k[:9], v[:9], cache, cache, alone, dim ** -0.5)
    both = paged_attention(q, k, v, cache, cache, together, dim ** -0.5)
    torch.testing.assert_close(one, both[:9], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [65, 200, 256])
def test_a_prompt_attended_in_query_blocks_on_one_thread_equals_causal_attention(tokens, threads, monkeypatch):
    """Where our kernel does not apply (bfloat16), one thread attends in blocks of queries."""
    generator = torch.Generator().manual_seed(tokens)
    q = torch.randn(tokens, 4, 16, generator=generator)
    k, v = (torch.randn(tokens, 2, 16, generator=generator) for _ in range(2))
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True).transpose(0, 1)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(kw.get("is_causal", False)) or sdpa(*a, **kw))
    threads(1)
    bf16 = causal_prompt_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 16 ** -0.5)
    torch.testing.assert_close(bf16.float(), expected, rtol=2e-2, atol=2e-2)
    assert calls == [False] * -(-tokens // PROMPT_QUERY_BLOCK), "one masked call per block of queries"
    calls.clear()
    half = causal_prompt_attention(q.half(), k.half(), v.half(), 16 ** -0.5)
    torch.testing.assert_close(half.float(), expected, rtol=1e-2, atol=1e-2)
    assert calls == [True], "float16 (slower in blocks), one causal call"
    calls.clear()
    threads(2)
    bf16 = causal_prompt_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 16 ** -0.5)
    torch.testing.assert_close(bf16.float(), expected, rtol=2e-2, atol=2e-2)
    assert calls == [True], "on two threads, one causal call"


@pytest.mark.parametrize("checkpoint", ["qwen2"], indirect=True)
async def test_on_one_compute_thread_the_one_row_head_and_our_attention_kernel_give_transformers_tokens(
        checkpoint, monkeypatch, threads):
    """An engine bound to one CPU (one compute thread), every linear packed, the table tied (qwen2):
    the head's one-row products read the table's rows, fresh prompts are attended by our C kernel
    (engine/kernels), and the greedy tokens are still transformers'. (`threads` restores torch's
    thread count, which the worker sets to its one CPU, for the tests after this one.)"""
    monkeypatch.setattr(packed_linear, "PACK_MIN_ELEMENTS", 0)
    path, hf_model = checkpoint
    rng = random.Random(5)
    prompts = [rng.choices(range(3, VOCAB), k=n) for n in (150, 70, 9)]
    expected = transformers_greedy(hf_model, prompts, 12)
    by_kernel, head_rows = [], []
    kernel = attention.causal_attention

    def spied_kernel(q, *rest, **options):
        out = kernel(q, *rest, **options)
        by_kernel.append((q.shape[0], torch.get_num_threads(), out is not None))
        return out

    monkeypatch.setattr(attention, "causal_attention", spied_kernel)
    packed = layers.packed_linear

    layer_rows = []

    def counted(x, weight, bias):
        (head_rows if weight.shape[0] == VOCAB else layer_rows).append(x.shape[0])
        return packed(x, weight, bias)

    monkeypatch.setattr(layers, "packed_linear", counted)
    cpu = available_cpus()[0]
    config = compiled_config(path, enforce_eager=True, cpu_layout=CpuLayout((cpu,), (cpu,)),
                             max_num_batched_tokens=256)
    got, _ = await engine_greedy(config, prompts, 12, together=False)
    assert got == expected
    assert (150, 1, True) in by_kernel and (70, 1, True) in by_kernel, "each prompt fresh, by the kernel, on one thread"
    assert 1 in layer_rows, "the layers' one-row products went through the packed op this test counts"
    assert 1 not in head_rows, "no one-row product of the head on its packed weight"


def test_inductors_precompiled_headers_go_under_the_compile_cache(tmp_path, monkeypatch):
    """Inductor fixes their directory at import, in the system's temporary directory, whatever
    TORCHINDUCTOR_CACHE_DIR says (300 MB per compiler and flag set landed in /tmp)."""
    from torch._inductor import codecache

    assert codecache._HEADER_DIR.startswith(tempfile.gettempdir())  # inductor's own choice
    for name in ("_HEADER_DIR", "_HEADER_LOCK_DIR"):  # restored after the test
        monkeypatch.setattr(codecache, name, getattr(codecache, name))
    keep_headers_in(tmp_path)
    assert str(tmp_path / "precompiled_headers") == codecache._HEADER_DIR
    assert str(tmp_path / "precompiled_headers" / "locks") == codecache._HEADER_LOCK_DIR


def test_the_compile_estimate_grows_with_the_model_from_the_measured_points():
    """57 s measured for a tiny model and 108 s for the 0.5B shape (494M parameters), on 2 cores."""
    assert compile_estimate(300_000) == "about 60 s on 2 cores for this model's size"
    assert compile_estimate(494_000_000) == "about 100 s on 2 cores for this model's size"


def test_a_compiled_graph_is_filed_by_device_and_dtype(tiny_model_dir, tmp_path):
    """A package compiled for one device or dtype is never handed to another: both are in its
    name (the KV cache's device and dtype, and the model's dtype). Shown with caches on the meta
    device standing in for a GPU's."""
    graphs = decode_graphs(tiny_model_dir, tmp_path)
    model, caches = graphs.model, graphs.kv_caches

    def path(kv_caches):
        return precompiled_graph.artefact_path(tmp_path, model, kv_caches, graphs.block_size, TRACE_ROWS)

    elsewhere = [(k.to("meta"), v.to("meta")) for k, v in caches]
    halved = [(k.to(torch.bfloat16), v.to(torch.bfloat16)) for k, v in caches]
    assert len({path(caches), path(elsewhere), path(halved)}) == 3
    assert path(caches) == path([(k.clone(), v.clone()) for k, v in caches])  # the same: the same name
