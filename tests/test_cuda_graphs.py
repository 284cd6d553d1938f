"""Captured decode graphs (engine/worker/cuda_graphs.py), run on CPU through `CallThrough`: the
capture sizes, the padding, the static buffers and the gathered attention are the code a GPU
runs; only the capture itself is CUDA's."""

from __future__ import annotations

import threading

import pytest
import torch
import trio

from engine import EngineConfig, open_engine
from engine.config import CompilationConfig, vllm_capture_sizes
from engine.models.attention import SequenceChunk, build_metadata
from engine.worker import cuda_graphs, precompiled_graph, worker
from engine.worker.cuda_graphs import CallThrough, CapturedDecode, padded_size, table_widths
from engine.worker.step_graph import StepGraph
from engine.worker.worker import Worker
from tests.conftest import engine_config
from tests.helpers import final_output, greedy


def test_the_default_capture_sizes_are_vllms_and_a_cuda_engine_uses_them():
    sizes = vllm_capture_sizes(256)
    assert sizes[:3] == (1, 2, 4)
    assert sizes[3:34] == (8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120, 128, 136, 144, 152, 160, 168,
                           176, 184, 192, 200, 208, 216, 224, 232, 240, 248)
    assert sizes[34:] == (256, 272, 288, 304, 320, 336, 352, 368, 384, 400, 416, 432, 448, 464, 480, 496, 512)
    assert vllm_capture_sizes(4) == (1, 2, 4, 8)  # min(2 x max_num_seqs, 512)
    assert EngineConfig(model="m", device="cuda", max_num_seqs=4).decode_batch_sizes == (1, 2, 4, 8)
    largest = CompilationConfig(max_cudagraph_capture_size=24)
    assert EngineConfig(model="m", device="cuda:0", compilation_config=largest).decode_batch_sizes == (1, 2, 4, 8, 16,
                                                                                                      24)
    with pytest.raises(ValueError, match="max_cudagraph_capture_size must be a positive integer"):
        CompilationConfig.from_json('{"max_cudagraph_capture_size": 0}')


def test_a_batch_is_padded_to_the_next_captured_size_and_a_table_to_the_next_width():
    sizes = (1, 2, 4, 8, 16)
    assert [padded_size(n, sizes) for n in (1, 3, 4, 5, 16, 17)] == [1, 4, 4, 8, 16, None]
    assert table_widths(2048, 16) == (16, 64, 256, 1024, 2048)
    assert table_widths(32, 16) == (16, 32)
    assert table_widths(8, 16) == (8,)  # a model shorter than the first width: one width, all of it


def _captured(model_dir: str, sizes=(1, 2, 4), compile_model: bool = False) -> CapturedDecode:
    """The tiny model's decode, captured (on CPU: called through) over a cache of 40 blocks plus
    the scratch block."""
    w = Worker(EngineConfig(model=model_dir, dtype="float32", enforce_eager=True, num_kv_blocks=40))
    w.load_model()
    w.initialize_kv_cache(41)
    graphs = CapturedDecode(w.runner.model, w.runner.kv_caches, 16, 40, sizes, 32, CallThrough(), compile_model)
    graphs.capture_all(progress=lambda line: None)
    return graphs


def _counting_compiler(compilations: list[int], *, corrupt: bool = False, fail: bool = False):
    """A stand-in for `compiled_decoder`: dynamo traces as it does there (one graph, the same
    dynamic marks), then the traced graph runs eagerly, counted; `corrupt` doubles its output
    (a wrong graph), `fail` raises as a compiler that refuses the model would."""
    def backend(graph_module, example_inputs):
        if fail:
            raise RuntimeError("this compiler refuses the model")
        compilations.append(1)
        return (lambda *args: [2 * out for out in graph_module(*args)]) if corrupt else graph_module

    return lambda model: torch.compile(model, fullgraph=True, dynamic=False, backend=backend)


def test_the_compiled_decoder_is_traced_once_for_every_size_and_width_and_one_row_runs_on_two(tiny_model_dir,
                                                                                              monkeypatch):
    """One compilation serves every captured batch size and table width (their dimensions are
    dynamic; the tables' row stride is the same at every width); a batch of one pads to two."""
    compilations: list[int] = []
    monkeypatch.setattr(cuda_graphs, "compiled_decoder", _counting_compiler(compilations))
    torch._dynamo.reset()
    graphs = _captured(tiny_model_dir, sizes=(1, 2, 4, 8), compile_model=True)
    assert graphs.compiled and graphs.sizes == (2, 4, 8)
    assert graphs.shapes() == [(2, 16), (4, 16), (8, 16), (2, 32), (4, 32), (8, 32)]
    assert compilations == [1]
    assert graphs.shape_for(1, 3) == (2, 16)


