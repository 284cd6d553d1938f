"""`trio-llm bench lora-delta`: the LoRA delta of one decoder layer's four linears, compiled by
inductor, in the form the engine uses (grouped by slot: a gather, two batched matmuls, a scatter;
engine/lora/serving.py) against the dense form it was weighed against (every slot's factors side
by side, each row's slot one-hot as a mask between two plain matmuls), over the base linears'
time. Shapes of the default model and of Qwen2.5-0.5B; forms alternate, medians of `repeats`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch._dynamo

from engine.lora.serving import grouped_delta

# (in, out, slices) of qkv, o, gate_up and down
SHAPES = {"default": ((256, 512, 3), (256, 256, 1), (256, 1536, 2), (768, 256, 1)),
          "qwen2.5-0.5b": ((896, 1152, 3), (896, 896, 1), (896, 9728, 2), (4864, 896, 1))}


def _grouped(x: torch.Tensor, w: torch.Tensor, gather: torch.Tensor, keep: torch.Tensor, a_t: torch.Tensor,
             b_t: torch.Tensor) -> torch.Tensor:
    return x @ w + grouped_delta(x, gather, keep, a_t, b_t)


def _one_hot(x: torch.Tensor, w: torch.Tensor, slot_of_row: torch.Tensor, a_cat: torch.Tensor,
             b_cat: torch.Tensor) -> torch.Tensor:
    rows, slots = slot_of_row.shape
    low = (x @ a_cat).view(rows, slots, -1) * slot_of_row.unsqueeze(-1)
    return x @ w + low.view(rows, -1) @ b_cat


def _base(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


def _microseconds(fn: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...], calls: int = 300) -> float:
    for _ in range(20):
        fn(*args)
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - start) / calls * 1e6


def _inputs(rows: int, slots: int, rank: int, fan_in: int, fan_out: int, slices: int
            ) -> dict[str, tuple[torch.Tensor, ...]]:
    width = slices * rank
    x, w = torch.randn(rows, fan_in), torch.randn(fan_in, fan_out)
    slot = torch.arange(rows) * slots // rows  # rows spread evenly over the slots
    gather = torch.stack([torch.nonzero(slot == s).flatten() for s in range(slots)])
    a_t, b_t = torch.randn(slots, fan_in, width) * 0.01, torch.randn(slots, width, fan_out) * 0.01
    one_hot = torch.nn.functional.one_hot(slot, slots).float()
    a_cat, b_cat = a_t.permute(1, 0, 2).reshape(fan_in, -1).contiguous(), b_t.reshape(-1, fan_out).contiguous()
    return {"base": (x, w), "grouped": (x, w, gather, torch.ones(slots, rows // slots), a_t, b_t),
            "one-hot": (x, w, one_hot, a_cat, b_cat)}


def run(rows: int, settings: list[tuple[int, int]], threads: int, repeats: int) -> str:
    torch.set_num_threads(threads)
    torch._dynamo.config.cache_size_limit = 256  # one graph per shape, every one compiled
    compiled = {name: torch.compile(fn, dynamic=False)
                for name, fn in (("base", _base), ("grouped", _grouped), ("one-hot", _one_hot))}
    lines = [f"rows={rows} threads={threads} float32, inductor; one layer's four linears (qkv, o, gate_up, down), "
             f"median of {repeats} alternating rounds",
             "model | slots | rank | base us | grouped delta +us (engine) | one-hot delta +us"]
    for model, shapes in SHAPES.items():
        for slots, rank in settings:
            times: dict[str, list[float]] = {name: [] for name in compiled}
            for round_ in range(repeats):
                total = dict.fromkeys(compiled, 0.0)
                for fan_in, fan_out, slices in shapes:
                    inputs = _inputs(rows, slots, rank, fan_in, fan_out, slices)
                    order = list(compiled) if round_ % 2 == 0 else list(reversed(compiled))
                    for name in order:
                        total[name] += _microseconds(compiled[name], inputs[name])
                for name, value in total.items():
                    times[name].append(value)
            base, grouped, one_hot = (statistics.median(times[n]) for n in ("base", "grouped", "one-hot"))
            lines.append(f"{model} | {slots} | {rank} | {base:.0f} | +{grouped - base:.0f} | +{one_hot - base:.0f}")
    return "\n".join(lines)
