"""Structured outputs in the worker: one llguidance matcher per constrained request, and one
token bitmask for the whole batch each step, applied to the logits before sampling.

The matcher advances on every token the request accepts; once the grammar is complete it allows
only EOS, so the request stops there. Built on first use (the tokenizer conversion costs a few
milliseconds); only the driver rank, which samples, keeps matchers.

The output budget: a constrained answer cut by `max_tokens` does not parse. In its last
`STEER_WINDOW` tokens, each step a request plans the shortest way it knows to finish from where
it is (`closing_plan`: the grammar's forced tokens, else the first allowed of a few closing
tokens: quotes, brackets, `0`, `false`, ..., on a copy of its matcher), and once that plan plus
EOS comes within `STEER_MARGIN` tokens of what the budget leaves, the request is steered along
it: its answer is complete before its budget ends. The plan is a valid completion, not always
the shortest one; the answer ends `length` only when no plan of that many tokens was found (or
the budget was too small from the start, or one token lengthened the ending by more than the
margin).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import llguidance
import torch

from engine.render.grammar import make_tokenizer

STEER_WINDOW = 48  # tokens before the budget ends from which a constrained request plans its ending
# Steering starts while the plan still has this many tokens to spare: one sampled token can make
# the ending longer (a multi-byte character begun byte by byte, a comma that opens another member),
# and once the plan no longer fits it is too late.
STEER_MARGIN = 8
# What a plan tries, in order, where the grammar forces nothing: closing a string or a container
# first (several at once where one token does), then the separators that move on to the next
# required member (before any value: a digit would only lengthen a number), then the shortest values.
# A literal's first letter where the tokenizer has no token for all of it (the grammar forces the
# rest); past these, the first token the grammar allows.
CLOSERS = ('"}}', '"}', '"]', '}}', ']}', '}]', '"', '}', ']', ",", ":", "0", "false", "null", "{", "[", "f", "n",
           "t", "a", "1")


@dataclass
class Budget:
    """A constrained request's output budget: its max_tokens, the EOS it ends with, the tokens it
    may still sample at this step (this one included), and the ending it is being steered along."""

    max_tokens: int
    eos_token_id: int | None
    remaining: int = 0
    plan: list[int] | None = None  # once steering starts: the tokens still to force, then EOS
    check_at: int = 0  # plan again once `remaining` is down to this (0: from STEER_WINDOW on)


class GrammarMasks:
    def __init__(self, tokenizer_dir: str, vocab_size: int) -> None:
        self._tokenizer_file = Path(tokenizer_dir) / "tokenizer.json"
        self._vocab_size = vocab_size
        self._tokenizers: dict[int | None, llguidance.LLTokenizer] = {}  # by the EOS the grammar ends with
        self._closers: list[int] = []  # single-token CLOSERS, in order
        self._words = (vocab_size + 31) // 32
        # A plan's masks, read word by word from Python (a tensor's per-element access costs ~1 us).
        self._scratch = (ctypes.c_uint32 * self._words)()

    def matcher(self, grammar: str, eos_token_id: int | None) -> llguidance.LLMatcher:
        """A matcher at the start of a compiled grammar, ending with `eos_token_id` (the first EOS
        the request stops on); `ValueError` if llguidance refuses it."""
        tokenizer = self._tokenizers.get(eos_token_id)
        if tokenizer is None:
            tokenizer = make_tokenizer(self._tokenizer_file.read_text(), self._vocab_size, eos_token_id)
            self._tokenizers[eos_token_id] = tokenizer
            if not self._closers:
                pieces = (tokenizer.tokenize_str(text) for text in CLOSERS)
                self._closers = list(dict.fromkeys(ids[0] for ids in pieces if len(ids) == 1))
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(f"grammar error: {matcher.get_error()}")
        return matcher

    def apply(self, logits: torch.Tensor, matchers: list[llguidance.LLMatcher | None],
              budgets: list[Budget | None] | None = None) -> None:
        """Mask, in place, every row whose request has a matcher to the tokens its grammar allows;
        a row whose budget is about to run out, to the next token of its ending (module doc)."""
        if not any(m is not None for m in matchers):
            return
        # As llguidance.torch's helpers do, without importing it: it scripts a torch.jit kernel at
        # import (about a second in every worker process) that we do not use.
        words = self._words
        bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32)  # all allowed
        for row, matcher in enumerate(matchers):
            if matcher is None:
                continue
            budget = budgets[row] if budgets is not None else None
            forced = self._steer(matcher, budget) if budget is not None else None
            if forced is None:
                matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), words * 4)
            else:
                bitmask[row] = 0
                bitmask[row, forced >> 5] = _bit(forced & 31)
        apply_bitmask(logits, bitmask)

    def _steer(self, matcher: llguidance.LLMatcher, budget: Budget) -> int | None:
        """The token to force this step, if the request must start or go on with its ending now."""
        check_at = budget.check_at or STEER_WINDOW
        if budget.plan is None and budget.remaining <= check_at and not matcher.is_stopped():
            plan = self.closing_plan(matcher, budget.remaining)
            if plan is not None and len(plan) + 1 + STEER_MARGIN >= budget.remaining:
                budget.plan = plan
            # Far from needing it: plan again when a margin's growth of the ending could make it
            # needed (planning costs ~0.1 ms a request; every step of the window would cost ~20%).
            budget.check_at = budget.remaining - 1 if plan is None else len(plan) + 1 + 2 * STEER_MARGIN
        if budget.plan is None:
            return None
        if budget.plan:
            return budget.plan.pop(0)
        return budget.eos_token_id

    def closing_plan(self, matcher: llguidance.LLMatcher, limit: int) -> list[int] | None:
        """Tokens that complete the grammar from `matcher`'s state (EOS not included), fewer than
        `limit`; None if none was found. The matcher itself does not move."""
        trial, plan = matcher.deep_copy(), list[int]()
        while len(plan) < limit:
            if trial.is_accepting():
                return plan
            step = trial.compute_ff_tokens() or self._first_closer(trial)
            if not step or not trial.consume_tokens(step) or trial.is_error():
                return None
            plan += step
        return None

    def _first_closer(self, matcher: llguidance.LLMatcher) -> list[int]:
        mask = self._scratch
        matcher.unsafe_compute_mask_ptr(ctypes.addressof(mask), self._words * 4)
        for token in self._closers:
            if mask[token >> 5] >> (token & 31) & 1:
                return [token]
        for word, bits in enumerate(mask):  # none of them: the first token allowed
            if bits:
                return [word * 32 + (bits & -bits).bit_length() - 1]
        return []

    @staticmethod
    def accept(matcher: llguidance.LLMatcher, token: int) -> None:
        """Advance past a sampled token (a no-op once the grammar has stopped)."""
        if not matcher.is_stopped():
            matcher.consume_token(token)


_BITS = torch.arange(32, dtype=torch.int32)


def _bit(position: int) -> int:
    """Bit `position` of an int32 word, as a Python int the word can hold (bit 31 is negative)."""
    return -(1 << 31) if position == 31 else 1 << position


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, the logits whose bit is 0 in `bitmask` ([B, ceil(V / 32)] int32, bit
    j of word w is token 32 w + j). llguidance's own `apply_token_bitmask_inplace` is a torch.jit
    kernel that took 30 ms a step for a batch of 16 on CPU; this takes tens of microseconds."""
    vocab = logits.shape[-1]
    bits = (bitmask.to(logits.device).unsqueeze(-1) >> _BITS.to(logits.device)) & 1
    allowed = bits.flatten(-2)[..., :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))
