"""Copying HF-named checkpoint tensors into a model's own (partly fused) parameters."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import torch

from engine.errors import ModelLoadError

Slot = tuple[str, int | None]  # (our parameter name, part of a fused parameter or None)
Q8_0_BLOCK_BYTES = 34  # a float16 scale, then 32 int8 steps
Q5_0_BLOCK_BYTES = 22  # a float16 scale d, 32 high bits, 32 low 4-bit halves: w = d * (step - 16)
Q4_0_BLOCK_BYTES = 18  # a float16 scale d, then 32 4-bit steps two a byte: w = d * (step - 8)
Q4_1_BLOCK_BYTES = 20  # float16 d and m, then 32 4-bit steps: w = d * step + m
Q4_K_BLOCK_BYTES = 144  # 256 weights: float16 d and dmin, 8 x 6-bit (sc, m), 256 4-bit steps: w = d sc step - dmin m


@dataclass(frozen=True)
class Q8_0Blocks:
    """A GGUF Q8_0 tensor [rows, features] as the file holds it: each row in blocks of 32 int8
    steps with one float16 scale. Loading copies the blocks into a `q8_0` layer as they are (the
    file's steps exactly, and no float round trip: the 0.5B shape's warm start, docs/benchmarks.md);
    anything else takes them `dequantized`. Both tensors index rows, then blocks, so one change of
    those dimensions (a shard, a permutation of rows) applies to both (`map`)."""

    values: torch.Tensor  # int8 [rows, blocks, 32]
    scales: torch.Tensor  # float16 [rows, blocks]
    method: ClassVar[str] = "q8_0"  # the linear method that holds them as they are

    @classmethod
    def from_raw(cls, raw: torch.Tensor, rows: int) -> Q8_0Blocks:
        """The blocks of `raw`, the file's uint8 bytes of `rows` rows (views: nothing is copied)."""
        blocks = raw.reshape(rows, -1, Q8_0_BLOCK_BYTES)
        return cls(blocks[..., 2:].view(torch.int8), float16_field(blocks, 0))

    @classmethod
    def from_q5_0(cls, raw: torch.Tensor, rows: int) -> Q8_0Blocks:
        """A Q5_0 tensor's blocks as Q8_0's, exactly: its steps less 16 (-16..15) are int8 steps
        with the block's own float16 scale. Its 32 high bits are a little-endian uint32, bit j
        step j's; its 16 bytes hold steps j (low half) and j + 16 (high half), as Q4_0's."""
        blocks = raw.reshape(rows, -1, Q5_0_BLOCK_BYTES)
        high = (blocks[..., 2:6].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
        low = unpacked_steps(blocks[..., 6:])
        steps = (low | (high.reshape(*low.shape) << 4)).to(torch.int8) - 16
        return cls(steps, float16_field(blocks, 0))

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


@dataclass(frozen=True)
class Q4Blocks:
    """A GGUF Q4_0, Q4_1 or Q4_K tensor [rows, features] as 4-bit steps in blocks of 32 with a
    float32 scale and low each, weight = scale * step + low: Q4_0's (d, -8 d), Q4_1's (d, m), and
    for each 32 of a Q4_K super-block of 256 (d * sc, -dmin * m), all exact in float32. A `q4_*`
    layer holds them as they are (engine/models/quantized_linear.py; its kernel reads them so:
    engine/kernels/q4_rows.c); anything else takes them `dequantized`, which is gguf's own
    `dequantize` bit for bit. Q4_0 and Q4_1 steps are the file's bytes (views); Q4_K's are
    rearranged into the same layout."""

    values: torch.Tensor  # uint8 [rows, blocks, 16]: byte j holds step j (low half) and step j + 16
    scales: torch.Tensor  # float32 [rows, blocks, 2]: (scale, low)
    method: str  # "q4_0", "q4_1" or "q4_k": the linear method that holds them

    @classmethod
    def from_raw(cls, raw: torch.Tensor, rows: int, kind: str) -> Q4Blocks:
        """The blocks of `raw`, the file's uint8 bytes of `rows` rows of GGML type `kind`."""
        if kind == "Q4_K":
            return cls._from_q4_k(raw.reshape(rows, -1, Q4_K_BLOCK_BYTES))
        size = Q4_0_BLOCK_BYTES if kind == "Q4_0" else Q4_1_BLOCK_BYTES
        blocks = raw.reshape(rows, -1, size)
        d = float16_field(blocks, 0).float()
        low = -8 * d if kind == "Q4_0" else float16_field(blocks, 2).float()
        return cls(blocks[..., size - 16:], torch.stack([d, low], dim=-1), kind.lower())

    @classmethod
    def _from_q4_k(cls, supers: torch.Tensor) -> Q4Blocks:
        """llama.cpp's `get_scale_min_k4` on each super-block's 12 bytes of 6-bit scales and mins
        (as gguf's `Q4_K.get_scale_min`); its 128 bytes of steps hold 64 weights per 32 bytes, the
        first 32 in the low halves, which become two blocks of this layout."""
        rows, count = supers.shape[:2]
        d, dmin = float16_field(supers, 0).float(), float16_field(supers, 2).float()
        packed = supers[..., 4:16].reshape(rows, count, 3, 4)
        first, second, rest = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
        sc = torch.cat([first & 63, (rest & 15) | ((first >> 2) & 48)], dim=-1)
        mins = torch.cat([second & 63, (rest >> 4) | ((second >> 2) & 48)], dim=-1)
        params = torch.stack([d[..., None] * sc.float(), -(dmin[..., None] * mins.float())], dim=-1)
        quads = supers[..., 16:].reshape(rows, count, 4, 1, 32)
        steps = torch.cat([quads & 15, quads >> 4], dim=-2).reshape(rows, count * 8, 32)
        values = steps[..., :16] | (steps[..., 16:] << 4)
        return cls(values, params.reshape(rows, count * 8, 2), "q4_k")

    @property
    def shape(self) -> tuple[int, int]:
        return self.values.shape[0], self.values.shape[1] * 32

    def map(self, change: Callable[[torch.Tensor], torch.Tensor]) -> Q4Blocks:
        return Q4Blocks(change(self.values), change(self.scales), self.method)

    def dequantized(self) -> torch.Tensor:
        """float32 [rows, features], `scale * step + low` (two roundings, as gguf's numpy)."""
        return self.dequantize_into(torch.empty(self.shape))

    def dequantize_into(self, out: torch.Tensor) -> torch.Tensor:
        """`dequantized` written into `out` (contiguous, [rows, features], any float dtype)."""
        blocks = out.view(*self.values.shape[:2], 32)
        blocks[..., :16].copy_(self.values & 15)
        blocks[..., 16:].copy_(self.values >> 4)
        if out.dtype == torch.float32:
            blocks.mul_(self.scales[..., :1]).add_(self.scales[..., 1:])
        else:  # each value rounded once
            blocks.copy_(blocks.float() * self.scales[..., :1] + self.scales[..., 1:])
        return out


def float16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte `offset` of each block (the last dimension: bytes; a view)."""
    return blocks[..., offset:offset + 2].view(torch.float16).squeeze(-1)


def unpacked_steps(packed: torch.Tensor) -> torch.Tensor:
    """4-bit steps held two a byte, byte j holding step j (low half) and step j + len (high half):
    all the steps, in order along the last dimension (GGUF Q4_0's and Q5_0's layout, and `q4_*`'s)."""
    return torch.cat([packed & 15, packed >> 4], dim=-1)


FileBlocks = Q8_0Blocks | Q4Blocks
CheckpointTensor = torch.Tensor | Q8_0Blocks | Q4Blocks
T = TypeVar("T", torch.Tensor, Q8_0Blocks, Q4Blocks, FileBlocks, CheckpointTensor)


def as_float(tensor: CheckpointTensor) -> torch.Tensor:
    """The tensor, or a file's blocks dequantized."""
    return tensor.dequantized() if isinstance(tensor, FileBlocks) else tensor


def as_floats(weights: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with any file blocks dequantized."""
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
    """Copy a checkpoint tensor into (part of) a parameter (a file's blocks dequantized straight
    into it); `ModelLoadError` naming it if the shapes differ."""
    _check_fits(target, tuple(tensor.shape), hf_name)
    if isinstance(tensor, FileBlocks) and target.is_contiguous() and target.device.type == "cpu":
        tensor.dequantize_into(target)  # in place; a GPU's weight takes the float copy (the blocks are on the CPU)
    else:
        target.copy_(as_float(tensor))


def copied_blocks(qweight: torch.Tensor, qscales: torch.Tensor, blocks: FileBlocks, hf_name: str) -> None:
    """Copy a file's blocks into (rows of) the layer that holds them as they are: a `q8_0` layer's
    int8 steps [rows, features] and float32 scales [rows, features / 32], or a `q4_*` layer's packed
    steps [rows, features / 2] and float32 (scale, low) [rows, features / 32, 2]; `ModelLoadError`
    naming the tensor if the shapes differ."""
    features_per_item = 32 // blocks.values.shape[-1]  # int8 steps one a byte, 4-bit ones two
    _check_fits(qweight, blocks.shape, hf_name, (qweight.shape[0], qweight.shape[1] * features_per_item))
    qweight.view(blocks.values.shape).copy_(blocks.values)
    qscales.copy_(blocks.scales)


def _check_fits(target: torch.Tensor, shape: tuple[int, ...], hf_name: str,
                target_shape: tuple[int, ...] | None = None) -> None:
    """`target` (whose values are `target_shape`, if given: packed steps) can take `shape`'s tensor."""
    expected = tuple(target.shape) if target_shape is None else target_shape
    if expected != shape:
        raise ModelLoadError(f"checkpoint tensor {hf_name!r} has shape {shape}, the model expects {expected}")
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
