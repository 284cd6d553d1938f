"""LoRA adapters served from one base decoder: where each PEFT module's factors land in our
(partly fused) linears, and the delta a step adds for the rows of each adapter.

As vLLM does, adapters run from `max_loras` slots: each targeted linear holds the factors of
every slot stacked (`LinearLoRA`; the output slices it owns, q, k and v of the fused qkv
projection or gate and up of gate_up, side by side along the rank dimension; ranks below the
largest zero-padded). An adapter is copied into a slot when a step first needs it; slots are
reused least recently used first. A step's rows are laid out once (`LoRABatch`: for each slot,
the indices of its rows, padded to the longest), and each linear then computes the delta of every
adapter in one gather and two batched matmuls, however many adapters the batch mixes (punica's
SGMV, in plain torch). No weights are merged, so the base model's rows cost nothing but the
padding. The price of the side-by-side layout is memory: B holds zeros off its slices' blocks
(slots x slices x rank x out features per linear; 2-3x what separate slices would hold), for
2-3x fewer operations a step.

In an exported graph (engine/worker/precompiled_graph.py) the row layout and the slot stacks are
graph inputs (`graph_inputs`, `traced_inputs`), so the delta compiles with the rest and one graph
serves every mix of adapters. Under `torch.compile` (an MoE model's graphs) it is the opaque op
`trio_llm::lora_delta`, which finds the call's `LoRABatch` where `lora_batch` put it.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

import torch

from engine.kernels.operators import operator
from engine.lora.adapter import LoRAAdapter, LoRAError, LoRAFactors
from engine.models.decoder import DecoderForCausalLM, DecoderLayer
from engine.models.layers import DenseMLP, Linear
from engine.models.parallel import TensorParallel

logger = logging.getLogger(__name__)


@dataclass
class LoRABatch:
    """One call's rows, by slot: `gather` [slots, m] row indices (padding repeats row 0), `keep`
    [slots, m] 1 for the real ones and 0 for the padding (its delta is dropped)."""

    gather: torch.Tensor
    keep: torch.Tensor
    serving: LoRAServing


# Context variables (per thread and task: engines stepping in different threads never mix):
# the running call's rows (None: the base model only), and while a graph is exported its LoRA
# inputs (the row layout, and each linear's stacks by index).
_current: contextvars.ContextVar[LoRABatch | None] = contextvars.ContextVar("trio_llm_lora_batch", default=None)
_Traced = tuple[torch.Tensor, torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]]]
_traced: contextvars.ContextVar[_Traced | None] = contextvars.ContextVar("trio_llm_lora_traced", default=None)


@contextlib.contextmanager
def traced_inputs(gather: torch.Tensor, keep: torch.Tensor,
                  stacks: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """While a graph is exported: the delta reads the row layout and the slot stacks from these
    (graph inputs), so it compiles with the rest of the graph."""
    token = _traced.set((gather, keep, stacks))
    try:
        yield
    finally:
        _traced.reset(token)


def graph_inputs(linears: list[LinearLoRA]) -> list[torch.Tensor]:
    """What a compiled graph takes for its adapters, for the running call: the row layout
    (`gather` [slots, m], `keep` [slots, m]; all padding when the call runs the base model alone),
    then every linear's A stack, then every B stack."""
    batch = _current.get()
    if batch is None:
        first = linears[0].a_t
        gather = torch.zeros(first.shape[0], 2, dtype=torch.long, device=first.device)
        keep = torch.zeros(first.shape[0], 2, dtype=first.dtype, device=first.device)
    else:
        gather, keep = batch.gather, batch.keep
    return [gather, keep, *(lora.a_t for lora in linears), *(lora.b_t for lora in linears)]


def grouped_delta(x: torch.Tensor, gather: torch.Tensor, keep: torch.Tensor, a_t: torch.Tensor,
           b_t: torch.Tensor) -> torch.Tensor:
    """Every row's delta, [rows, out] (zeros where `keep` is 0): one gather, two batched matmuls."""
    low = torch.bmm(x[gather], a_t)  # [slots, m, slices * rank]
    delta = torch.bmm(low, b_t).reshape(-1, b_t.shape[-1]) * keep.reshape(-1, 1)
    return x.new_zeros(x.shape[0], b_t.shape[-1]).index_add(0, gather.reshape(-1), delta)


