"""LoRA adapters served from one base decoder: where each PEFT module's factors land in our
(partly fused) linears, and the delta a step adds for the rows of each adapter.

A batch mixes requests for several adapters and the base model. Each targeted `Linear` holds a
`LinearLoRA`; while a step runs, `lora_rows` names which rows of the flat batch belong to which
adapter, and the linear adds, per adapter present, `(x[rows] @ A.T) @ B.T` into the output
columns the module owns (q, k or v of the fused qkv projection, gate or up of gate_up): one
low-rank product per adapter and module, over all of that adapter's rows at once, as punica's
grouped kernels batch by adapter. No weights are ever merged, so the base rows cost nothing.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from engine.lora.adapter import LoRAAdapter, LoRAError
from engine.models.decoder import DecoderForCausalLM, DecoderLayer
from engine.models.layers import DenseMLP, Linear

logger = logging.getLogger(__name__)

_current_rows: list[dict[str, torch.Tensor]] = []  # the running step's rows per adapter name


@contextlib.contextmanager
def lora_rows(rows: dict[str, torch.Tensor]) -> Iterator[None]:
    """While a step runs: adapter name -> indices of its rows in the flat batch."""
    _current_rows.append(rows)
    try:
        yield
    finally:
        _current_rows.pop()


@dataclass
class _Slice:
    start: int  # output columns [start, end) of the linear
    end: int
    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [end - start, rank], scaled


class LinearLoRA:
    """The adapters of one linear layer, by adapter name."""

    def __init__(self) -> None:
        self.by_adapter: dict[str, list[_Slice]] = {}

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base output for input `x`) with each adapter's delta added to its rows."""
        if not _current_rows or not _current_rows[-1]:
            return y
        for name, rows in _current_rows[-1].items():
            slices = self.by_adapter.get(name)
            if not slices:
                continue
            x_rows = x.index_select(0, rows)
            for s in slices:
                y[:, s.start:s.end].index_add_(0, rows, (x_rows @ s.a.T) @ s.b.T)
        return y


@dataclass(frozen=True)
class _Target:
    linear: Linear
    start: int
    end: int

    @property
    def shape(self) -> tuple[int, int]:  # (in_features, out_features) of the module PEFT saw
        return self.linear.weight.shape[1], self.end - self.start


def projection_targets(model: DecoderForCausalLM) -> dict[str, _Target]:
    """HF module path of every projection an adapter may change -> where it lives in `model`."""
    targets: dict[str, _Target] = {}
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        prefix = f"model.layers.{i}"
        q, kv, _ = layer.split
        attention = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
        for name, (start, end) in attention.items():
            targets[f"{prefix}.self_attn.{name}"] = _Target(layer.qkv_proj, start, end)
        targets[f"{prefix}.self_attn.o_proj"] = _Target(layer.o_proj, 0, layer.o_proj.weight.shape[0])
        if isinstance(layer.mlp, DenseMLP):  # an MoE block's experts take no adapter
            gate_up, down = layer.mlp.gate_up_proj, layer.mlp.down_proj
            inter = gate_up.weight.shape[0] // 2
            targets[f"{prefix}.mlp.gate_proj"] = _Target(gate_up, 0, inter)
            targets[f"{prefix}.mlp.up_proj"] = _Target(gate_up, inter, 2 * inter)
            targets[f"{prefix}.mlp.down_proj"] = _Target(down, 0, down.weight.shape[0])
    return targets


class LoRAServing:
    """The adapters a worker serves. At most `max_cpu_loras` are held in memory (least recently
    used evicted); an evicted one is read again from its directory when a request next uses it.
    `read(name)` reads one (engine.lora.adapter.read_adapter bound to its path)."""

    def __init__(self, model: DecoderForCausalLM, read: Callable[[str], LoRAAdapter], names: list[str],
                 max_cpu_loras: int) -> None:
        self.targets = projection_targets(model)
        self.read = read
        self.names = set(names)
        self.max_cpu_loras = max_cpu_loras
        self.held: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.reads = 0  # adapters read from disk, start-up included (tests)
        for name in names:  # each is read and checked now: a bad adapter fails start-up
            self._hold(name)

    def rows(self, names: list[str | None], counts: list[int], device: torch.device) -> dict[str, torch.Tensor]:
        """Row indices per adapter for a flat batch of `counts[i]` rows for adapter `names[i]` (None:
        the base model); an adapter evicted from memory is read again first."""
        by_name: dict[str, list[int]] = {}
        offset = 0
        for name, count in zip(names, counts, strict=True):
            if name is not None:
                by_name.setdefault(name, []).extend(range(offset, offset + count))
            offset += count
        for name in by_name:
            if name in self.held:
                self.held.move_to_end(name)
            else:
                self._hold(name)
        return {name: torch.tensor(rows, dtype=torch.long, device=device) for name, rows in by_name.items()}

    def _hold(self, name: str) -> None:
        if name not in self.names:
            raise LoRAError(f"no LoRA adapter named {name!r} is loaded")
        adapter = self.read(name)
        self.reads += 1
        adapter.check_against({module: target.shape for module, target in self.targets.items()})
        while len(self.held) >= self.max_cpu_loras:
            self._drop(next(iter(self.held)))
        for module, factors in adapter.modules.items():
            target = self.targets[module]
            lora = target.linear.lora
            if not isinstance(lora, LinearLoRA):
                lora = target.linear.lora = LinearLoRA()
            lora.by_adapter.setdefault(name, []).append(_Slice(target.start, target.end, factors.a, factors.b))
        self.held[name] = adapter

    def _drop(self, name: str) -> None:
        del self.held[name]
        for target in self.targets.values():
            if isinstance(target.linear.lora, LinearLoRA):
                target.linear.lora.by_adapter.pop(name, None)
        logger.info("LoRA adapter %s evicted from memory (--max-cpu-loras %d)", name, self.max_cpu_loras)
