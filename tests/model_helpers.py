"""Running a decoder over one sequence in a fresh paged cache (64 slots), for logit comparisons."""

from __future__ import annotations

import torch

from engine.models.attention import SequenceChunk, build_metadata


def decoder_logits(decoder, hidden: torch.Tensor) -> torch.Tensor:
    """Logits [T, V] of `decoder` for input embeddings `hidden` [T, H] at positions 0..T-1."""
    c, length = decoder.config, hidden.shape[0]
    kv = [(torch.zeros(64, c.num_kv_heads, c.head_dim), torch.zeros(64, c.num_kv_heads, c.head_dim))
          for _ in range(c.num_layers)]
    meta = build_metadata([SequenceChunk(0, length, list(range(4)))], 16, torch.device("cpu"))
    with torch.no_grad():
        return decoder.compute_logits(decoder(hidden, torch.arange(length), kv, meta))
