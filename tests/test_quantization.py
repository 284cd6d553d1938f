"""Quantized weights: weight-only int8 against the float model on transformers-made checkpoints,
GGUF files made from them (F32 exact, Q8_0's blocks kept as the file has them), and hostile GGUF
files refused in one line."""

from __future__ import annotations

import os
import pickle
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from bench.gguf_export import export_gguf
from bench.gguf_fidelity import dequantized_checkpoint
from engine import EngineConfig, ModelLoadError, open_engine
from engine.config import CompilationConfig
from engine.kernels import q8_0_rows as q8_0_kernels
from engine.models.gguf_file import gguf_config
from engine.models.layers import Linear
from engine.models.loader import load_decoder
from engine.models.parallel import TensorParallel
from engine.models.quantized_linear import (
    int8_pack_mm,
    int8_row_times,
    q8_0_dequantized_mm,
    q8_0_int8_linear,
    q8_0_row_times,
    quantize_per_block,
    quantize_per_block_in_torch,
    quantize_weight,
)
from engine.worker.worker import Worker
from tests.conftest import engine_config
from tests.helpers import final_output, greedy
from tests.model_helpers import decode_package_code, decoder_logits, save_hf_checkpoint, transformers_greedy

VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None)
FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM, {}),
            "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True})}
PROMPTS = [[5, 9, 200, 31, 77, 100, 3, 8], [40, 41, 42, 43, 44]]
# int8 rows with bfloat16 activations move a logit by at most this share of the largest logit.
INT8_TOLERANCE = 0.03
# 4-bit groups of 32 (the reference models' rows hold two groups) move it by up to 12% here.
INT4_TOLERANCE = 0.15


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def reference(request, tmp_path_factory):
    config_cls, model_cls, extra = FAMILIES[request.param]
    return save_hf_checkpoint(tmp_path_factory, f"quant-{request.param}", config_cls, model_cls,
                              {**COMMON, **extra})


def logits(decoder, prompt: list[int]) -> torch.Tensor:
    return decoder_logits(decoder, decoder.embed(torch.tensor(prompt)))


@pytest.mark.parametrize(("method", "tolerance", "share"), [
    ("int8", INT8_TOLERANCE, 0.35), ("w8a8", INT8_TOLERANCE, 0.35), ("int4", INT4_TOLERANCE, 0.25),
    ("q8_0", INT8_TOLERANCE, 0.35), ("q4_0", INT4_TOLERANCE, 0.25)])
def test_quantized_logits_stay_within_tolerance_of_the_float_model(reference, method, tolerance, share):
    path, _ = reference
    float_model, quantized = load_decoder(path, "float32"), load_decoder(path, "float32", quantization=method)
    assert all(m.qmethod == method for m in quantized.modules() if hasattr(m, "qweight"))
    assert quantized.step_read_bytes < share * float_model.step_read_bytes  # what a decode step reads
    for prompt in PROMPTS:
        ours, exact = logits(quantized, prompt), logits(float_model, prompt)
        assert (ours - exact).abs().max() <= tolerance * exact.abs().max()


@pytest.mark.parametrize("method", ["int8", "w8a8"])
async def test_int8_greedy_tokens_equal_transformers_on_the_reference_checkpoints(reference, method):
    path, hf_model = reference
    expected = transformers_greedy(hf_model, PROMPTS, 12)
    # Eager: the compiled graph's quantized kernels are test_the_compiled_decode_graph_runs_the_quantized_kernels'.
    config = engine_config(str(path), dtype="float32", quantization=method, enforce_eager=True)
    async with open_engine(config) as engine:
        assert engine.info.quantization == method and engine.info.weight_bytes > 0
        for prompt, tokens in zip(PROMPTS, expected, strict=True):
            assert (await final_output(engine, prompt, greedy(12))).outputs[0].token_ids == tokens


async def test_a_gguf_file_generates_what_its_checkpoint_does(reference, tmp_path):
    path, hf_model = reference
    expected = transformers_greedy(hf_model, PROMPTS, 12)
    f32 = export_gguf(path, tmp_path / "model-f32.gguf", "F32")
    config = engine_config(str(f32), tokenizer=str(path), dtype="float32")
    async with open_engine(config) as engine:
        assert engine.info.quantization is None
        for prompt, tokens in zip(PROMPTS, expected, strict=True):
            assert (await final_output(engine, prompt, greedy(12))).outputs[0].token_ids == tokens
    q8_file = export_gguf(path, tmp_path / "model-q8.gguf", "Q8_0")
    q8, requantized = load_decoder(q8_file, "float32"), load_decoder(q8_file, "float32", quantization="int8")
    exact = load_decoder(path, "float32")
    assert {m.qmethod for m in q8.modules() if isinstance(m, Linear) and m.qweight is not None} == {"q8_0"}
    assert q8.lm_head.qmethod == "q8_0"  # qwen2's is tied: the file's quantized table is its weight
    # The file's blocks kept: the steps and scales llama.cpp's Q8_0 stored, not rounded again.
    down = q8.layers[0].mlp.down_proj
    blocks = _q8_0_blocks(q8_file, "blk.0.ffn_down.weight")
    assert torch.equal(down.qweight, blocks[0]) and torch.equal(down.qscales, blocks[1])
    file_model = file_as_float_model(path, q8_file, tmp_path)
    for prompt in PROMPTS:
        want, near = logits(file_model, prompt), logits(exact, prompt)
        assert (logits(q8, prompt) - near).abs().max() <= INT8_TOLERANCE * near.abs().max()
        kept, rounded_again = (logits(q8, prompt) - want).abs().max(), (logits(requantized, prompt) - want).abs().max()
        # the file's weights (eagerly in bfloat16, as int8's kernel runs), not rounded again per row
        assert kept < rounded_again, (kept, rounded_again)


def file_as_float_model(checkpoint, gguf_file, tmp_path):
    """What a GGUF file means, in float32: its weights dequantized, as a checkpoint of their own
    (the original checkpoint's config)."""
    return load_decoder(dequantized_checkpoint(gguf_file, checkpoint, tmp_path), "float32")


