"""oneDNN-packed weights for the linear layers: every large matmul of a decode step, compiled or eager.

A decode step reads every weight once. torch's `F.linear` over a weight as stored runs far below
what the memory allows on this CPU build; oneDNN's linear over a weight reordered once into its
blocked layout (what inductor's own mkldnn passes use: `torch.ops.mkldnn._reorder_linear_weight`
and `_linear_pointwise`) runs near memory speed, and faster at prompt lengths too. Measured on
this machine, 2 threads, float32 (docs/benchmarks.md): [9728, 896] (the 0.5B shape's gate/up)
4.2 against 0.48 ms at 2 rows, 3.7 against 0.99 at 16, 45 against 18 at 512; [1376, 256] 0.040
against 0.020 ms at 2 rows. Below about [512, 256] oneDNN's fixed cost per call loses (a 64x64
weight: 3 against 10 us), so small weights keep `F.linear` (`PACK_MIN_ELEMENTS`).

How the packed weight reaches the compiled decode graph: it is an opaque `torch._mkldnn` tensor,
which AOTInductor cannot hold as a constant (nor can inductor's own mkldnn lowering take it other
than as a frozen constant). So the graph takes the packed weights as *inputs*
(`precompiled_graph`), the layers call our op `trio_llm::packed_linear`, and at compile time
`register_inductor_lowering` lowers that op to a direct call of oneDNN's kernel (the C shim
`aoti_torch_cpu__linear_pointwise`): no Python inside the step. Without the lowering (a torch
whose inductor internals moved) the op still compiles, as a call back into Python (about 10 us
more a linear); a warning says so.

The packed weight replaces the stored one: once packed, a layer's `weight` is a meta tensor (its
shape and dtype kept, no memory), so packing costs no memory, except the LM head when it is tied
to the embedding table, which still needs its rows.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from engine.kernels.operators import operator

logger = logging.getLogger(__name__)

# The batch oneDNN lays the weight out for; decode batches go up to 64 (the compiled graph's
# default), and a layout for 64 served 1 row faster than one for 1 did.
BATCH_HINT = 64
# Weights smaller than this (out x in elements) keep F.linear: oneDNN's cost per call wins there.
PACK_MIN_ELEMENTS = 512 * 256
SLOWER = 1.1  # a reduced dtype this much slower than float32 is reported at start-up (not noise)


@operator("trio_llm::packed_linear")
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W.T + bias` with W packed by `pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


@packed_linear.register_fake
def _packed_linear_shape(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `pack_weight` applies: a CPU weight with oneDNN, large enough, in float32 (or
    bfloat16 / float16 where oneDNN supports them on this CPU)."""
    if weight.device.type != "cpu" or weight.numel() < PACK_MIN_ELEMENTS or weight.dim() != 2:
        return False
    return bool(torch.backends.mkldnn.is_available()) and _onednn_runs(weight.dtype)  # type: ignore[no-untyped-call]


def _onednn_runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN has kernels for `dtype` on this CPU (float32 always; the reduced dtypes where
    the CPU supports them)."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight reordered into oneDNN's layout for `packed_linear`, or None where packing does
    not apply (`can_pack`) or this torch build lacks the op."""
    if not can_pack(weight):
        return None
    try:
        with torch.no_grad():
            packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
    except (AttributeError, RuntimeError):
        return None
    return packed


_lowering_registered = False


def register_inductor_lowering() -> None:
    """Teach inductor to compile `trio_llm::packed_linear` into a direct call of oneDNN's linear
    (the kernel its own mkldnn passes emit), with the packed weight a graph input. Called before
    compiling a graph; imports inductor. Idempotent."""
    global _lowering_registered
    if _lowering_registered:
        return
    try:
        from torch._inductor import ir, mkldnn_ir
        from torch._inductor.lowering import register_lowering

        # Inductor's IR is internal and untyped: Any throughout.
        def lower(x: Any, packed: Any, bias: Any) -> Any:
            node: Any = mkldnn_ir.LinearUnary
            x = node.require_contiguous(node.realize_input(x))
            # Not `require_contiguous`: an opaque oneDNN tensor has no strides, and a copy of it
            # would be garbage. It is passed to the kernel as it is.
            inputs = [x, node.realize_input(packed)]
            constants: list[object] = ["none", [-1], ""]
            if bias is None:
                constants.insert(0, None)
            else:
                inputs.append(node.require_contiguous(node.realize_input(bias)))
            *rows, _ = x.get_size()
            layout = ir.FixedLayout(device=x.get_device(), dtype=x.get_dtype(), size=[*rows, packed.get_size()[0]])
            output: Any = mkldnn_ir._create_output_node(node(layout, inputs, constants))  # type: ignore[no-untyped-call]
            return ir.TensorBox.create(output)

        register_lowering(torch.ops.trio_llm.packed_linear)(lower)
    except (ImportError, AttributeError, TypeError) as exc:
        logger.warning("packed linears in the compiled graph call back into Python (%s: %s): torch's "
                       "inductor internals differ from the ones this was written for", type(exc).__name__, exc)
    _lowering_registered = True


def slower_than_float32(dtype: torch.dtype, rows: tuple[int, ...] = (1, 16), size: int = 2048) -> str | None:
    """Why `dtype`'s matmuls are slower than float32's on this CPU, measured, or None when they
    are not (or `dtype` is float32). Measures the product a decode step makes: a [size, size]
    weight, packed where `pack_weight` would pack it, at each of `rows`, best of five (a few
    milliseconds in all). A CPU without native bfloat16 converts every weight as it reads it."""
    if dtype == torch.float32:
        return None
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(size, size, generator=generator)
    timings = {}
    for candidate in (torch.float32, dtype):
        w = weight.to(candidate)
        packed = pack_weight(w)
        for n in rows:
            x = torch.randn(n, size, generator=generator).to(candidate)
            timings[candidate, n] = _best_of(lambda: packed_linear(x, packed, None) if packed is not None  # noqa: B023
                                             else torch.nn.functional.linear(x, w))  # noqa: B023
    slower = [n for n in rows if timings[dtype, n] > SLOWER * timings[torch.float32, n]]
    if not slower:
        return None
    name = str(dtype).removeprefix("torch.")
    figures = ", ".join(f"{timings[dtype, n] * 1e6:.0f} against {timings[torch.float32, n] * 1e6:.0f} us at "
                        f"{n} row{'s' if n > 1 else ''}" for n in slower)
    return (f"{name} matmuls run slower than float32 on this CPU ({figures}); --dtype float32 may serve faster "
            f"(oneDNN native {name}: {_onednn_runs(dtype)})")


def _best_of(fn: Any, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
