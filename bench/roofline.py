"""`trio-llm bench roofline`: this machine's memory bandwidth and matmul peak, and each decode
step's floor beside the measured step.

A decode step reads every weight once and every cached key and value of its sequences; it does
about two FLOPs per weight per sequence (plus attention's). Its floor is the larger of bytes /
read bandwidth and FLOPs / peak; at small batches the bytes decide. The measured step is the
compiled decode graph plus the LM head, as `trio-llm bench forward` times it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.forward import DecodeBench
from engine.models.layers import Linear
from engine.models.packed_linear import pack_weight, packed_linear

BANDWIDTH_BYTES = 512 << 20  # far past the last-level cache
MATMUL_SIZE = 2048


def _best_seconds(fn: Callable[[], object], repeats: int, rounds: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def read_bandwidth() -> float:
    """Bytes/s read from a tensor larger than the caches: the faster of a reduction over it and
    oneDNN's one-row product with it laid out as a packed weight (the read a decode step makes;
    on this machine it reads faster than the reduction does, so the reduction alone would put
    the floor above what the step reaches)."""
    data = torch.ones(BANDWIDTH_BYTES // 4)
    by_sum = BANDWIDTH_BYTES / _best_seconds(data.sum, 5)
    packed = pack_weight(data.view(-1, 1024))
    del data
    if packed is None:
        return by_sum
    row = torch.ones(1, 1024)
    return max(by_sum, BANDWIDTH_BYTES / _best_seconds(lambda: packed_linear(row, packed, None), 5))


def matmul_peak(dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of a large square matmul."""
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE).to(dtype)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE).to(dtype)
    return 2 * MATMUL_SIZE ** 3 / _best_seconds(lambda: a @ b, 3)


@dataclass
class StepFloor:
    batch: int
    weight_bytes: int
    kv_bytes: int
    flops: float
    measured_ms: float
    after_idle_ms: float
    bandwidth: float
    peak: float

    @property
    def floor_ms(self) -> float:
        return 1000 * max((self.weight_bytes + self.kv_bytes) / self.bandwidth, self.flops / self.peak)


def decode_read_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: each linear layer's in the form a decode multiplies by
    (a q8_0 layer's tiles where it has them, else its blocks and scales, else the packed or plain
    weight and whatever buffers its quantization keeps), the LM head's included. Norms' vectors
    are left out (a few KB), and so is the embedding table, of which a step reads a row a sequence."""
    total = 0
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        tensors: list[torch.Tensor | None]
        if module.qtiles is not None:
            tensors = [module.qtiles]
        elif module.qweight is not None:
            tensors = [module.qweight, module.qscales]
        elif module.packed is not None:
            tensors = [module.packed]
        else:
            tensors = [module.weight, *module.buffers(recurse=False)]
        total += sum(t.numel() * t.element_size() for t in tensors if t is not None and t.device.type != "meta")
    return total


def floors(bench: DecodeBench, batches: list[int], repeats: int, idle_s: float) -> list[StepFloor]:
    model = bench.model
    bandwidth, peak = read_bandwidth(), matmul_peak(model.dtype)
    weight_bytes = decode_read_bytes(model)
    params = sum(p.numel() for p in model.parameters())
    k_cache, _ = bench.runner.kv_caches[0]
    per_token_kv = 2 * len(bench.runner.kv_caches) * k_cache[0, 0].numel() * k_cache.element_size()
    results = []
    for batch in batches:
        measured = bench.time_steps(batch, repeats).compiled_ms
        after_idle = bench.time_after_idle(batch, repeats, idle_s)
        results.append(StepFloor(batch, weight_bytes, batch * bench.context * per_token_kv, 2.0 * params * batch,
                                 measured, after_idle, bandwidth, peak))
    return results


def report(rows: list[StepFloor], threads: int, idle_s: float, dtype: torch.dtype = torch.float32) -> str:
    first = rows[0]
    lines = [f"read bandwidth {first.bandwidth / 1e9:.1f} GB/s, {str(dtype).removeprefix('torch.')} matmul peak "
             f"{first.peak / 1e9:.1f} GFLOP/s "
             f"({threads} threads); weights a decode reads {first.weight_bytes / 1e6:.1f} MB",
             f"measured: steps back to back (best of 3 rounds); after idle: each step after {idle_s * 1000:g} ms "
             "asleep, as a served step follows the loop's and the HTTP server's work (median)",
             "batch | KV read MB | floor ms (bytes / bandwidth, FLOPs / peak) | measured ms | measured / floor "
             "| after idle ms | after idle / floor"]
    for row in rows:
        by_bytes = 1000 * (row.weight_bytes + row.kv_bytes) / row.bandwidth
        by_flops = 1000 * row.flops / row.peak
        floor = f"{row.floor_ms:.2f} ({by_bytes:.2f}, {by_flops:.2f})"
        lines.append(f"{row.batch:>5} | {row.kv_bytes / 1e6:>10.1f} | {floor:<43} | {row.measured_ms:>11.2f} | "
                     f"{row.measured_ms / row.floor_ms:>15.2f}x | {row.after_idle_ms:>13.2f} | "
                     f"{row.after_idle_ms / row.floor_ms:>17.2f}x")
    return "\n".join(lines)