@pytest.mark.parametrize("how", ["fail", "corrupt"])
def test_a_decoder_that_does_not_compile_or_disagrees_is_captured_eagerly(tiny_model_dir, monkeypatch, caplog, how):
    monkeypatch.setattr(cuda_graphs, "compiled_decoder", _counting_compiler([], **{how: True}))
    torch._dynamo.reset()
    graphs = _captured(tiny_model_dir, sizes=(1, 2, 4), compile_model=True)
    assert not graphs.compiled
    assert "CUDA graphs capture the eager model" in caplog.text
    torch.manual_seed(0)
    hidden = torch.randn(2, graphs.model.config.hidden_size)
    with torch.inference_mode():  # the graphs now replay the eager model: its output, not the wrong graph's
        got = graphs.run(hidden, torch.tensor([0, 0]), [0, 16], [1, 1], [[0], [1]]).clone()
        want = graphs.model(hidden, torch.tensor([0, 0]), graphs.kv_caches,
                            build_metadata([SequenceChunk(0, 1, [0]), SequenceChunk(0, 1, [1])], 16,
                                           torch.device("cpu"), torch.float32))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_compilation_mode_0_captures_the_eager_model_and_leaves_cpu_steps_eager(tiny_model_dir):
    """vLLM's `--compilation-config '{"mode": 0}'`: nothing compiled; on CUDA the graphs capture the
    eager model, on CPU the steps run eagerly."""
    from engine.worker.graph_plan import DecodeRunner, GraphPlan
    none = CompilationConfig.from_json('{"mode": 0}')
    assert not none.compiles and CompilationConfig().compiles and CompilationConfig(mode=3).compiles
    with pytest.raises(ValueError, match="compilation_config.mode must be 0, 1, 2 or 3"):
        CompilationConfig.from_json('{"mode": 4}')
    config = EngineConfig(model=tiny_model_dir, enforce_eager=False, compilation_config=none)
    plan = GraphPlan.choose(config, parallel_ranks=1, moe=False, lora=False, on_cuda=False)
    assert plan.decode is DecodeRunner.EAGER and "mode 0" in (plan.why_eager or "")
    assert GraphPlan.choose(config, parallel_ranks=1, moe=False, lora=False, on_cuda=True).decode is \
        DecodeRunner.CAPTURED
    for compilation, compiles in ((none, False), (CompilationConfig(), True)):
        w = Worker(EngineConfig(model=tiny_model_dir, dtype="float32", enforce_eager=True, num_kv_blocks=40,
                                compilation_config=compilation))
        w.load_model()
        w.initialize_kv_cache(41)
        assert w._captured_decode(w.runner.kv_caches, 40).compiled is compiles  # compiled at capture, if at all