def test_a_q8_0_files_blocks_are_held_byte_for_byte_with_no_float_weight_beside_them(reference, tmp_path):
    """Each Q8_0 tensor's blocks go into its layer as they are: q, k and v (and gate and up) at
    their rows of the fused layer, Llama's Q and K rows put back in HF order, a tied table's blocks
    the LM head's (its floats the embedding's). The file's steps stop at 100, which a float round
    trip would not give back (requantizing makes each block's largest step 127)."""
    import gguf

    from engine.models.gguf_file import gguf_reader, unpermute_rotary

    path, _ = reference
    rng = np.random.default_rng(0)
    source = gguf_reader(str(export_gguf(path, tmp_path / "f32.gguf", "F32")))
    blocks = {}
    for tensor in source.tensors:
        if len(tensor.shape) == 2:
            rows, features = int(tensor.shape[1]), int(tensor.shape[0])
            scales = rng.uniform(1e-3, 1e-2, (rows, features // 32, 1)).astype(np.float16)
            steps = rng.integers(-100, 101, (rows, features // 32, 32), dtype=np.int8)
            raw = np.concatenate([scales.view(np.uint8), steps.view(np.uint8)], axis=-1)
            blocks[tensor.name] = raw.reshape(rows, -1)
    q8_file = tmp_path / "hand-made-q8.gguf"
    _rewrite_with(path, q8_file, blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    model = load_decoder(q8_file, "float32")
    config = model.config

    def file_blocks(name: str, heads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        steps, scales = _q8_0_blocks(q8_file, name)
        if heads is not None and config.architecture == "LlamaForCausalLM":
            steps, scales = (unpermute_rotary(part, heads, name) for part in (steps, scales))
        return steps, scales

    layer = model.layers[0]
    expected = {
        layer.qkv_proj: [file_blocks("blk.0.attn_q.weight", config.num_heads),
                         file_blocks("blk.0.attn_k.weight", config.num_kv_heads), file_blocks("blk.0.attn_v.weight")],
        layer.mlp.gate_up_proj: [file_blocks("blk.0.ffn_gate.weight"), file_blocks("blk.0.ffn_up.weight")],
        layer.mlp.down_proj: [file_blocks("blk.0.ffn_down.weight")],
        model.lm_head: [file_blocks("token_embd.weight" if config.tie_word_embeddings else "output.weight")],
    }
    for linear, parts in expected.items():
        assert linear.qmethod == "q8_0"
        assert torch.equal(linear.qweight, torch.cat([steps for steps, _ in parts]))
        assert torch.equal(linear.qscales, torch.cat([scales for _, scales in parts]))
        assert (linear.weight.device.type == "meta") != (linear is model.lm_head and config.tie_word_embeddings)
    steps, scales = file_blocks("token_embd.weight")
    table = (steps.float().reshape(*scales.shape, 32) * scales[..., None]).reshape(steps.shape)
    assert torch.equal(model.embed_tokens.weight, table)
    # Tensor parallelism's second rank: its half of down's features (whole blocks), of o's too.
    second = load_decoder(q8_file, "float32", tp=TensorParallel(rank=1, size=2)).layers[0]
    for linear, name in ((second.mlp.down_proj, "blk.0.ffn_down.weight"), (second.o_proj, "blk.0.attn_output.weight")):
        steps, scales = file_blocks(name)
        assert torch.equal(linear.qweight, steps.chunk(2, dim=1)[1])
        assert torch.equal(linear.qscales, scales.chunk(2, dim=1)[1])


def test_a_q4_0_file_keeps_its_steps_and_scales(reference, tmp_path):
    """A Q4_0 file's layers run as q4_0 by default, holding its bytes as they are (each block a
    float16 scale d, then 32 4-bit steps two a byte, the block's first 16 in the low halves), with
    (d, -8 d) per block; in float32 they compute what the file means."""
    from engine.models.gguf_file import gguf_reader

    path, _ = reference
    q4_file = export_gguf(path, tmp_path / "model-q4.gguf", "Q4_0")
    model = load_decoder(q4_file, "float32")
    assert {m.qmethod for m in model.modules() if isinstance(m, Linear) and m.qweight is not None} == {"q4_0"}
    tensor = next(t for t in gguf_reader(str(q4_file)).tensors if t.name == "blk.0.ffn_down.weight")
    raw = torch.from_numpy(np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1, 18).copy())
    d = raw[..., :2].view(torch.float16).squeeze(-1).float()
    down = model.layers[0].mlp.down_proj
    assert torch.equal(down.qweight, raw[..., 2:].reshape(raw.shape[0], -1))
    assert torch.equal(down.qscales, torch.stack([d, -8 * d], dim=-1))
    file_model = file_as_float_model(path, q4_file, tmp_path)
    for prompt in PROMPTS:
        want = logits(file_model, prompt)
        assert (logits(model, prompt) - want).abs().max() <= 1e-4 * want.abs().max()  # float32, sums apart


def test_a_gguf_files_layers_keep_their_own_formats_and_others_are_quantized_again_as_q8_0(reference):
    """Per layer: all Q4_0 -> q4_0, Q8_0 and Q5_0 (both exact as q8_0) -> q8_0, all Q4_K -> q4_k; a
    layer of another format, or fused from formats of two methods, is quantized again as q8_0."""
    from engine.models.loader import file_block_methods

    path, _ = reference
    model = load_decoder(path, "float32")
    first, second = "model.layers.0.", "model.layers.1."
    formats = {first + "self_attn.q_proj.weight": "Q4_0", first + "self_attn.k_proj.weight": "Q6_K",
               first + "self_attn.v_proj.weight": "Q4_0", first + "mlp.gate_proj.weight": "Q4_0",
               first + "mlp.up_proj.weight": "Q4_0", first + "mlp.down_proj.weight": "Q8_0",
               first + "self_attn.o_proj.weight": "Q5_K", second + "self_attn.q_proj.weight": "Q5_0",
               second + "self_attn.k_proj.weight": "Q5_0", second + "self_attn.v_proj.weight": "Q8_0",
               second + "mlp.down_proj.weight": "Q4_K", second + "self_attn.o_proj.weight": "Q4_1"}
    kept, requantized = file_block_methods(model, formats)
    assert kept == {"q4_0": {"layers.0.mlp.gate_up_proj"},
                    "q8_0": {"layers.0.mlp.down_proj", "layers.1.qkv_proj"},
                    "q4_k": {"layers.1.mlp.down_proj"}, "q4_1": {"layers.1.o_proj"}}
    assert requantized == {"layers.0.qkv_proj", "layers.0.o_proj"}


def _q8_0_blocks(path, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 steps [rows, features], float32 scales [rows, features / 32]) of a Q8_0 tensor as the
    file stores them: per block, a float16 scale then 32 int8 steps."""
    from engine.models.gguf_file import gguf_reader

    tensor = next(t for t in gguf_reader(str(path)).tensors if t.name == name)
    raw = np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1, 34)
    scales = torch.from_numpy(raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    steps = torch.from_numpy(raw[..., 2:].copy().view(np.int8)).reshape(raw.shape[0], -1)
    return steps, scales


def test_the_q8_0_one_row_form_computes_what_the_dequantized_weight_does():
    generator = torch.Generator().manual_seed(0)
    qweight, scales = quantize_weight(torch.randn(48, 96, generator=generator), "q8_0")
    assert scales.shape == (48, 3)
    row = torch.randn(1, 96, generator=generator)
    exact = row @ (qweight.float().reshape(48, 3, 32) * scales[..., None]).reshape(48, 96).t()
    ours = q8_0_row_times(row, qweight, scales)
    torch.testing.assert_close(ours, exact, rtol=1e-5, atol=1e-5)  # float32 throughout
    # more rows: the weight dequantized to bfloat16 or float32 (`q8_0_matmul_dtype`), then a matmul
    torch.testing.assert_close(q8_0_dequantized_mm(row, qweight, scales), exact, rtol=2e-2, atol=2e-2)
    assert not torch.allclose(q8_0_row_times(row, qweight, scales.flip(1)), ours)  # each block has its own scale


def test_eagerly_a_few_rows_times_a_q8_0_weight_run_our_kernel_on_the_blocks_as_they_are(monkeypatch):
    """Outside a graph up to 16 rows (a batch of decodes) take engine/kernels/q8_0_rows.c, in
    float32 (one row: the same sum as inductor's `q8_0_row_times`), for every count of rows, on one
    thread or split over several; more rows, or bfloat16 rows, keep the dequantized matmul."""
    from engine.kernels import q8_0_rows
    from engine.models import quantized_linear

    generator = torch.Generator().manual_seed(2)
    qweight, scales = quantize_weight(torch.randn(301, 128, generator=generator), "q8_0")
    weight = (qweight.double().reshape(301, -1, 32) * scales.double()[..., None]).reshape(301, 128)
    # every count: each takes its own shape of tile (weight rows x input rows), and 301 weight rows
    # leave a last partial tile on every thread
    x, exact = assert_few_rows_equal_float64s(q8_0_rows.row_times, qweight, scales, weight, range(1, 17), generator)
    row = x[:1]
    torch.testing.assert_close(q8_0_rows.row_times(row, qweight, scales, 1), q8_0_row_times(row, qweight, scales),
                               rtol=1e-5, atol=1e-5)
    calls = []
    monkeypatch.setattr(quantized_linear, "q8_0_dequantized_mm",
                        lambda rows, *_: (calls.append(tuple(rows.shape)), torch.zeros(rows.shape[0], 301))[1])
    float_rows = quantized_linear.q8_0_linear(x, qweight, scales, None, "float32")
    torch.testing.assert_close(float_rows, exact, rtol=1e-5, atol=1e-5)
    assert calls == []  # the kernel took the 16 rows
    quantized_linear.q8_0_linear(torch.cat([x, row]), qweight, scales, None, "float32")
    assert q8_0_rows.row_times(row.bfloat16(), qweight, scales, 1) is None
    assert calls == [(17, 128)]


def assert_few_rows_equal_float64s(row_times, qweight, params, weight, counts, generator):
    """A block kernel's `row_times` on random rows of each count in `counts`, on one thread and
    split over three, against float64's product with the dequantized `weight`; returns the last
    rows and that product."""
    for rows in counts:
        x = torch.randn(rows, weight.shape[1], generator=generator)
        exact = (x.double() @ weight.t()).float()
        for threads in (1, 3):
            ours = row_times(x, qweight, params, threads)
            assert ours is not None
            torch.testing.assert_close(ours, exact, rtol=1e-5, atol=1e-5)
    return x, exact


def test_many_q8_0_rows_multiply_in_bfloat16_only_where_the_cpu_does_it_in_hardware(monkeypatch):
    from engine.models import quantized_linear

    monkeypatch.setattr(quantized_linear, "native_bfloat16", lambda: False)
    assert quantized_linear.q8_0_matmul_dtype(torch.float32) == torch.float32
    assert quantized_linear.q8_0_matmul_dtype(torch.bfloat16) == torch.bfloat16  # reduced activations keep theirs
    monkeypatch.setattr(quantized_linear, "native_bfloat16", lambda: True)
    assert quantized_linear.q8_0_matmul_dtype(torch.float32) == torch.bfloat16
    assert quantized_linear.q8_0_matmul_dtype(torch.float16) == torch.float16
    generator = torch.Generator().manual_seed(3)
    qweight, scales = quantize_weight(torch.randn(40, 64, generator=generator), "q8_0")
    rows = torch.randn(20, 64, generator=generator)
    exact = rows.double() @ (qweight.double().reshape(40, 2, 32) * scales.double()[..., None]).reshape(40, 64).t()
    monkeypatch.setattr(quantized_linear, "native_bfloat16", lambda: False)
    torch.testing.assert_close(q8_0_dequantized_mm(rows, qweight, scales).double(), exact, rtol=1e-5, atol=1e-5)


def test_eagerly_a_large_q8_0_weight_is_dequantized_a_slice_at_a_time_and_computes_the_same(monkeypatch):
    """Outside a graph the weight is dequantized a slice of rows at a time (the whole 0.5B head at
    once was 545 MB of temporaries a token); the slices' products are the whole one's."""
    from engine.models import quantized_linear

    generator = torch.Generator().manual_seed(1)
    qweight, scales = quantize_weight(torch.randn(300, 96, generator=generator), "q8_0")
    rows = torch.randn(3, 96, generator=generator)
    whole = quantized_linear._dequantized_mm(rows, qweight, scales, quantized_linear.q8_0_matmul_dtype(rows.dtype),
                                             quantized_linear.q8_0_weight)
    calls = []
    original = quantized_linear._dequantized_mm
    monkeypatch.setattr(quantized_linear, "EAGER_SLICE_WEIGHTS", 64 * 96)
    monkeypatch.setattr(quantized_linear, "_dequantized_mm", lambda *a: (calls.append(a[1].shape[0]), original(*a))[1])
    assert torch.equal(q8_0_dequantized_mm(rows, qweight, scales), whole)
    assert calls == [64, 64, 64, 64, 44]


MIXED = "q8_0+q4_0"  # a GGUF file of Q8_0 and Q4_0 layers: both of our kernels in one package
INT8_ACTIVATIONS = "q8_0+int8-activations"  # the same file, --q8-0-activations int8


@pytest.mark.parametrize("method", ["int8", "w8a8", "int4", MIXED, INT8_ACTIVATIONS])
async def test_the_compiled_decode_graph_runs_the_quantized_kernels(tmp_path_factory, method):
    path, _ = save_hf_checkpoint(tmp_path_factory, f"compiled-{method}", LlamaConfig, LlamaForCausalLM, COMMON)
    model = {"model_dir": str(path), "quantization": method}
    if method in (MIXED, INT8_ACTIVATIONS):
        mixed = mixed_q8_0_q4_0_file(path, tmp_path_factory.mktemp("mixed") / "mixed.gguf")
        model = {"model_dir": str(mixed), "tokenizer": str(path)}
        if method == INT8_ACTIVATIONS:
            model["q8_0_activations"] = "int8"
    compilation = CompilationConfig(cudagraph_capture_sizes=(4,), compile_prompts=False)
    tokens = {}
    for eager in (True, False):
        config = engine_config(**model, dtype="float32", enforce_eager=eager, max_num_seqs=4,
                               compilation_config=compilation)
        async with open_engine(config) as engine:
            # One request at a time: every decode is a batch of one (int8's one-row kernel).
            tokens[eager] = [(await final_output(engine, p, greedy(8))).outputs[0].token_ids for p in PROMPTS]
            graphs = engine.core.executor.worker.runner.decode_graphs
        if not eager:
            assert graphs.steps_run >= 2 * 7
            # Every method's package loads back (int4's kernel is an opaque op in it), and its graph
            # runs one row as it is (dynamo's padded one row to two).
            assert graphs.min_rows == 1
            assert graphs.head_compiled == (method in ("int8", MIXED, INT8_ACTIVATIONS))  # the file's head is Q8_0
            if method in (MIXED, INT8_ACTIVATIONS):
                layer = graphs.model.layers[0]
                assert {layer.qkv_proj.qmethod, layer.mlp.down_proj.qmethod} == {"q8_0", "q4_0"}
                q8_0_kernel = "aoti_torch_cpu_q8_0_rows" + ("_int8(" if method == INT8_ACTIVATIONS else "_auto(")
                assert layer.qkv_proj.q8_0_activations == ("int8" if method == INT8_ACTIVATIONS else "auto")
                assert layer.mlp.down_proj.q8_0_activations is None  # q4_0: float rows
                shims = [q8_0_kernel, "aoti_torch_cpu_q4_rows("]
                if method == MIXED and q8_0_kernels.int8_fast():  # auto's tiles, laid out for its two levels
                    assert layer.qkv_proj.qtiles is not None and layer.mlp.down_proj.qtiles is None
                    shims[0] = "aoti_torch_cpu_q8_0_rows_packed("
                assert_one_row_calls_our_kernels(graphs, shims)
                assert a_new_process_loads_the_saved_graphs(config)
    assert tokens[False] == tokens[True]  # int8 and w8a8 also equal transformers' (the test above)


def mixed_q8_0_q4_0_file(path, out):
    """A GGUF file of checkpoint `path` with its MLP weights in Q4_0 and every other 2-D weight in
    Q8_0 (gguf's own quantizers)."""
    import gguf

    from engine.models.gguf_file import gguf_reader

    source = gguf_reader(str(export_gguf(path, out.with_suffix(".f32.gguf"), "F32")))
    kinds = {t.name: gguf.GGMLQuantizationType.Q4_0 if ".ffn_" in t.name else gguf.GGMLQuantizationType.Q8_0
             for t in source.tensors if len(t.shape) == 2}
    blocks = {t.name: gguf.quants.quantize(np.asarray(t.data), kinds[t.name])
              for t in source.tensors if t.name in kinds}
    _rewrite_with(path, out, blocks, raw_dtype=kinds)
    return out


OPEN_AND_SAY_IF_LOADED = """
import pickle, sys, trio
from engine import open_engine
async def main(config):
    async with open_engine(config) as engine:
        print(engine.core.executor.worker.runner.decode_graphs.loaded_from_disk)
trio.run(main, pickle.loads(sys.stdin.buffer.read()))
"""


def a_new_process_loads_the_saved_graphs(config: EngineConfig) -> bool:
    """A warm start: a process that has not built or called our kernels yet loads the package
    (whose library calls the kernel's C shim by name) rather than compiling it again."""
    env = {k: v for k, v in os.environ.items() if k != "TRIO_LLM_ENFORCE_EAGER"}
    run = subprocess.run([sys.executable, "-c", OPEN_AND_SAY_IF_LOADED], input=pickle.dumps(config),
                         capture_output=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    return run.stdout.decode().split() == ["True"]


def assert_one_row_calls_our_kernels(graphs, shims: list[str]) -> None:
    """The decode package runs a few rows of its q8_0 and q4_0 layers on our kernels, called through
    their C shims: no extern kernels beside the library (no proxy executor), so the GIL-free runner
    runs it."""
    code = decode_package_code(graphs)
    assert all(shim in code for shim in shims)


def llama_cpp_q8_0_products(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q8_0 x Q8_0 product in float64: each row rounded to int8 per block of 32 (scale
    max |x| / 127), integer sums per block, times both scales."""
    blocks = x.view(x.shape[0], -1, 32).double()
    d = blocks.abs().amax(-1) / 127
    q = torch.round(blocks / torch.where(d > 0, d, 1)[..., None])
    return torch.einsum("rbk,obk,rb,ob->ro", q, qweight.view(qweight.shape[0], -1, 32).double(), d, scales.double())


@pytest.mark.parametrize(("out_features", "in_features"), [(48, 64), (40, 4864), (4, 32)])  # 16s and a tail
def test_int8_activations_compute_llama_cpps_q8_0_products(out_features, in_features, threads):
    """--q8-0-activations int8 (engine/kernels/q8_0_rows.c `q8_0_rows_int8`): whole groups of 16
    weight rows and a last partial group, 1 to 16 input rows, on one and two threads: llama.cpp's
    arithmetic to float32's rounding, where the float-row kernel differs by the rows' rounding."""
    from engine.kernels import q8_0_rows

    generator = torch.Generator().manual_seed(in_features)
    qweight, scales = quantize_per_block(torch.randn(out_features, in_features, generator=generator))
    for rows in (1, 5, 16):
        x = torch.randn(rows, in_features, generator=generator)
        x[0, 32:64] = 0.0  # a block of zeros (where there are two): scale 0, no division by it
        expected = llama_cpp_q8_0_products(x, qweight, scales)
        for count in (1, 2):
            got = q8_0_rows.int8_row_times(x, qweight, scales, count)
            assert got is not None
            torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
        float_rows = q8_0_rows.row_times(x, qweight, scales, 1)
        assert float_rows is not None and (float_rows.double() - expected).abs().max() > 1e-3
    threads(2)
    x = torch.randn(3, in_features, generator=generator)
    expected = llama_cpp_q8_0_products(x, qweight, scales)
    torch.testing.assert_close(q8_0_int8_linear(x, qweight, scales).double(), expected, rtol=1e-5, atol=1e-4)
    prompt = torch.randn(20, in_features, generator=generator)  # more rows than a decode batch: float rows
    torch.testing.assert_close(q8_0_int8_linear(prompt, qweight, scales), q8_0_dequantized_mm(prompt, qweight, scales))


@pytest.mark.parametrize(("out_features", "in_features"), [(56, 64), (40, 768), (4, 32)])  # 16s and a tail
def test_two_int8_levels_hold_each_value_to_a_508th_of_its_step(out_features, in_features):
    """`q8_0_rows_int8x2` (what --q8-0-activations auto runs for many rows through short ones):
    each row rounded to int8 per block, then its remainders in 254ths of a step, on VNNI. Every
    output is within the bound that precision gives (each value within 1/508 of its block's step),
    over a hundred times closer to the float64 product than one level (llama.cpp's), on one thread
    or two alike. Auto is that kernel exactly for 10 or more rows through at most 512 features (with
    VNNI), the float32 kernel exactly otherwise; with the weight's tiles laid out once
    (`pack_tiles`, any width; whole tiles of 16 rows only: 56 rows leave a tail of 8), two levels at
    every row count, one included, the same sums as transposing at each call."""
    from engine.kernels import q8_0_rows

    generator = torch.Generator().manual_seed(in_features + 1)
    qweight, scales = quantize_per_block(torch.randn(out_features, in_features, generator=generator))
    blocks = qweight.double().view(out_features, -1, 32) * scales.double()[..., None]
    tiles = q8_0_rows.pack_tiles(qweight, scales)
    assert (tiles is not None) == (q8_0_rows.int8_fast() and out_features >= 16)
    for rows in (1, 3, 10, 16):
        x = torch.randn(rows, in_features, generator=generator)
        x[0, 32:64] = 0.0  # a block of zeros (where there are two): step 0, no division by it
        exact = x.double() @ blocks.reshape(out_features, -1).t()
        step = x.double().view(rows, -1, 32).abs().amax(-1) / 127
        bound = torch.einsum("rb,ob->ro", step / 508, blocks.abs().sum(-1)) + 1e-5 * exact.abs() + 1e-6
        got = q8_0_rows.TWO_LEVELS.row_times(x, qweight, scales, 1)
        assert got is not None and torch.equal(q8_0_rows.TWO_LEVELS.row_times(x, qweight, scales, 2), got)
        error = (got.double() - exact).abs()
        assert (error <= bound).all()
        one_level = (q8_0_rows.int8_row_times(x, qweight, scales, 1).double() - exact).abs().max()
        assert error.max() < one_level / 100
        two_levels = (rows >= q8_0_rows.TWO_LEVELS_FROM_ROWS and in_features <= q8_0_rows.TWO_LEVELS_UP_TO_K
                      and q8_0_rows.int8_fast())
        auto = q8_0_rows.auto_row_times(x, qweight, scales, 2)
        assert torch.equal(auto, got if two_levels else q8_0_rows.row_times(x, qweight, scales, 2))
        if tiles is not None:  # laid out once: two levels at every row count, the same sums as transposed
            assert torch.equal(q8_0_rows.packed_row_times(x, qweight, scales, tiles, 2), got)
    if tiles is not None:  # up to INT8_MAX_ROWS rows (decodes, prompts), 16 at a time: each row's sums as alone
        many = torch.randn(40, in_features, generator=generator)
        whole = q8_0_rows.packed_row_times(many, qweight, scales, tiles, 2)
        pieces = [q8_0_rows.packed_row_times(many[i:i + 16], qweight, scales, tiles, 1) for i in range(0, 40, 16)]
        assert whole is not None and torch.equal(whole, torch.cat(pieces))
        too_many = torch.randn(q8_0_rows.INT8_MAX_ROWS + 1, in_features)
        assert q8_0_rows.packed_row_times(too_many, qweight, scales, tiles, 1) is None


def test_int8_activations_without_q8_0_layers_fail_start_up_naming_why(tmp_path_factory):
    path, _ = save_hf_checkpoint(tmp_path_factory, "float-for-int8", LlamaConfig, LlamaForCausalLM, COMMON)
    worker = Worker(EngineConfig(model=str(path), dtype="float32", enforce_eager=True, q8_0_activations="int8"))
    with pytest.raises(ModelLoadError, match="no q8_0 layers"):
        worker.load_model()
    with pytest.raises(ValueError, match="q8_0_activations must be one of auto, float32, int8"):
        EngineConfig(model=str(path), q8_0_activations="int4")


@pytest.mark.parametrize("features", [64, 4112])  # 4112: summed in two pieces (inductor's plain sums stop at 4096)
def test_the_int8_one_row_kernel_computes_what_torchs_kernel_does(features):
    generator = torch.Generator().manual_seed(features)
    qweight, scales = quantize_weight(torch.randn(48, features, generator=generator), "int8")
    row = torch.randn(1, features, generator=generator).to(scales.dtype)
    ours, torchs = int8_row_times(row, qweight, scales), int8_pack_mm(row, qweight, scales)
    assert ours.shape == torchs.shape == (1, 48) and ours.dtype == torchs.dtype
    # Both round the result to bfloat16; their sums differ in order only.
    assert (ours.float() - torchs.float()).abs().max() <= 1e-2 * torchs.float().abs().max()
    assert not torch.equal(int8_row_times(row, qweight, scales.flip(0)), ours)  # the scales are applied per row


async def test_tensor_parallel_ranks_quantize_their_own_shards(tmp_path_factory):
    path, hf_model = save_hf_checkpoint(tmp_path_factory, "quant-tp", LlamaConfig, LlamaForCausalLM, COMMON)
    expected = transformers_greedy(hf_model, PROMPTS, 8)
    config = engine_config(str(path), dtype="float32", quantization="int8", tensor_parallel_size=2)
    async with open_engine(config) as engine:
        assert engine.info.quantization == "int8"
        for prompt, tokens in zip(PROMPTS, expected, strict=True):
            assert (await final_output(engine, prompt, greedy(8))).outputs[0].token_ids == tokens


def test_q8_0_blocks_read_in_torch_equal_ggufs_own_dequantization():
    """`Q8_0Blocks.dequantized` (torch's threads) against gguf's `dequantize`, bit for bit, on blocks of
    random float16 scales (zero, negative and subnormal ones among them) and int8 values."""
    from gguf import GGMLQuantizationType, quants

    from engine.models.weights import Q8_0Blocks
    rng = np.random.default_rng(0)
    scales = rng.standard_normal(96).astype(np.float16)
    scales[:3] = [0.0, -0.0, 1e-7]
    values = rng.integers(-128, 128, size=(96, 32), dtype=np.int8)
    blocks = np.concatenate([scales.view(np.uint8).reshape(96, 2), values.view(np.uint8)], axis=1).reshape(3, -1)
    want = quants.dequantize(blocks, GGMLQuantizationType.Q8_0).reshape(-1)
    got = Q8_0Blocks.from_raw(torch.from_numpy(blocks), 3).dequantized().numpy().reshape(-1)
    assert got.dtype == np.float32 and np.array_equal(got, want)


# GGML's 4-bit and 5-bit formats: (bytes per block, weights per block, offsets of its float16 fields).
RAW_FORMATS = {"Q4_0": (18, 32, (0,)), "Q4_1": (20, 32, (0, 2)), "Q4_K": (144, 256, (0, 2)), "Q5_0": (22, 32, (0,))}


def random_blocks(kind: str, rows: int, features: int, rng, scale: float = 0.05) -> np.ndarray:
    """Random bytes of a `kind` tensor [rows, features], its float16 fields drawn in +-`scale`
    (a zero among them), everything else (steps, 6-bit scales and minimums, high bits) any byte."""
    size, per, halves = RAW_FORMATS[kind]
    raw = rng.integers(0, 256, (rows, features // per, size), dtype=np.uint8)
    for offset in halves:
        values = rng.uniform(-scale, scale, raw.shape[:2]).astype(np.float16)
        values.flat[0] = 0
        raw[..., offset:offset + 2] = values.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", sorted(RAW_FORMATS))
def test_4_bit_and_q5_0_blocks_read_in_torch_equal_ggufs_own_dequantization(kind):
    """`Q4Blocks` (Q4_0, Q4_1, Q4_K: 4-bit steps with a float32 scale and low per 32) and Q5_0's
    blocks as `Q8_0Blocks` (its steps less 16) against gguf's `dequantize`, bit for bit; the steps
    held two a byte compute the same through `q4_weight`, the layers' own dequantization."""
    from gguf import GGMLQuantizationType, quants

    from engine.models.quantized_linear import q4_weight
    from engine.models.weights import Q4Blocks, Q8_0Blocks

    raw = random_blocks(kind, 6, 512, np.random.default_rng(len(kind) + ord(kind[-1])))
    want = quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(6, 512)
    data = torch.from_numpy(raw.reshape(-1).copy())
    blocks = Q8_0Blocks.from_q5_0(data, 6) if kind == "Q5_0" else Q4Blocks.from_raw(data, 6, kind)
    assert blocks.shape == (6, 512) and np.array_equal(blocks.dequantized().numpy(), want)
    if isinstance(blocks, Q4Blocks):
        qweight, params = blocks.values.reshape(6, -1), blocks.scales
        assert np.array_equal(q4_weight(qweight, params, torch.float32).numpy(), want)


def test_a_few_rows_times_a_4_bit_weight_run_our_kernel_on_the_steps_as_they_are(monkeypatch):
    """Up to 16 rows take engine/kernels/q4_rows.c (float32 sums of scale * step + low; one row
    sums the steps' products and the lows apart, which nearly cancel), on one thread or split over
    several; more rows, or rows it does not take, the dequantized matmul."""
    from engine.kernels import q4_rows
    from engine.models import quantized_linear

    generator = torch.Generator().manual_seed(4)
    qweight = torch.randint(0, 256, (301, 96), dtype=torch.uint8, generator=generator)  # 192 features
    scales = torch.rand(301, 6, generator=generator) * 0.1  # lows near -8 scales, as Q4_0's and Q4_K's are:
    params = torch.stack([scales, -8 * scales + torch.randn(301, 6, generator=generator) * 0.01], dim=-1)
    weight = quantized_linear.q4_weight(qweight, params, torch.float64)
    x, exact = assert_few_rows_equal_float64s(q4_rows.row_times, qweight, params, weight, (1, 2, 5, 9, 16), generator)
    assert q4_rows.row_times(x.bfloat16(), qweight, params, 1) is None
    assert q4_rows.row_times(x[:, :128], qweight, params, 1) is None  # not the weight's features
    calls = []
    monkeypatch.setattr(quantized_linear, "q4_dequantized_mm",
                        lambda rows, *_: (calls.append(tuple(rows.shape)), torch.zeros(rows.shape[0], 301))[1])
    torch.testing.assert_close(quantized_linear.q4_linear(x, qweight, params, None), exact, rtol=1e-5, atol=1e-5)
    assert calls == []
    quantized_linear.q4_linear(torch.cat([x, x[:1]]), qweight, params, None)
    assert calls == [(17, 192)]
    monkeypatch.undo()
    many = torch.randn(40, 192, generator=generator)
    error = (quantized_linear.q4_dequantized_mm(many, qweight, params).double() - many.double() @ weight.t()).abs()
    # bfloat16 where the CPU multiplies it natively: each product's two factors rounded to 8 bits
    # (2^-8 of each at most), summed in float32. (A fixed 0.02 failed on such a CPU: sums of 192
    # products reach 0.03 off.)
    assert (error <= 2 ** -7 * (many.double().abs() @ weight.abs().t()) + 1e-5).all()


def test_a_q4_k_files_blocks_are_held_exactly_and_compute_what_the_file_means(tmp_path_factory, tmp_path):
    """Each Q4_K tensor of a hand-made file (random steps, 6-bit scales and minimums) goes into its
    layer as q4_k: at their rows of the fused layers, Llama's Q and K rows put back in HF order,
    the steps and (scale, low) per 32 what gguf dequantizes bit for bit. The model computes what
    the file means (float32, sums apart; the many-row matmul in bfloat16 where the CPU multiplies it
    natively), prompts (many rows) and decodes (the kernel) alike. Tensor parallelism's second rank
    holds its half of down's and o's features."""
    import gguf

    from engine.models.gguf_file import gguf_reader, gguf_tensors, unpermute_rotary
    from engine.models.quantized_linear import q4_weight

    options = {**COMMON, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 1}
    path, _ = save_hf_checkpoint(tmp_path_factory, "quant-q4k", LlamaConfig, LlamaForCausalLM, options)
    rng = np.random.default_rng(5)
    source = gguf_reader(str(export_gguf(path, tmp_path / "f32.gguf", "F32")))
    blocks = {t.name: random_blocks("Q4_K", int(t.shape[1]), int(t.shape[0]), rng, 2e-3)
              for t in source.tensors if len(t.shape) == 2}
    q4_file = tmp_path / "hand-made-q4_k.gguf"
    _rewrite_with(path, q4_file, blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    model = load_decoder(q4_file, "float32")
    config = model.config
    floats = dict(gguf_tensors(q4_file, gguf_config(q4_file)))

    def meant(name: str) -> torch.Tensor:
        raw = blocks[name]
        weight = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)).reshape(raw.shape[0], -1)
        heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}.get(name.split(".")[-2])
        return weight if heads is None else unpermute_rotary(weight, heads, name)

    layer = model.layers[0]
    expected = {
        layer.qkv_proj: ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"],
        layer.mlp.gate_up_proj: ["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"],
        layer.mlp.down_proj: ["blk.0.ffn_down.weight"], layer.o_proj: ["blk.0.attn_output.weight"],
        model.lm_head: ["output.weight"],
    }
    for linear, names in expected.items():
        assert linear.qmethod == "q4_k" and linear.weight.device.type == "meta"
        assert torch.equal(q4_weight(linear.qweight, linear.qscales, torch.float32),
                           torch.cat([meant(name) for name in names]))
    assert torch.equal(model.embed_tokens.weight, floats["model.embed_tokens.weight"].dequantized())
    file_model = file_as_float_model(path, q4_file, tmp_path)
    from engine.kernels.block_rows import MAX_ROWS
    from engine.models.quantized_linear import q8_0_matmul_dtype

    for prompt in [*PROMPTS, list(range(3, 40))]:  # 37 rows: the dequantized matmul's
        want = logits(file_model, prompt)
        # The dequantized matmul runs in bfloat16 where the CPU multiplies it natively (8 bits a value).
        narrow = len(prompt) > MAX_ROWS and q8_0_matmul_dtype(torch.float32) == torch.bfloat16
        assert (logits(model, prompt) - want).abs().max() <= (2 ** -4 if narrow else 1e-4) * want.abs().max()
    second = load_decoder(q4_file, "float32", tp=TensorParallel(rank=1, size=2)).layers[0]
    for linear, name in ((second.mlp.down_proj, "blk.0.ffn_down.weight"), (second.o_proj, "blk.0.attn_output.weight")):
        assert torch.equal(q4_weight(linear.qweight, linear.qscales, torch.float32), meant(name).chunk(2, dim=1)[1])


@pytest.mark.parametrize("threads", [1, 3])
def test_our_q8_0_quantizer_gives_torchs_blocks_bit_for_bit(threads):
    """The one-pass kernel (engine/kernels/q8_0_quantize.c) against the torch ops it replaces, on
    weights with a block of zeros, one of ties (halves of a step, rounded to even), one of subnormals,
    Q8_0's own dequantized blocks (their largest step exactly 127) and a wide range of magnitudes."""
    from engine.kernels import q8_0_quantize

    generator = torch.Generator().manual_seed(threads)
    weight = torch.randn(37, 96, generator=generator) * torch.logspace(-6, 3, 37)[:, None]
    weight[0, :32] = 0
    weight[1, :32] = torch.arange(-16, 16) * 0.5 * (1 / 127)  # -8/127 .. 7.5/127: ties at every half step
    weight[1, 31] = 1.0  # the block's largest: scale 1/127, so each value above is k/2 steps
    weight[2, :32] = torch.randn(32, generator=generator) * 1e-39
    steps = torch.randint(-127, 128, (32,), generator=generator, dtype=torch.int8)
    steps[0] = 127
    weight[3, :32] = steps.float() * torch.tensor(0.0123, dtype=torch.float16).float()
    ours = q8_0_quantize.quantize(weight, threads)
    assert ours is not None
    torchs = quantize_per_block_in_torch(weight)
    assert ours[0].dtype == torch.int8 and ours[1].dtype == torch.float32
    assert torch.equal(ours[0], torchs[0]) and torch.equal(ours[1], torchs[1])
    assert torch.equal(ours[0][3, :32], steps)  # a Q8_0 block read back is the file's own
    # A million values: a quotient within an ulp of a half step turns up a few times, which
    # a reciprocal's product in place of the division would round the other way.
    wide = torch.randn(1024, 1024, generator=generator)
    ours_wide, torchs_wide = q8_0_quantize.quantize(wide, threads), quantize_per_block_in_torch(wide)
    assert ours_wide is not None
    assert torch.equal(ours_wide[0], torchs_wide[0]) and torch.equal(ours_wide[1], torchs_wide[1])
    assert torch.equal(quantize_per_block(weight)[0], torchs[0])  # what the loader calls runs it
    assert q8_0_quantize.quantize(weight.bfloat16(), threads) is None  # other dtypes: torch's ops


def test_a_gguf_model_needs_a_tokenizer(tmp_path):
    with pytest.raises(ValueError, match="--tokenizer"):
        EngineConfig(model=str(tmp_path / "model.gguf"))


def test_hostile_gguf_files_are_refused_in_one_line(reference, tmp_path):
    import gguf

    path, _ = reference
    good = export_gguf(path, tmp_path / "good.gguf", "Q8_0").read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good[:len(good) // 2])
    absurd = tmp_path / "absurd.gguf"
    absurd.write_bytes(good[:8] + struct.pack("<QQ", 1 << 40, 3) + good[24:])
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"\x00" * 64)
    unknown = tmp_path / "unknown.gguf"
    writer = gguf.GGUFWriter(str(unknown), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((512, 66), dtype=np.uint8),
                      raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    _finish(writer)
    wrong_shape = tmp_path / "wrong-shape.gguf"
    _rewrite_with(path, wrong_shape, {"blk.0.ffn_up.weight": np.zeros((100, 64), dtype=np.float32)})
    cases = {truncated: "not a readable GGUF file", absurd: "claims 1099511627776 tensors",
             not_gguf: "not a readable GGUF file", unknown: "IQ2_XXS",
             wrong_shape: r"up_proj.weight. has shape \(100, 64\)"}
    for file, words in cases.items():
        with pytest.raises(ModelLoadError, match=words) as refused:
            load_decoder(file, "float32")
        assert "\n" not in str(refused.value), str(refused.value)


def test_a_gguf_header_reads_as_ggufs_own_reader_reads_it_with_its_arrays_stepped_over(tmp_path):
    import gguf

    from engine.models.gguf_file import _value, gguf_reader

    file = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(str(file), "llama")
    writer.add_block_count(3)
    writer.add_token_list([f"token{i}" * (i % 7) for i in range(3000)])  # strings of every length, empty too
    writer.add_token_types([i % 5 for i in range(3000)])
    writer.add_eos_token_id(7)
    writer.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(4, 16))
    writer.add_tensor("output_norm.weight", np.ones(16, dtype=np.float32))
    _finish(writer)
    ours, theirs = gguf_reader(str(file)), gguf.GGUFReader(str(file))
    assert [(t.name, t.tensor_type, t.data.tobytes()) for t in ours.tensors] == \
           [(t.name, t.tensor_type, t.data.tobytes()) for t in theirs.tensors]
    for key in ("llama.block_count", "tokenizer.ggml.eos_token_id"):
        assert _value(ours, key) == theirs.get_field(key).contents()
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.tokens.*not read"):
        _value(ours, "tokenizer.ggml.tokens")
    cut = tmp_path / "cut.gguf"  # the vocabulary cut short: refused, not read past the end
    cut.write_bytes(file.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        gguf_reader(str(cut))


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _rewrite_with(model_dir, out, replaced: dict, raw_dtype=None) -> None:
    """A GGUF of `model_dir` (F32) whose named tensors are replaced by others (raw bytes of
    `raw_dtype`, if given: one GGML type, or one per tensor name)."""
    import gguf

    from engine.models.gguf_file import gguf_reader

    source = export_gguf(model_dir, out.with_suffix(".src.gguf"), "F32")
    reader = gguf_reader(str(source))
    arch = reader.get_field("general.architecture").contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name.startswith((f"{arch}.", "tokenizer.ggml.eos")):
            writer.add_key_value(field.name, field.contents(), field.types[0])
    for tensor in reader.tensors:
        if tensor.name in replaced:
            kind = raw_dtype.get(tensor.name) if isinstance(raw_dtype, dict) else raw_dtype
            writer.add_tensor(tensor.name, replaced[tensor.name], raw_dtype=kind)
        else:
            writer.add_tensor(tensor.name, tensor.data)
    _finish(writer)


def write_compressed_tensors(source, out, activations=None) -> None:
    """`source` (an HF checkpoint) as llm-compressor writes int8 W8A16 (or W8A8): each decoder
    linear weight as int8 rows with a `weight_scale` per row; the LM head left float (ignored)."""
    import json

    from safetensors.torch import load_file

    from engine.models.quantized_linear import quantize_per_channel

    shutil.copytree(source, out)
    tensors = load_file(str(out / "model.safetensors"))
    stored = {}
    for name, tensor in tensors.items():
        if ".layers." in name and name.endswith("proj.weight"):
            q, scales = quantize_per_channel(tensor)
            stored[name], stored[f"{name}_scale"] = q, scales.reshape(-1, 1)
        else:
            stored[name] = tensor
    save_file(stored, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": activations, "weights": {
            "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}}}}
    (out / "config.json").write_text(json.dumps(config))


async def test_compressed_tensors_int8_checkpoints_load_and_others_are_refused(reference, tmp_path):
    import json

    path, hf_model = reference
    expected = transformers_greedy(hf_model, PROMPTS, 12)
    w8a16 = tmp_path / "w8a16"
    write_compressed_tensors(path, w8a16)
    model = load_decoder(w8a16, "float32")
    quantized = {name for name, m in model.named_modules() if getattr(m, "qweight", None) is not None}
    assert quantized and not any(name == "lm_head" for name in quantized)  # as the checkpoint says
    async with open_engine(engine_config(str(w8a16), dtype="float32")) as engine:
        assert engine.info.quantization == "int8"
        for prompt, tokens in zip(PROMPTS, expected, strict=True):
            assert (await final_output(engine, prompt, greedy(12))).outputs[0].token_ids == tokens
    w8a8 = tmp_path / "w8a8"
    write_compressed_tensors(path, w8a8, {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True,
                                          "strategy": "token"})
    assert load_decoder(w8a8, "float32").layers[0].mlp.gate_up_proj.qmethod == "w8a8"
    original = (w8a16 / "config.json").read_text()
    for change, words in (({"quant_method": "gptq"}, "method 'gptq' is not supported"),
                          ({"format": "pack-quantized"}, "format 'pack-quantized'")):
        config = json.loads(original)
        config["quantization_config"].update(change)
        (w8a16 / "config.json").write_text(json.dumps(config))
        with pytest.raises(ModelLoadError, match=words):
            load_decoder(w8a16, "float32")


# The MoE reference's logits move more under int4 (measured: 16% of the largest): routing amplifies it.
@pytest.mark.parametrize(("method", "tolerance"), [("int8", INT8_TOLERANCE), ("int4", 0.2)])
def test_moe_experts_are_quantized_with_the_rest(tmp_path_factory, method, tolerance):
    from tests.test_moe_eplb import hf_moe

    path, _ = hf_moe(tmp_path_factory, "mixtral")
    exact, quantized = load_decoder(path, "float32"), load_decoder(path, "float32", quantization=method)
    assert quantized.moe_layers and all(e.qmethod == method and e.w13.device.type == "meta"
                                        for e in quantized.moe_layers)
    assert quantized.step_read_bytes < 0.4 * exact.step_read_bytes
    for prompt in PROMPTS:
        assert (logits(quantized, prompt) - logits(exact, prompt)).abs().max() <= tolerance * logits(
            exact, prompt).abs().max()
    with pytest.raises(ValueError, match="enable-eplb"):
        EngineConfig(model=str(path), quantization=method, enable_eplb=True)


# The newer dense families, int8 and w8a8 (int4's error on the tiny models is the reference
# checkpoints' own matter). Gemma 3 normalises each sublayer's output before the residual (its
# sandwich norms), which scales that sublayer's rounding up to the hidden state's size; the Phi-3
# reference draws its weights at 0.1, five times transformers' default. Measured: 3.8% and 3.5%.
NEW_FAMILY_TOLERANCE = {"mistral": INT8_TOLERANCE, "gemma3": 0.05, "phi3": 0.05}


@pytest.mark.parametrize("family", sorted(NEW_FAMILY_TOLERANCE))
@pytest.mark.parametrize("method", ["int8", "w8a8"])
def test_the_newer_families_quantize_within_tolerance(tmp_path_factory, family, method):
    from tests.test_reference_transformers import COMMON as REFERENCE_COMMON
    from tests.test_reference_transformers import FAMILIES as REFERENCE_FAMILIES

    config_cls, model_cls, extra = REFERENCE_FAMILIES[family]
    path, _ = save_hf_checkpoint(tmp_path_factory, f"quant-{family}", config_cls, model_cls,
                                 {**REFERENCE_COMMON, **extra})
    float_model, quantized = load_decoder(path, "float32"), load_decoder(path, "float32", quantization=method)
    assert all(m.qmethod == method for m in quantized.modules() if hasattr(m, "qweight"))
    for prompt in PROMPTS:
        ours, exact = logits(quantized, prompt), logits(float_model, prompt)
        assert (ours - exact).abs().max() <= NEW_FAMILY_TOLERANCE[family] * exact.abs().max()


def test_the_roofline_counts_the_weight_bytes_a_decode_reads():
    """`bench roofline`'s floor: a q8_0 layer under auto is read through its tiles where it has them
    (not its blocks as well), else through its blocks and scales; a float layer through its weight."""
    from bench.roofline import decode_read_bytes

    tiled, wide, plain = Linear(256, 64, bias=False), Linear(768, 64, bias=False), Linear(32, 8, bias=False)
    model = torch.nn.ModuleList([tiled, wide, plain])
    for layer in (tiled, wide):
        assert layer.quantize("q8_0") and layer.multiply_q8_0_activations_as("auto")
    tiled.pack_q8_0_tiles()
    blocks = [sum(t.numel() * t.element_size() for t in (m.qweight, m.qscales)) for m in (tiled, wide)]
    assert wide.qtiles is None
    tiles = tiled.qtiles.numel() * tiled.qtiles.element_size() if tiled.qtiles is not None else blocks[0]
    assert decode_read_bytes(model) == tiles + blocks[1] + 8 * 32 * 4


def test_q8_0_tiles_go_to_every_short_layer_and_to_wide_ones_within_the_budget():
    """The worker lays tiles out (a second copy of a layer's weight) for every q8_0 layer of at most
    512 features, and for wider ones while all the tiles stay within the budget (a quarter of the
    machine's memory); the rest keep float32 rows. Their bytes are what `q8_0_tile_bytes` counts."""
    from engine.kernels import q8_0_rows
    from engine.worker.q8_0_tiles import lay_out_q8_0_tiles, q8_0_tile_bytes, tile_budget_bytes

    if not q8_0_rows.int8_fast():  # tiles are VNNI's layout: there is nothing to lay out without it
        assert lay_out_q8_0_tiles([], 0) == (0, 0, 0)
        return
    layers = [Linear(256, 512, bias=False), Linear(896, 64, bias=False), Linear(896, 48, bias=False),
              Linear(768, 512, bias=False)]
    for layer in layers:
        assert layer.quantize("q8_0") and layer.multiply_q8_0_activations_as("auto")
    tile_bytes = [q8_0_tile_bytes(m) for m in layers]
    tiled, held, left_out = lay_out_q8_0_tiles(layers, budget=sum(tile_bytes[:3]))
    assert (tiled, left_out) == (3, 1)
    assert [m.qtiles is not None for m in layers] == [True, True, True, False]  # the last over the budget
    assert held == sum(m.qtiles.numel() * m.qtiles.element_size() for m in layers if m.qtiles is not None)
    assert 0 < tile_budget_bytes() <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


def test_a_helper_on_a_lent_cpu_shares_one_thread_products_with_the_same_sums():
    """`lend_cpus` (the served layout lends the HTTP server's CPU): a one-thread int8 product through
    a large weight (chunks of about 128 KB: an LM head, a wide layer of few rows; past 16 input rows
    less, so that a prompt's narrow layers are shared too) is then shared chunk by chunk with a
    helper thread on that CPU, which takes chunks only when it gets to run there. The sums are the
    call's alone, one level or two, through tiles where the CPU has them, for one row, sixteen and a
    prompt's 100, weights ending in a partial tile included."""
    from engine.kernels import q8_0_rows

    # A narrow layer (the small Llama's down projection) runs alone for decodes, shared for prompts.
    assert q8_0_rows.lent_chunks(256, 768, 1) == q8_0_rows.lent_chunks(256, 768, 16) == 1
    assert q8_0_rows.lent_chunks(256, 768, 128) >= 8
    assert q8_0_rows.lent_chunks(4096, 256, 1) == 10  # 128 KB chunks: 448 rows of 256 features
    generator = torch.Generator().manual_seed(7)
    weights = [quantize_per_block(torch.randn(n, k, generator=generator))
               for n, k in ((4096, 256), (2000 * 16 + 8, 256), (200, 4864), (256, 768))]
    tiles = [q8_0_rows.pack_tiles(q, s) for q, s in weights]

    def products() -> list[torch.Tensor | None]:
        out = []
        for (qweight, scales), packed in zip(weights, tiles, strict=True):
            for x in inputs[qweight.shape[1]]:
                if x.shape[0] <= 16:  # a batch of decodes; a prompt's rows take the tiles only
                    out += [q8_0_rows.int8_row_times(x, qweight, scales, 1),
                            q8_0_rows.TWO_LEVELS.row_times(x, qweight, scales, 1)]
                if packed is not None:
                    out.append(q8_0_rows.packed_row_times(x, qweight, scales, packed, 1))
        return out

    inputs = {k: [torch.randn(rows, k, generator=generator) for rows in (1, 16, 100)] for k in (256, 768, 4864)}
    alone = products()
    assert all(p is not None for p in alone)
    assert q8_0_rows.lend_cpus(sorted(os.sched_getaffinity(0))[:1])
    for _ in range(20):  # the helper joins some calls and misses others: the same sums either way
        assert all(torch.equal(a, b) for a, b in zip(alone, products(), strict=True))