@contextlib.contextmanager
def lora_batch(batch: LoRABatch | None) -> Iterator[None]:
    """While a forward pass runs: which of its rows run which adapter slot."""
    token = _current.set(batch)
    try:
        yield
    finally:
        _current.reset(token)


@dataclass(frozen=True)
class _Slice:
    start: int  # output columns [start, end) of the linear
    end: int
    first_rank: int  # its factors' place along the stacked rank dimension


class LinearLoRA:
    """The adapter slots of one linear layer: every slice's factors stacked along one rank
    dimension, A as `a_t` [slots, in, slices * rank] and B as `b_t` [slots, slices * rank, out]
    with each slice's block in its own rows and columns (zeros elsewhere), so one pair of batched
    matmuls computes the delta of every slice of every adapter. `index`: its place in
    `LoRAServing.linears` (what the compiled graphs' op names it by)."""

    def __init__(self, index: int, in_features: int, out_features: int) -> None:
        self.index = index
        self.in_features = in_features
        self.out_features = out_features
        self.slices: dict[str, _Slice] = {}  # HF module -> its slice
        self.a_t = torch.empty(0)
        self.b_t = torch.empty(0)

    def __repr__(self) -> str:  # in the compiled graphs' cache key: what the graph bakes in
        return f"LinearLoRA({self.index}, {self.out_features}, {sorted(self.slices.values(), key=str)}, " \
               f"{tuple(self.a_t.shape)})"

    def allocate(self, slots: int, rank: int, dtype: torch.dtype, device: torch.device) -> None:
        width = rank * len(self.slices)
        self.a_t = torch.zeros(slots, self.in_features, width, dtype=dtype, device=device)
        self.b_t = torch.zeros(slots, width, self.out_features, dtype=dtype, device=device)

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base output for input `x`) with each row's adapter delta added."""
        if torch.compiler.is_compiling() and not torch.compiler.is_exporting():
            # torch.compile (an MoE model's graphs): an opaque op, which dynamo does not look into
            with_op: torch.Tensor = y + lora_delta(x, self.index, self.out_features)
            return with_op
        traced = _traced.get()
        if traced is not None:  # exported: the delta compiles with the graph, over its LoRA inputs
            gather, keep, stacks = traced
            a_t, b_t = stacks[self.index]
            return y + grouped_delta(x, gather, keep, a_t, b_t)
        batch = _current.get()
        return y if batch is None else y + self.delta(x)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """The delta alone, [rows, out_features] (zeros for the base model's rows)."""
        batch = _current.get()
        if batch is None:
            return x.new_zeros(x.shape[0], self.out_features)
        return grouped_delta(x, batch.gather, batch.keep, self.a_t, self.b_t)


@operator("trio_llm::lora_delta")
def lora_delta(x: torch.Tensor, linear: int, out_features: int) -> torch.Tensor:
    """Inside a compiled graph: linear `linear`'s adapter delta for the running call's rows."""
    batch = _current.get()
    if batch is None:
        return x.new_zeros(x.shape[0], out_features)
    return batch.serving.linears[linear].delta(x)


