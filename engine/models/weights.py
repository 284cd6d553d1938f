"""Copying HF-named checkpoint tensors into a model's own (partly fused) parameters."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

from engine.errors import ModelLoadError

Slot = tuple[str, int | None]  # (our parameter name, part of a fused parameter or None)
Q8_0_BLOCK_BYTES = 34  # a float16 scale, then 32 int8 steps


@dataclass(frozen=True)
class Q8_0Blocks:
    """A GGUF Q8_0 tensor [rows, features] as the file holds it: each row in blocks of 32 int8
    steps with one float16 scale. Loading copies the blocks into a `q8_0` layer as they are (the
    file's steps exactly, and no float round trip: the 0.5B shape's warm start, docs/benchmarks.md);
    anything else takes them `dequantized`. Both tensors index rows, then blocks, so one change of
    those dimensions (a shard, a permutation of rows) applies to both (`map`)."""

    values: torch.Tensor  # int8 [rows, blocks, 32]
    scales: torch.Tensor  # float16 [rows, blocks]

    @classmethod
    def from_raw(cls, raw: torch.Tensor, rows: int) -> Q8_0Blocks:
        """The blocks of `raw`, the file's uint8 bytes of `rows` rows (views: nothing is copied)."""
        blocks = raw.reshape(rows, -1, Q8_0_BLOCK_BYTES)
        return cls(blocks[..., 2:].view(torch.int8), blocks[..., :2].view(torch.float16).squeeze(-1))

    @property
    def shape(self) -> tuple[int, int]:
        return self.values.shape[0], self.values.shape[1] * self.values.shape[2]

    def map(self, change: Callable[[torch.Tensor], torch.Tensor]) -> Q8_0Blocks:
        return Q8_0Blocks(change(self.values), change(self.scales))

    def dequantized(self) -> torch.Tensor:
        """float32 [rows, features], `scale * step`: what gguf's `dequantize` gives, bit for bit."""
        return self.dequantize_into(torch.empty(self.shape))

    def dequantize_into(self, out: torch.Tensor) -> torch.Tensor:
        """`dequantized` written into `out` (contiguous, [rows, features], any float dtype: each
        value rounded once), in two passes over it rather than through temporaries."""
        blocks = out.view(self.values.shape)
        blocks.copy_(self.values)
        blocks.mul_(self.scales.float().unsqueeze(-1))
        return out


CheckpointTensor = torch.Tensor | Q8_0Blocks
T = TypeVar("T", torch.Tensor, Q8_0Blocks, CheckpointTensor)


def as_float(tensor: CheckpointTensor) -> torch.Tensor:
    """The tensor, or Q8_0 blocks dequantized."""
    return tensor.dequantized() if isinstance(tensor, Q8_0Blocks) else tensor


def as_floats(weights: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with any Q8_0 blocks dequantized."""
    for name, tensor in weights:
        yield name, as_float(tensor)


def load_named_weights(params: dict[str, torch.nn.Parameter], weights: Iterable[tuple[str, T]],
                       map_name: Callable[[str], Slot | None],
                       copy_into: Callable[[torch.nn.Parameter, str, int | None, T, str], None],
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


def checked_copy(target: torch.Tensor, tensor: CheckpointTensor, hf_name: str) -> None:
    """Copy a checkpoint tensor into (part of) a parameter (Q8_0 blocks dequantized straight into
    it); `ModelLoadError` naming it if the shapes differ."""
    _check_fits(target, tuple(tensor.shape), hf_name)
    if isinstance(tensor, Q8_0Blocks) and target.is_contiguous() and target.device.type == "cpu":
        tensor.dequantize_into(target)  # in place; a GPU's weight takes the float copy (the blocks are on the CPU)
    else:
        target.copy_(as_float(tensor))


def copied_blocks(qweight: torch.Tensor, qscales: torch.Tensor, blocks: Q8_0Blocks, hf_name: str) -> None:
    """Copy a checkpoint's Q8_0 blocks into (rows of) a `q8_0` layer's int8 steps [rows, features]
    and float32 scales [rows, features / 32]; `ModelLoadError` naming it if the shapes differ."""
    _check_fits(qweight, blocks.shape, hf_name)
    qweight.view(blocks.values.shape).copy_(blocks.values)
    qscales.copy_(blocks.scales)


def _check_fits(target: torch.Tensor, shape: tuple[int, ...], hf_name: str) -> None:
    if tuple(target.shape) != shape:
        raise ModelLoadError(f"checkpoint tensor {hf_name!r} has shape {shape}, "
                             f"the model expects {tuple(target.shape)}")
    if target.device.type == "meta":  # a copy into it would be dropped without a word
        raise ModelLoadError(f"checkpoint tensor {hf_name!r} goes to a weight that holds no values")


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