def test_a_padded_replay_equals_the_eager_step_and_padding_touches_only_the_scratch_block(tiny_model_dir):
    """Three ragged sequences (one past the first table width) replayed on the size-4 graph: the
    same hidden states and cache writes as the eager model's step, and the padding row's key went
    to the scratch block only."""
    graphs = _captured(tiny_model_dir)
    assert graphs.shapes() == [(1, 16), (2, 16), (4, 16), (1, 32), (2, 32), (4, 32)]
    torch.manual_seed(0)
    for k, v in graphs.kv_caches:
        k.normal_(), v.normal_()
    before = [(k.clone(), v.clone()) for k, v in graphs.kv_caches]
    lengths, tables = [1, 20, 300], [[0], [1, 2], list(range(3, 22))]
    slots = [t[(n - 1) // 16] * 16 + (n - 1) % 16 for n, t in zip(lengths, tables, strict=True)]
    hidden = torch.randn(3, graphs.model.config.hidden_size)
    positions = torch.tensor([n - 1 for n in lengths])
    assert graphs.shape_for(3, 19) == (4, 32)
    with torch.inference_mode():
        got = graphs.run(hidden, positions, slots, lengths, tables).clone()
        after_graph = [(k.clone(), v.clone()) for k, v in graphs.kv_caches]
        for (k, v), (k0, v0) in zip(graphs.kv_caches, before, strict=True):
            k.copy_(k0), v.copy_(v0)
        chunks = [SequenceChunk(n - 1, 1, t) for n, t in zip(lengths, tables, strict=True)]
        meta = build_metadata(chunks, 16, torch.device("cpu"), torch.float32)
        want = graphs.model(hidden, positions, graphs.kv_caches, meta)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    scratch = slice(40 * 16, 41 * 16)
    for (k, _), (k0, _), (k_eager, _) in zip(after_graph, before, graphs.kv_caches, strict=True):
        torch.testing.assert_close(k[:scratch.start], k_eager[:scratch.start])  # real blocks: as the eager step
        assert not torch.equal(k[scratch], k0[scratch])  # the padding row wrote its key there
    assert graphs.steps_run == 1


def test_a_step_no_graph_holds_is_not_taken(tiny_model_dir, monkeypatch):
    """Above the largest size, or at a width whose graphs the gather budget left out, the step
    runs eagerly (the runner asks `takes` first)."""
    monkeypatch.setattr(cuda_graphs, "GATHER_TOKEN_BUDGET", 2 * 32 * 16)
    graphs = _captured(tiny_model_dir)
    assert graphs.shapes() == [(1, 16), (2, 16), (4, 16), (1, 32), (2, 32)]
    assert graphs.takes(4, 16) and graphs.takes(2, 17)
    assert not graphs.takes(3, 17) and not graphs.takes(5, 1)


async def test_an_engine_decoding_on_captured_graphs_gives_the_eager_engines_tokens(tiny_model_dir, monkeypatch):
    """The worker's CUDA path (captured graphs, attention gathered, batches padded), its capture
    called through on CPU: the same greedy tokens as the eager engine, with the decodes on graphs,
    one prompt's decodes past the first table width."""
    prompts = [[5, 6, 7], list(range(1, 301)), [9] * 40, [11, 12]]
    options = {"dtype": "float32", "compilation_config": CompilationConfig(cudagraph_capture_sizes=(1, 2, 4))}

    async def tokens(config: EngineConfig) -> list[list[int]]:
        got: dict[int, list[int]] = {}
        async with open_engine(config) as engine:
            async def run(i: int) -> None:
                final = await final_output(engine, prompts[i], greedy(12, ignore_eos=True))
                got[i] = list(final.outputs[0].token_ids)
            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(run, i)
        return [got[i] for i in range(len(prompts))]

    want = await tokens(engine_config(tiny_model_dir, enforce_eager=True, **options))
    built: list[tuple[CapturedDecode, StepGraph | None]] = []
    real_graphs = Worker._graphs

    def spy(self, plan, caches, num_blocks):
        built.append(real_graphs(self, plan, caches, num_blocks))
        return built[-1]

    monkeypatch.setattr(Worker, "_captures_graphs", lambda self: True)
    monkeypatch.setattr(Worker, "_graphs", spy)
    monkeypatch.setattr(worker, "CudaGraphCapture", CallThrough)
    assert await tokens(engine_config(tiny_model_dir, enforce_eager=False, **options)) == want
    assert len(built) == 1
    captured, step_graph = built[0]
    assert isinstance(captured, CapturedDecode) and captured.steps_run >= 10
    assert captured.compiled, "the decoder was compiled (inductor) before capture, and agreed with the eager one"
    # The prompts ran on the step graph torch.compile built (CUDA has no AOTInductor package).
    assert step_graph is not None and step_graph.jit and step_graph.takes(3) and step_graph.steps_run >= 1


@pytest.mark.parametrize("how", ["fail", "corrupt"])
def test_a_cuda_step_graph_that_does_not_compile_or_disagrees_leaves_prompts_eager(tiny_model_dir, monkeypatch,
                                                                                     caplog, how):
    """The step graph torch.compile builds for CUDA's prompt steps is checked as the packaged one
    is: one that fails to compile, or computes something else, is not used (a warning says so)."""
    def wrong(model):
        def step(hidden, positions):
            if how == "fail":
                raise RuntimeError("this compiler refuses the model")
            return torch.zeros(hidden.shape[0], model.config.hidden_size, dtype=hidden.dtype)
        return step

    monkeypatch.setattr(precompiled_graph, "jit_graphed_step", wrong)
    w = Worker(EngineConfig(model=tiny_model_dir, dtype="float32", enforce_eager=True, num_kv_blocks=40))
    w.load_model()
    w.initialize_kv_cache(41)
    step_graph = StepGraph(w.runner.model, w.runner.kv_caches, 16, 40, jit=True)
    step_graph.compile(progress=lambda line: None)
    assert not step_graph.takes(16) and step_graph.cache_dir is None
    assert ("does not compile" if how == "fail" else "disagrees with the model") in caplog.text


def test_a_compiled_model_has_room_for_more_than_eight_graphs_in_a_thread_that_never_set_the_limit():
    """Each model compiled in one process adds a graph to its forward's cache; dynamo's config is
    per context, so a limit set in one thread is unset in the worker thread that compiles.
    `room_to_recompile` sets it at each call: twelve graphs of one code object, compiled in a
    fresh thread, where the ninth failed before."""
    graphs: list[int] = []

    def backend(graph_module, example_inputs):
        graphs.append(1)
        return graph_module

    def scaled(x: torch.Tensor, factor: int) -> torch.Tensor:
        return x * factor  # an int argument is a constant: each factor is a graph of its own

    compiled = precompiled_graph.room_to_recompile(torch.compile(scaled, fullgraph=True, dynamic=False,
                                                                 backend=backend))
    results: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def compile_twelve() -> None:
        try:
            results.extend(compiled(torch.ones(2), factor) for factor in range(12))
        except BaseException as exc:  # noqa: BLE001 -- reported to the test's thread
            errors.append(exc)

    torch._dynamo.reset()
    thread = threading.Thread(target=compile_twelve)
    thread.start()
    thread.join()
    assert errors == [] and len(graphs) == 12
    assert [int(r[0]) for r in results] == list(range(12))