@lora_delta.register_fake
def _(x: torch.Tensor, linear: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


@dataclass(frozen=True)
class _Target:
    linear: Linear
    start: int  # this rank's output columns of the linear
    end: int
    row_parallel: bool  # input features split over tensor-parallel ranks (o, down); else output (the rest)
    tp: TensorParallel

    @property
    def shape(self) -> tuple[int, int]:
        """(in_features, out_features) of the whole module PEFT saw, every rank's share together."""
        fan_in, fan_out = self.linear.weight.shape[1], self.end - self.start
        return (fan_in * self.tp.size, fan_out) if self.row_parallel else (fan_in, fan_out * self.tp.size)

    def shard(self, factors: LoRAFactors) -> LoRAFactors:
        """This rank's share of a module's factors: A's input features under row parallelism
        (each rank's delta is a partial sum, reduced with the base output), else B's outputs."""
        if self.row_parallel:
            return LoRAFactors(self.tp.shard(factors.a, 1).contiguous(), factors.b)
        return LoRAFactors(factors.a, self.tp.shard(factors.b, 0).contiguous())


def projection_targets(model: DecoderForCausalLM) -> dict[str, _Target]:
    """HF module path of every projection an adapter may change -> where it lives in `model`."""
    targets: dict[str, _Target] = {}
    tp = model.tp
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        prefix = f"model.layers.{i}"
        q, kv, _ = layer.split
        attention = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
        for name, (start, end) in attention.items():
            targets[f"{prefix}.self_attn.{name}"] = _Target(layer.qkv_proj, start, end, False, tp)
        targets[f"{prefix}.self_attn.o_proj"] = _Target(layer.o_proj, 0, layer.o_proj.weight.shape[0], True, tp)
        if isinstance(layer.mlp, DenseMLP):  # an MoE block's experts take no adapter
            gate_up, down = layer.mlp.gate_up_proj, layer.mlp.down_proj
            inter = gate_up.weight.shape[0] // 2
            targets[f"{prefix}.mlp.gate_proj"] = _Target(gate_up, 0, inter, False, tp)
            targets[f"{prefix}.mlp.up_proj"] = _Target(gate_up, inter, 2 * inter, False, tp)
            targets[f"{prefix}.mlp.down_proj"] = _Target(down, 0, down.weight.shape[0], True, tp)
    return targets


class LoRAServing:
    """The adapters a worker serves: `max_loras` slots, and at most `max_cpu_loras` adapters held in
    memory (least recently used evicted; an evicted one is read again from its directory when a
    request next uses it). `read(name, path)` reads one (engine.lora.adapter.read_adapter). Every
    configured adapter (`paths`: name -> directory) is read and checked at start-up, so a bad one
    fails it; `add` and `remove` change the set while serving.

    The slots are laid out for the modules and the largest rank of the configured adapters, or,
    with `any_module_rank`, for every projection at that rank (what an engine that loads adapters
    it has not seen needs, as vLLM's slots always are); an adapter added later must fit them."""

    def __init__(self, model: DecoderForCausalLM, read: Callable[[str, str], LoRAAdapter], paths: dict[str, str],
                 max_loras: int, max_cpu_loras: int, *, any_module_rank: int | None = None) -> None:
        self.targets = projection_targets(model)
        self.read = read
        self.paths = dict(paths)
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.held: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.slots: OrderedDict[str, int] = OrderedDict()  # adapter -> slot, least recently used first
        self.reads = 0  # adapters read from disk, start-up included (tests)
        modules: set[str] = set()
        max_rank = 1
        for name in paths:  # one at a time: beyond max_cpu_loras, each read evicts the oldest
            adapter = self._hold(name)
            modules.update(adapter.modules)
            max_rank = max(max_rank, adapter.rank)
        if any_module_rank is not None:
            modules, max_rank = set(self.targets), any_module_rank
        self.rank = max_rank
        self.linears = self._lay_out_slots(modules, max_rank, model)

    def _lay_out_slots(self, modules: set[str], max_rank: int, model: DecoderForCausalLM) -> list[LinearLoRA]:
        """A `LinearLoRA` on every linear some adapter changes, its slot stacks wide enough for the
        largest rank; returns them in index order."""
        linears: list[LinearLoRA] = []
        for module in sorted(modules, key=list(self.targets).index):
            target = self.targets[module]
            lora = target.linear.lora
            if not isinstance(lora, LinearLoRA):
                weight = target.linear.weight
                lora = target.linear.lora = LinearLoRA(len(linears), weight.shape[1], weight.shape[0])
                linears.append(lora)
            lora.slices[module] = _Slice(target.start, target.end, len(lora.slices) * max_rank)
        for lora in linears:
            lora.allocate(self.max_loras, max_rank, model.dtype, model.device)
        return linears

    def batch(self, names: list[str | None], counts: list[int], device: torch.device) -> LoRABatch | None:
        """The rows of one forward call, `counts[i]` rows for adapter `names[i]` (None: the base
        model), by slot; each adapter is put in a slot first (read again if evicted from memory).
        None when no row runs an adapter."""
        by_name: dict[str, list[int]] = {}
        offset = 0
        for name, count in zip(names, counts, strict=True):
            if name is not None:
                by_name.setdefault(name, []).extend(range(offset, offset + count))
            offset += count
        if not by_name:
            return None
        by_slot = {self.place(name, keep=set(by_name)): rows for name, rows in by_name.items()}
        width = max(2, *(len(rows) for rows in by_slot.values()))  # 2: export specialises a 1
        gather = torch.zeros(self.max_loras, width, dtype=torch.long)
        keep = torch.zeros(self.max_loras, width)
        for slot, rows in by_slot.items():
            gather[slot, :len(rows)] = torch.tensor(rows)
            keep[slot, :len(rows)] = 1.0
        dtype = self.linears[0].a_t.dtype if self.linears else torch.float32
        return LoRABatch(gather.to(device), keep.to(device, dtype), self)

    def place(self, name: str, keep: Collection[str] = ()) -> int:
        """The slot adapter `name` runs from, copying it in (over the least recently used adapter
        not in `keep`) if it is in none."""
        if name in self.slots:
            self.slots.move_to_end(name)
            return self.slots[name]
        adapter = self.hold(name)
        free = sorted(set(range(self.max_loras)) - set(self.slots.values()))
        if free:
            slot = free[0]
        else:
            victim = next(n for n in self.slots if n not in keep)
            slot = self.slots.pop(victim)
        rank = adapter.rank
        for lora in self.linears:
            lora.a_t[slot].zero_()
            lora.b_t[slot].zero_()
            for module, piece in lora.slices.items():
                factors = adapter.modules.get(module)
                if factors is not None:
                    first = piece.first_rank
                    lora.a_t[slot, :, first:first + rank].copy_(factors.a.T)
                    lora.b_t[slot, first:first + rank, piece.start:piece.end].copy_(factors.b.T)
        self.slots[name] = slot
        return slot

    def hold(self, name: str) -> LoRAAdapter:
        """Adapter `name`, read again from its directory if it was evicted from memory."""
        if name in self.held:
            self.held.move_to_end(name)
            return self.held[name]
        return self._hold(name)

    def add(self, name: str, path: str) -> None:
        """Serve adapter `name` from directory `path` from now on, replacing one of that name (its
        rows read the new weights from the next step). It is read and checked first: a `LoRAError`
        leaves everything as it was."""
        adapter = self._checked(self.read(name, path))
        self._check_fits_slots(adapter)
        self.remove(name)
        self.paths[name] = path
        self._keep(name, adapter)

    def remove(self, name: str) -> None:
        """Stop serving adapter `name` (a no-op if it is not served). The engine removes only an
        adapter no request uses."""
        self.paths.pop(name, None)
        self.held.pop(name, None)
        self.slots.pop(name, None)

    def _hold(self, name: str) -> LoRAAdapter:
        if name not in self.paths:
            raise LoRAError(f"no LoRA adapter named {name!r} is loaded")
        adapter = self._checked(self.read(name, self.paths[name]))
        self._keep(name, adapter)
        return adapter

    def _checked(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """`adapter`, checked against the base model, with this rank's share of its factors."""
        self.reads += 1
        adapter.check_against({module: target.shape for module, target in self.targets.items()})
        adapter.modules = {module: self.targets[module].shard(f) for module, f in adapter.modules.items()}
        return adapter

    def _check_fits_slots(self, adapter: LoRAAdapter) -> None:
        laid_out = {module for lora in self.linears for module in lora.slices}
        missing = sorted(set(adapter.modules) - laid_out, key=list(self.targets).index)
        if adapter.rank <= self.rank and not missing:
            return
        what = f"rank {adapter.rank} is above the slots' rank {self.rank}" if adapter.rank > self.rank else \
            f"it changes {missing[0]}, which no adapter served at start-up changes"
        raise LoRAError(f"LoRA adapter {adapter.name!r}: {what}; start the engine with --allow-runtime-lora-updating "
                        "to lay the slots out for any adapter up to --max-lora-rank")

    def _keep(self, name: str, adapter: LoRAAdapter) -> None:
        while len(self.held) >= self.max_cpu_loras:
            evicted, _ = self.held.popitem(last=False)
            logger.info("LoRA adapter %s evicted from memory (--max-cpu-loras %d)", evicted, self.max_cpu_loras)
        self.held[name] = adapter
