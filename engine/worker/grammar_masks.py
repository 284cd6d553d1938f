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
        # Imported on first use: llguidance.torch scripts a kernel with torch.jit when imported
        # (about a second), which every worker process would otherwise pay at start-up.
        from llguidance.torch import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask

        bitmask = allocate_token_bitmask(len(matchers), self._vocab_size)  # all allowed
        for row, matcher in enumerate(matchers):
            if matcher is not None:
                fill_next_token_bitmask(matcher, bitmask, row)
        apply_token_bitmask_inplace(logits, bitmask.to(logits.device))

    @staticmethod
    def accept(matcher: llguidance.LLMatcher, token: int) -> None:
        """Advance past a sampled token (a no-op once the grammar has stopped)."""
        if not matcher.is_stopped():
            matcher.consume_token(token)
