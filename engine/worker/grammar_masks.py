"""Structured outputs in the worker: one llguidance matcher per constrained request, and one
token bitmask for the whole batch each step, applied to the logits before sampling.

The matcher advances on every token the request accepts; once the grammar is complete it allows
only EOS, so the request stops there. Built on first use (the tokenizer conversion costs a few
milliseconds); only the driver rank, which samples, keeps matchers.
"""

from __future__ import annotations

from pathlib import Path

import llguidance
import torch

from engine.render.grammar import make_tokenizer


class GrammarMasks:
    def __init__(self, tokenizer_dir: str, vocab_size: int) -> None:
        self._tokenizer_file = Path(tokenizer_dir) / "tokenizer.json"
        self._vocab_size = vocab_size
        self._tokenizers: dict[int | None, llguidance.LLTokenizer] = {}  # by the EOS the grammar ends with

    def matcher(self, grammar: str, eos_token_id: int | None) -> llguidance.LLMatcher:
        """A matcher at the start of a compiled grammar, ending with `eos_token_id` (the first EOS
        the request stops on); `ValueError` if llguidance refuses it."""
        tokenizer = self._tokenizers.get(eos_token_id)
        if tokenizer is None:
            tokenizer = make_tokenizer(self._tokenizer_file.read_text(), self._vocab_size, eos_token_id)
            self._tokenizers[eos_token_id] = tokenizer
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(f"grammar error: {matcher.get_error()}")
        return matcher

    def apply(self, logits: torch.Tensor, matchers: list[llguidance.LLMatcher | None]) -> None:
        """Mask, in place, every row whose request has a matcher to the tokens its grammar allows."""
        if not any(m is not None for m in matchers):
            return
        # As llguidance.torch's helpers do, without importing it: it scripts a torch.jit kernel at
        # import (about a second in every worker process) that we do not use.
        words = (self._vocab_size + 31) // 32
        bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32)  # all allowed
        for row, matcher in enumerate(matchers):
            if matcher is not None:
                matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), words * 4)
        apply_bitmask(logits, bitmask)

    @staticmethod
    def accept(matcher: llguidance.LLMatcher, token: int) -> None:
        """Advance past a sampled token (a no-op once the grammar has stopped)."""
        if not matcher.is_stopped():
            matcher.consume_token(token)


_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, the logits whose bit is 0 in `bitmask` ([B, ceil(V / 32)] int32, bit
    j of word w is token 32 w + j). llguidance's own `apply_token_bitmask_inplace` is a torch.jit
    kernel that took 30 ms a step for a batch of 16 on CPU; this takes tens of microseconds."""
    vocab = logits.shape[-1]
    bits = (bitmask.to(logits.device).unsqueeze(-1) >> _BITS.to(logits.device)) & 1
    allowed = bits.flatten(-2)[..., :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))
