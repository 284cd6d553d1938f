"""oneDNN-packed linears compute what `F.linear` does, eager and inside a compiled graph."""

from __future__ import annotations

import pytest
import torch

from engine.models import layers
from engine.models import packed_linear as packed_linear_module
from engine.models.layers import Linear, RowParallelLinear
from engine.models.loader import load_decoder
from engine.models.packed_linear import PACK_MIN_ELEMENTS, can_pack, pack_weight, packed_linear
from engine.models.parallel import TensorParallel


def _filled(linear: Linear, seed: int) -> Linear:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator))
        if linear.bias is not None:
            linear.bias.copy_(torch.randn(linear.bias.shape, generator=generator))
    return linear


@pytest.mark.parametrize("rows", [1, 16, 64, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_equals_f_linear(rows, bias):
    linear = _filled(Linear(256, 1024, bias=bias), rows)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(7))
    expected = torch.nn.functional.linear(x, linear.weight, linear.bias)
    if not linear.pack():
        pytest.fail("oneDNN packing is expected on the CPU build of torch the project pins")
    assert linear.weight.device.type == "meta", "the stored weight is dropped once packed"
    assert linear.weight.shape == (1024, 256)
    torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-4)


def test_a_row_parallel_linear_adds_its_bias_after_the_packed_product():
    linear = _filled(RowParallelLinear(512, 256, bias=True, tp=TensorParallel()), 1)
    x = torch.randn(5, 512)
    expected = torch.nn.functional.linear(x, linear.weight, linear.bias)
    assert linear.pack()
    torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-4)


def test_keep_weight_leaves_a_tied_weight_in_place():
    linear = _filled(Linear(256, 1024, bias=False), 2)
    stored = linear.weight
    assert linear.pack(keep_weight=True)
    assert linear.weight is stored and linear.packed is not None


def test_small_weights_and_unsupported_dtypes_keep_f_linear():
    small = Linear(64, 64, bias=False)
    assert small.weight.numel() < PACK_MIN_ELEMENTS
    assert not small.pack() and small.packed is None and small.weight.device.type == "cpu"
    assert not can_pack(torch.empty(1024, 256, dtype=torch.float64))
    assert pack_weight(torch.empty(1024, 256, dtype=torch.int8)) is None


def test_the_packed_linear_compiles_into_a_graph_that_takes_the_packed_weight_as_an_input(tmp_path, monkeypatch):
    """The lowering passes the opaque weight through untouched (a copy of it would be garbage)."""
    from engine.models.packed_linear import register_inductor_lowering

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the package's library is unpacked

    register_inductor_lowering()
    weight, bias = torch.randn(1024, 256), torch.randn(1024)
    packed = pack_weight(weight)
    assert packed is not None

    class Step(torch.nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.relu(packed_linear(x, w, b))

    rows = torch.export.Dim("rows", min=2, max=256)
    x = torch.randn(4, 256)
    program = torch.export.export(Step(), (x, packed, bias), dynamic_shapes=({0: rows}, None, None), strict=False)
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "step.pt2"))
    step = torch._inductor.aoti_load_package(path)
    for n in (2, 9):
        x = torch.randn(n, 256)
        torch.testing.assert_close(step(x, packed, bias), torch.relu(torch.nn.functional.linear(x, weight, bias)),
                                   rtol=1e-5, atol=1e-4)


def test_a_reduced_dtype_slower_than_float32_is_named_with_its_figures(monkeypatch):
    from engine.models import packed_linear as module

    assert module.slower_than_float32(torch.float32) is None
    timings = iter([100e-6, 400e-6, 300e-6, 420e-6])  # float32 at 1 and 16 rows, then bfloat16
    monkeypatch.setattr(module, "_best_of", lambda fn, repeats=5: next(timings))
    message = module.slower_than_float32(torch.bfloat16, size=64)
    assert message is not None
    assert message.startswith("bfloat16 matmuls run slower than float32 on this CPU (300 against 100 us at 1 row)")
    assert "--dtype float32" in message
    timings = iter([100e-6, 400e-6, 105e-6, 380e-6])  # within the margin: not reported
    assert module.slower_than_float32(torch.bfloat16, size=64) is None


