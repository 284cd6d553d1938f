"""Copying HF-named checkpoint tensors into a model's own (partly fused) parameters."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from engine.errors import ModelLoadError

Slot = tuple[str, int | None]  # (our parameter name, part of a fused parameter or None)


def load_named_weights(params: dict[str, torch.nn.Parameter], weights: Iterable[tuple[str, torch.Tensor]],
                       map_name: Callable[[str], Slot | None],
                       copy_into: Callable[[torch.nn.Parameter, str, int | None, torch.Tensor, str], None],
                       expected: set[Slot], architecture: str) -> None:
    """Put each checkpoint tensor where `map_name` says (None: skip it); every expected slot must be filled.

    Raises `ModelLoadError` naming the tensor that has no place, or the weights the checkpoint lacks
    (`copy_into` raises it for shape mismatches)."""
    pending = set(expected)
    for hf_name, tensor in weights:
        target = map_name(hf_name)
        if target is None:
            continue
        name, slot = target
        if name not in params:
            raise ModelLoadError(f"checkpoint tensor {hf_name!r} has no place in {architecture}")
        copy_into(params[name], name, slot, tensor, hf_name)
        pending.discard((name, slot))
    if pending:
        names = sorted(n if s is None else f"{n}[{s}]" for n, s in pending)
        raise ModelLoadError(f"checkpoint lacks {len(names)} weights, e.g. {names[:6]}")


def checked_copy(target: torch.Tensor, tensor: torch.Tensor, hf_name: str) -> None:
    """Copy a checkpoint tensor into (part of) a parameter; `ModelLoadError` naming it if the shapes differ."""
    if tuple(target.shape) != tuple(tensor.shape):
        raise ModelLoadError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                             f"the model expects {tuple(target.shape)}")
    target.copy_(tensor)


def split_fused(weights: Iterable[tuple[str, torch.Tensor]], q_size: int,
                kv_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint whose attention and MLP projections are stored fused (Phi-3's `qkv_proj`,
    `gate_up_proj`) as the separate tensors other checkpoints hold: loading then fuses them as it
    fuses those, sharding each part for tensor parallelism."""
    for name, tensor in weights:
        if name.endswith((".qkv_proj.weight", ".qkv_proj.bias")):
            prefix, kind = name.rsplit(".qkv_proj.", 1)
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), torch.split(tensor, [q_size, kv_size, kv_size]),
                                  strict=True):
                yield f"{prefix}.{part}.{kind}", rows
        elif name.endswith((".gate_up_proj.weight", ".gate_up_proj.bias")):
            prefix, kind = name.rsplit(".gate_up_proj.", 1)
            gate, up = tensor.chunk(2)
            yield f"{prefix}.gate_proj.{kind}", gate
            yield f"{prefix}.up_proj.{kind}", up
        else:
            yield name, tensor


def split_stacked_experts(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss's experts, stored stacked (`mlp.experts.gate_up_proj` [experts, hidden, 2 * inter]
    with gate and up columns interleaved, `down_proj` [experts, inter, hidden], and their biases),
    as the per-expert tensors of the other MoE checkpoints (`mlp.experts.E.gate_proj.weight`
    [inter, hidden], ...); its `mlp.router` as their `mlp.gate`."""
    for name, tensor in weights:
        prefix, _, kind = name.rpartition(".experts.")
        if kind in ("gate_up_proj", "gate_up_proj_bias"):
            suffix = "bias" if kind.endswith("_bias") else "weight"
            for expert, both in enumerate(tensor):
                gate, up = both[..., ::2], both[..., 1::2]
                yield f"{prefix}.experts.{expert}.gate_proj.{suffix}", gate.t() if suffix == "weight" else gate
                yield f"{prefix}.experts.{expert}.up_proj.{suffix}", up.t() if suffix == "weight" else up
        elif kind in ("down_proj", "down_proj_bias"):
            suffix = "bias" if kind.endswith("_bias") else "weight"
            for expert, down in enumerate(tensor):
                yield f"{prefix}.experts.{expert}.down_proj.{suffix}", down.t() if suffix == "weight" else down
        else:
            yield name.replace(".mlp.router.", ".mlp.gate."), tensor
