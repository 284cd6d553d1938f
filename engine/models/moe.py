"""The mixture-of-experts MLP: router, logical -> physical expert choice, grouped expert execution.

Each MoE layer holds `num_physical = num_logical + num_redundant` expert slots. The router
picks logical experts; each pick goes to one of that expert's replicas, chosen by the token's
position in the batch (spread evenly and deterministically). The slots are split across
ranks in two ways:

- expert parallelism (`ExpertLayout.ep_size` > 1): rank r holds slots
  [r * P / size, (r + 1) * P / size) whole, and computes only their tokens;
- tensor parallelism without it: every rank holds every slot, with its share of each expert's
  intermediate features.

Either way each rank's output is a partial sum and one all-reduce (the caller's) completes it.
The placement (`phy2log`, `log2phy`, replica counts) lives in buffers that a rebalance swaps
between steps; each forward counts the tokens routed to each physical slot (`step_load`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import EngineConfig
from engine.eplb.maps import ExpertMaps, initial_phy2log
from engine.errors import ModelLoadError
from engine.models.hf_config import MoeConfig, parse_decoder_config, read_config_json
from engine.models.layers import DenseMLP, Linear
from engine.models.parallel import TensorParallel
from engine.models.quantized_linear import QUANTIZED_MATMULS, can_quantize, quantize_weight


@dataclass(frozen=True)
class ExpertLayout:
    """How one rank holds the physical expert slots."""

    num_logical: int
    num_physical: int
    ep_rank: int = 0
    ep_size: int = 1  # > 1: expert parallelism (slots split across ranks, experts whole)

    def __post_init__(self) -> None:
        if self.num_physical < self.num_logical:
            raise ValueError(f"{self.num_physical} expert slots cannot hold {self.num_logical} experts")
        if self.num_physical % self.ep_size:
            raise ValueError(f"{self.num_physical} physical experts ({self.num_logical} logical + "
                             f"{self.num_physical - self.num_logical} redundant) do not split evenly over "
                             f"{self.ep_size} expert-parallel ranks")

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.ep_size

    @property
    def first_slot(self) -> int:
        return self.ep_rank * self.slots_per_rank

    def is_local(self, slot: int) -> bool:
        return self.first_slot <= slot < self.first_slot + self.slots_per_rank


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's experts' gate (transformers' `GptOssExperts._apply_gate`, vLLM's "swigluoai"): the gate
    clamped above and the up projection both ways at `limit`, x * sigmoid(alpha * x), times up + 1."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def expert_activation(moe: MoeConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The experts' act(gate) * up, as `moe.activation` names it."""
    if moe.activation == "swigluoai":
        return partial(swiglu_oai, alpha=moe.swiglu_alpha, limit=moe.swiglu_limit)
    return swiglu


