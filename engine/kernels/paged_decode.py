"""A step's decodes attended over the paged KV cache in place, on torch's threads:
engine/kernels/paged_decode.c.

Eagerly `decode_attention` calls the kernel through ctypes (`attention.decodes_by_kernel`). In a
compiled decode graph it is the operator `trio_llm::paged_decode` (`graph_decode`), which an
AOTInductor package calls through its C shim (`c_shims`, passed to inductor by
engine/worker/precompiled_graph.py), as it calls `trio_llm::q8_0_rows`.

The kernel takes float32 queries over a float32, float16 or bfloat16 cache (`--kv-cache-dtype`)
and returns float32; a head size that is a multiple of the machine's vector up to 256. Where it
does not apply, or cannot be built here, callers keep torch's formulas (`takes` says which).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.kernels import native
from engine.kernels.operators import operator

LIBRARY = "paged_decode"
CACHE_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the C file's enum cache_type


@functools.cache
def _library() -> ctypes.CDLL | None:
    library = native.load(LIBRARY)
    if library is None:
        return None
    size, pointer = ctypes.c_long, ctypes.c_void_p
    library.paged_decode_f32.argtypes = ((pointer,) * 5 + (size, pointer, pointer) + (size,) * 7
                                         + (ctypes.c_float, ctypes.c_int, size))
    library.paged_decode_f32.restype = ctypes.c_int
    for name in ("paged_decode_dim_multiple", "paged_decode_max_dim"):
        getattr(library, name).restype = size
    return library


def share_with(share: int) -> bool:
    """From now on one-thread calls hand their work items to the C function at address `share`
    (q8_0_rows.c `q8_0_lent_share`: claimed by the calling thread and the helper on the lent CPU,
    engine/kernels/lent_cpu.h), in this process. Whether the kernel took it."""
    library = _library()
    return library is not None and library.paged_decode_share_with(ctypes.c_void_p(share)) == 0


def available() -> bool:
    """Whether the kernel is built and loaded (building it now if need be: ~0.5 s once)."""
    return _library() is not None


def takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel computes this attention: queries [B, Hq, D] on CPU over caches
    [slots, Hkv, D] of one of `CACHE_TYPES` (the same for both), a head size the build takes, whole
    groups of query heads per KV head, and each cache row's heads dense."""
    library = _library()
    if library is None or q.device.type != "cpu" or k_cache.device.type != "cpu":
        return False
    dim = q.shape[-1]
    return (k_cache.dtype in CACHE_TYPES and v_cache.dtype == k_cache.dtype
            and dim % library.paged_decode_dim_multiple() == 0 and dim <= library.paged_decode_max_dim()
            and q.shape[1] % k_cache.shape[1] == 0 and k_cache.stride() == v_cache.stride()
            and k_cache.stride(2) == 1 and k_cache.stride(1) == dim)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, block_size: int, scale: float, threads: int) -> torch.Tensor | None:
    """q: [B, Hq, D], one query per sequence -> [B, Hq, D] float32, each over its `seq_lens[b]`
    cached positions, whose keys and values lie in the caches ([slots, Hkv, D]) at the slots its
    row of `block_table` ([B, nb] block ids, int64) gives; the (sequence, KV head) pairs split over
    `threads` threads of OpenMP's team. None where the kernel does not apply (`takes`)."""
    if not takes(q, k_cache, v_cache):
        return None
    library = _library()
    assert library is not None
    q = q.float().contiguous()
    assert block_table.dtype == torch.int64 and block_table.stride(1) == 1 and seq_lens.dtype == torch.int64
    seq_lens = seq_lens.contiguous()
    batch, q_heads, dim = q.shape
    out = torch.empty(q.shape, dtype=torch.float32)
    status = library.paged_decode_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), batch, block_table.data_ptr(),
        block_table.stride(0), seq_lens.data_ptr(), block_size, q_heads, k_cache.shape[1], dim, q.stride(0),
        k_cache.stride(0), out.stride(0), scale, CACHE_TYPES[k_cache.dtype], threads)
    assert status == 0, "shapes checked by takes()"
    return out


@operator("trio_llm::paged_decode")
def graph_decode(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor) -> torch.Tensor:
    """`decode_attention` as a graph's operator, on torch's thread count: q float32 [B, Hq, D]
    already scaled, the caches viewed as blocks [num_blocks, block_size, Hkv, D] (the block size
    is their shape's, so the C shim needs no number beside its tensors). Called from Python only
    where a graph runs outside a package; a package calls the C shim."""
    blocks, block_size, kv_heads, dim = k_blocks.shape
    out = decode_attention(q, k_blocks.view(-1, kv_heads, dim), v_blocks.view(-1, kv_heads, dim), block_table,
                           seq_lens, block_size, 1.0, torch.get_num_threads())
    if out is None:
        raise RuntimeError(f"the paged_decode kernel does not take queries {tuple(q.shape)} over a "
                           f"{k_blocks.dtype} cache {tuple(k_blocks.shape)}")
    return out


@graph_decode.register_fake
def _(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, block_table: torch.Tensor,
      seq_lens: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape, dtype=torch.float32)


def c_shims() -> dict[torch._ops.OpOverload, list[str]]:
    """Inductor's `aot_inductor.custom_ops_to_c_shims` for the operator."""
    return {graph_decode.overload: [
        "AOTITorchError aoti_torch_cpu_paged_decode(AtenTensorHandle q, AtenTensorHandle k_blocks, "
        "AtenTensorHandle v_blocks, AtenTensorHandle block_table, AtenTensorHandle seq_lens, AtenTensorHandle* ret0)"]}
