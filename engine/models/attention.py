"""Attention over the paged KV cache, in plain torch (CPU and CUDA).

The KV cache of one layer is two tensors of shape [num_blocks * block_size,
num_kv_heads, head_dim]: slot `b * block_size + i` holds position i of block
b. Each step writes the new tokens' keys and values to their slots, then each
sequence attends over the slots its block table names.

The flat batch is split into groups so padding stays small: one group of
decodes (one query token per sequence, no query padding) and one of prefill
chunks (queries padded to the longest chunk). Per group the keys and values
are gathered into a padded [B, L, H, D] batch and handed to
`scaled_dot_product_attention` with a causal mask built from positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    token_start: int  # the group is tokens [token_start, token_end) of the flat batch
    token_end: int
    q_index: torch.Tensor | None  # [B, Lq] into the group's tokens; None when every sequence has one query
    q_valid: torch.Tensor | None  # [B, Lq] which padded query rows are real
    kv_slots: torch.Tensor  # [B, Lk] cache slots of each sequence's positions 0..Lk-1
    mask: torch.Tensor  # [B, 1, Lq, Lk] True where attention is allowed


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    groups: list[AttentionGroup]


@dataclass(frozen=True)
class SequenceChunk:
    """One sequence's part of a step, as attention needs it."""

    start_position: int
    num_tokens: int
    block_ids: Sequence[int]


def build_metadata(chunks: Sequence[SequenceChunk], block_size: int, device: torch.device) -> AttentionMetadata:
    """Metadata for a flat batch whose sequences are laid out in `chunks` order, decodes first."""
    slots: list[int] = []
    for c in chunks:
        for pos in range(c.start_position, c.start_position + c.num_tokens):
            slots.append(c.block_ids[pos // block_size] * block_size + pos % block_size)
    num_decodes = 0
    while num_decodes < len(chunks) and chunks[num_decodes].num_tokens == 1:
        num_decodes += 1
    groups = []
    if num_decodes:
        groups.append(_group(chunks[:num_decodes], 0, block_size, device, single_query=True))
    if num_decodes < len(chunks):
        groups.append(_group(chunks[num_decodes:], num_decodes, block_size, device, single_query=False))
    return AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=device), groups)


def _group(chunks: Sequence[SequenceChunk], token_start: int, block_size: int,
           device: torch.device, single_query: bool) -> AttentionGroup:
    seq_lens = [c.start_position + c.num_tokens for c in chunks]
    max_len = max(seq_lens)
    num_table_blocks = -(-max_len // block_size)
    tables = torch.tensor([_padded(c.block_ids, num_table_blocks) for c in chunks], dtype=torch.long)
    pos = torch.arange(max_len)
    kv_slots = tables[:, pos // block_size] * block_size + pos % block_size
    max_q = max(c.num_tokens for c in chunks)
    q_offsets = torch.arange(max_q)
    counts = torch.tensor([c.num_tokens for c in chunks])
    starts = torch.tensor([c.start_position for c in chunks])
    q_valid = q_offsets[None, :] < counts[:, None]
    q_pos = torch.where(q_valid, starts[:, None] + q_offsets[None, :], 0)  # padded rows see position 0 only
    mask = (pos[None, None, :] <= q_pos[:, :, None]).unsqueeze(1)
    token_end = token_start + int(counts.sum())
    q_index = None
    if not single_query:
        first = torch.cumsum(counts, 0) - counts
        q_index = torch.where(q_valid, first[:, None] + q_offsets[None, :], 0).to(device)
        q_valid = q_valid.to(device)
    return AttentionGroup(token_start, token_end, q_index, None if single_query else q_valid,
                          kv_slots.to(device), mask.to(device))


def _padded(block_ids: Sequence[int], length: int) -> list[int]:
    ids = list(block_ids[:length])
    return ids + [0] * (length - len(ids))


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D], each token attending to its sequence's cached positions."""
    outputs = []
    for g in meta.groups:
        q_group = q[g.token_start:g.token_end]
        q_batch = q_group.unsqueeze(1) if g.q_index is None else q_group[g.q_index]
        k_batch = k_cache[g.kv_slots].transpose(1, 2)
        v_batch = v_cache[g.kv_slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(q_batch.transpose(1, 2), k_batch, v_batch,
                                             attn_mask=g.mask, scale=scale, enable_gqa=True)
        out = out.transpose(1, 2)  # [B, Lq, Hq, D]
        outputs.append(out.squeeze(1) if g.q_index is None else out[g.q_valid])
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