def test_one_row_on_one_thread_takes_the_transposed_rows_and_equals_f_linear(monkeypatch, threads):
    linear = _filled(Linear(256, 1024, bias=True), 3)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(8))
    expected = torch.nn.functional.linear(x, linear.weight, linear.bias)
    assert linear.pack(keep_weight=True)
    rows = linear.transpose_for_one_row()
    assert rows is not None and rows.shape == (256, 1024) and rows.is_contiguous()
    packed_rows: list[int] = []

    def counted(x, packed, bias):
        packed_rows.append(x.shape[0])
        return packed_linear(x, packed, bias)

    monkeypatch.setattr(layers, "packed_linear", counted)
    threads(1)
    one, two = linear(x[:1]), linear(x[:2])
    threads(2)
    one_on_two = linear(x[:1])
    assert packed_rows == [2, 1], "only one row on one thread skips the packed weight"
    for got, want in ((one, expected[:1]), (two, expected), (one_on_two, expected[:1])):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_a_layer_whose_stored_weight_was_dropped_has_no_transposed_rows():
    linear = _filled(Linear(256, 1024, bias=False), 4)
    assert linear.pack()
    assert linear.transpose_for_one_row() is None and linear.row_weight is None


def test_a_tied_table_becomes_rows_the_embedding_and_the_head_share(tiny_model_dir, monkeypatch, threads):
    """For one compute thread a packed tied head holds the table as [hidden, vocab] rows: the
    embedding reads a view of them, the head's one-row product reads them, and the model holds no
    more bytes than before."""
    plain = load_decoder(tiny_model_dir, "float32")  # the tiny table is below the packing size
    assert plain.lm_head.packed is None
    monkeypatch.setattr(packed_linear_module, "PACK_MIN_ELEMENTS", 0)
    model = load_decoder(tiny_model_dir, "float32")
    head, embed = model.lm_head, model.embed_tokens
    assert head.row_weight is None and embed.weight.is_contiguous(), "only when asked"
    model.hold_tied_table_as_rows()
    assert head.packed is not None and head.row_weight is not None
    assert head.weight is embed.weight and embed.weight.data_ptr() == head.row_weight.data_ptr()
    assert model.weight_bytes == plain.weight_bytes
    ids = torch.tensor([0, 7, model.config.vocab_size - 1])
    assert torch.equal(model.embed(ids), plain.embed(ids))
    hidden = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(9))
    threads(1)
    torch.testing.assert_close(model.compute_logits(hidden), plain.compute_logits(hidden), rtol=1e-5, atol=1e-4)


class _PlusOne:
    """A LoRA delta that adds one to every output."""

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y + 1


def test_a_linear_computes_by_the_method_chosen_once_and_lora_wraps_whichever_it_is():
    """Unquantized, then packed, then int8: each choice replaces the last; a LoRA delta set before
    stays around every later method, and removing it leaves that method."""
    linear = _filled(Linear(256, PACK_MIN_ELEMENTS // 256 + 64, bias=True), seed=3)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    exact = torch.nn.functional.linear(x, linear.weight, linear.bias)
    assert linear.method is layers.UNQUANTIZED and linear.qmethod is None
    linear.lora = _PlusOne()
    torch.testing.assert_close(linear(x), exact + 1)
    assert linear.pack(keep_weight=True) and linear.method.name == "packed"
    torch.testing.assert_close(linear(x), exact + 1, rtol=1e-4, atol=1e-4)
    assert linear.quantize("int8") and linear.qmethod == "int8" and linear.lora is not None
    assert 0 < float((linear(x) - exact - 1).norm() / exact.norm()) < 0.05  # int8: close, not exact
    linear.lora = None
    assert linear.method == layers.Quantized("int8") and linear.lora is None