class FusedExperts(nn.Module):
    """This rank's expert slots: `w13` [slots, 2 * intermediate, hidden] (gate; up) and `w2`
    [slots, hidden, intermediate], with `w13_bias` [slots, 2 * intermediate] and `w2_bias` [slots,
    hidden] where the experts have biases (gpt-oss), plus the placement buffers.

    `add_down_bias`: whether this rank adds the down projection's bias. Its outputs are partial sums
    that one all-reduce completes, so with each expert split over the ranks (tensor parallelism)
    only the first adds it; with whole experts (expert parallelism) the rank holding one does."""

    def __init__(self, hidden: int, intermediate: int, layout: ExpertLayout, biases: bool = False,
                 activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = swiglu,
                 add_down_bias: bool = True, **factory: Any) -> None:
        super().__init__()
        self.layout = layout
        slots = layout.slots_per_rank
        self.w13 = nn.Parameter(torch.empty(slots, 2 * intermediate, hidden, **factory), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(slots, hidden, intermediate, **factory), requires_grad=False)
        self.w13_bias = self.w2_bias = None
        if biases:
            self.w13_bias = nn.Parameter(torch.empty(slots, 2 * intermediate, **factory), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(slots, hidden, **factory), requires_grad=False)
        self.activation = activation
        self.add_down_bias = add_down_bias
        device = factory.get("device")
        self.set_maps(ExpertMaps.from_phy2log(initial_phy2log(1, layout.num_logical, layout.num_physical),
                                              layout.num_logical), device)
        self.step_load = torch.zeros(layout.num_physical, dtype=torch.long, device=device)
        # Once `quantize` ran: each slot's rows quantized (engine/models/quantized_linear.py) and
        # their scales, as buffers `w13_rows`, `w13_scales`, `w2_rows`, `w2_scales`.
        self.qmethod: str | None = None
        for buffer in ("w13_rows", "w13_scales", "w2_rows", "w2_scales"):
            self.register_buffer(buffer, None)

    @property
    def per_slot(self) -> list[torch.Tensor]:
        """The tensors indexed by slot that move with an expert (EPLB): its weights, and its biases
        where it has them."""
        return [t for t in (self.w13, self.w2, self.w13_bias, self.w2_bias) if t is not None]

    def set_maps(self, maps: ExpertMaps, device: Any = None) -> None:
        """Adopt one layer's placement (tensors with a leading dimension of 1)."""
        device = device if device is not None else self.w13.device
        self.phy2log = maps.phy2log[0].to(device)
        self.log2phy = maps.log2phy[0].to(device)
        self.replica_count = maps.replica_count[0].to(device)

    def local_slots_of(self, expert: int) -> list[int]:
        """This rank's local slot indices that hold logical `expert` (to load its weights into)."""
        first = self.layout.first_slot
        return [slot - first for slot, held in enumerate(self.phy2log.tolist())
                if held == expert and self.layout.is_local(slot)]

    def quantize(self, method: str) -> bool:
        """Quantize every slot's gate/up and down rows as `method` ("int8", "w8a8", "int4") where its
        kernel takes their shapes; the float weights are then dropped (meta tensors keep the shapes).
        Returns whether it did. EPLB moves float weights, so it does not run on quantized experts."""
        if not (can_quantize(self.w13[0], method) and can_quantize(self.w2[0], method)):
            return False
        for name in ("w13", "w2"):
            weights = getattr(self, name)
            parts = [quantize_weight(w, method) for w in weights]
            setattr(self, f"{name}_rows", torch.stack([rows for rows, _ in parts]))
            setattr(self, f"{name}_scales", torch.stack([scales for _, scales in parts]))
            setattr(self, name, nn.Parameter(torch.empty_like(weights, device="meta"), requires_grad=False))
        self.qmethod = method
        return True

    def _expert(self, name: str, slot: int, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T (+ b)` for expert slot `slot`'s weight `name` ("w13" or "w2"), float or quantized."""
        biases = getattr(self, f"{name}_bias")
        bias = biases[slot] if biases is not None and (name == "w13" or self.add_down_bias) else None
        if self.qmethod is None:
            return F.linear(x, getattr(self, name)[slot], bias)
        rows, scales = getattr(self, f"{name}_rows"), getattr(self, f"{name}_scales")
        return QUANTIZED_MATMULS[self.qmethod](x, rows[slot], scales[slot], bias)

    def exclude_from_compilation(self) -> None:
        """Run `forward` eagerly inside a compiled model, between its compiled parts: the dispatch
        is data-dependent (tokens per expert decide the loop), and a graph would specialise on one
        step's counts. (Done per instance when compiling: `torch.compiler.disable` imports
        torch._dynamo, seconds that an eager process should not pay at import.)"""
        self.forward = torch.compiler.disable(self.forward)  # type: ignore[method-assign, no-untyped-call]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [T, H]; weights, experts [T, k] (logical ids) -> this rank's partial output [T, H]."""
        T, k = experts.shape
        # One of each expert's replicas, chosen by the (token, pick) position: even, deterministic.
        spread = torch.arange(T * k, device=x.device).view(T, k) % self.replica_count[experts]
        physical = self.log2phy[experts, spread]
        self.step_load += torch.bincount(physical.flatten(), minlength=self.layout.num_physical)
        local = (physical - self.layout.first_slot).flatten()
        picks = ((local >= 0) & (local < self.layout.slots_per_rank)).nonzero().squeeze(1)
        slots, order = local[picks].sort(stable=True)
        picks = picks[order]
        tokens, pick_weights = picks // k, weights.flatten()[picks].unsqueeze(1)
        out = torch.zeros_like(x)
        start = 0
        for slot, count in enumerate(torch.bincount(slots, minlength=self.layout.slots_per_rank).tolist()):
            if count == 0:
                continue
            rows = tokens[start:start + count]
            gate, up = self._expert("w13", slot, x[rows]).chunk(2, dim=-1)
            down = self._expert("w2", slot, self.activation(gate, up))
            out.index_add_(0, rows, down * pick_weights[start:start + count])
            start += count
        return out

    def take_step_load(self) -> torch.Tensor:
        load = self.step_load.clone()
        self.step_load.zero_()
        return load


class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's gated shared expert). Returns this rank's partial sum.

    Routing is a softmax over the router's logits, its top k, renormalised to sum to 1 where the
    model says (the same as gpt-oss's softmax over its top-k logits)."""

    def __init__(self, hidden: int, moe: MoeConfig, layout: ExpertLayout, tp: TensorParallel, **factory: Any) -> None:
        super().__init__()
        self.moe = moe
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.gate = Linear(hidden, layout.num_logical, bias=moe.router_bias, **factory)
        self.e_score_correction_bias = None
        if moe.scoring == "sigmoid":  # DeepSeek's: kept in float32, as its checkpoints store it
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(layout.num_logical, dtype=torch.float32, device=factory.get("device")), requires_grad=False)
        # Under expert parallelism experts are whole on their rank; otherwise each is tensor-sharded.
        whole = layout.ep_size > 1
        intermediate = moe.intermediate_size if whole else tp.split(moe.intermediate_size, "moe_intermediate_size")
        self.experts = FusedExperts(hidden, intermediate, layout, moe.expert_bias, expert_activation(moe),
                                    add_down_bias=whole or tp.rank == 0, **factory)
        self.shared_expert: DenseMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if moe.shared_expert_intermediate_size:
            shared = tp.split(moe.shared_expert_intermediate_size, "shared_expert_intermediate_size")
            self.shared_expert = DenseMLP(hidden, shared, False, tp, reduce=False, **factory)
            if moe.shared_expert_gated:
                self.shared_expert_gate = Linear(hidden, 1, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self._route(self.gate(x).float())
        out = self.experts(x, weights.to(x.dtype), experts)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, logical experts) [T, k] of the router's float32 logits [T, E]."""
        if self.e_score_correction_bias is None:
            weights, experts = torch.softmax(logits, dim=-1).topk(self.top_k, dim=-1)
        else:
            scores = logits.sigmoid()
            experts = grouped_top_k(scores + self.e_score_correction_bias, self.top_k, self.moe.n_group,
                                    self.moe.topk_group)
            weights = scores.gather(1, experts)
        if self.renormalize:  # DeepSeek's sum has a floor: sigmoid scores can all be near zero
            floor = 0.0 if self.e_score_correction_bias is None else 1e-20
            weights = weights / (weights.sum(dim=-1, keepdim=True) + floor)
        return weights * self.moe.routed_scaling_factor, experts


def grouped_top_k(choice: torch.Tensor, top_k: int, num_groups: int, groups_kept: int) -> torch.Tensor:
    """DeepSeek-V3's pick [T, k] from scores [T, E]: the experts split into `num_groups` groups, each
    scored by its best two; the top k experts within the best `groups_kept` groups."""
    if num_groups > 1:
        tokens, num_experts = choice.shape
        grouped = choice.view(tokens, num_groups, num_experts // num_groups)
        best_groups = grouped.topk(2, dim=-1).values.sum(-1).topk(groups_kept, dim=-1).indices
        kept = torch.zeros(tokens, num_groups, dtype=torch.bool, device=choice.device).scatter_(1, best_groups, True)
        choice = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view(tokens, num_experts)
    return choice.topk(top_k, dim=-1).indices


def expert_layout_for(moe: MoeConfig | None, config: EngineConfig, rank: int) -> ExpertLayout | None:
    """How rank `rank` holds an MoE model's experts under `config` (None for a dense model)."""
    if moe is None:
        return None
    num_physical = moe.num_experts + config.eplb_config.num_redundant_experts
    if config.enable_expert_parallel:
        return ExpertLayout(moe.num_experts, num_physical, rank, config.tensor_parallel_size)
    return ExpertLayout(moe.num_experts, num_physical)


def check_expert_options(config: EngineConfig) -> None:
    """Refuse expert options the model cannot take, before any worker starts (`ModelLoadError`):
    `--enable-eplb` on a model without experts, more redundant experts than logical ones, or
    physical experts that do not split over the expert-parallel ranks."""
    if not (config.enable_eplb or config.enable_expert_parallel):
        return
    try:
        moe = parse_decoder_config(read_config_json(config.model)).moe
    except ModelLoadError:
        moe = None  # not a decoder we run (an encoder, say): no experts; loading reports the rest
    if moe is None:
        if config.enable_eplb:
            raise ModelLoadError(f"--enable-eplb needs a mixture-of-experts model; {config.model} has no experts")
        return
    redundant = config.eplb_config.num_redundant_experts
    if redundant > moe.num_experts:
        raise ModelLoadError(f"eplb_config.num_redundant_experts ({redundant}) exceeds the model's "
                             f"{moe.num_experts} experts: at most one spare slot per expert")
    try:
        expert_layout_for(moe, config, 0)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
