"""Incremental detokenization with stop strings.

Tokens arrive one step at a time. `tokenizers`' `DecodeStream` turns each into
the text it completes, holding back bytes of an unfinished UTF-8 character, so
a consumer never sees half a character. Stop strings are searched for in the
new text plus the tail that could start one; text that might still become
the start of a stop string is held back from the stream until it cannot.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from engine.render.tokenizer import Tokenizer
from engine.sampling_params import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self._stop = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        self._min_tokens = params.min_tokens  # as vLLM: no stop string ends a text this short
        self._num_tokens = 0
        self.text = ""
        self._released = 0

    def add_tokens(self, token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append tokens; returns the stop string that ended the text, if one did. `stop_terminated`:
        the last token is the EOS or stop token that ended the sequence; as in vLLM its text is left
        out (unless `include_stop_str_in_output`), which matters once special tokens are kept."""
        rendered = token_ids[:-1] if stop_terminated and not self._include_stop else token_ids
        for token_id in rendered:
            piece = self._step(token_id)
            self._num_tokens += 1
            if not piece:
                continue
            searched_from = max(0, len(self.text) - self._longest_stop + 1)
            self.text += piece
            if self._num_tokens <= self._min_tokens:
                continue  # stop strings count only after min_tokens tokens (vLLM's rule)
            stop = self._find_stop(searched_from)
            if stop is not None:
                return stop
        return None

    @property
    def num_tokens(self) -> int:
        """Tokens rendered so far (the one that completed a stop string the last)."""
        return self._num_tokens

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._tokenizer.backend, token_id)
        except Exception:  # an id the tokenizer does not know (model vocab padded past it)
            return None

    def _find_stop(self, searched_from: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self._stop:
            at = self.text.find(stop, searched_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[:at + len(stop)] if self._include_stop else self.text[:at]
        return stop

    def take_new_text(self, finished: bool) -> str:
        """Text not yet handed out that can no longer turn into a stop string."""
        end = len(self.text)
        if not finished and self._stop and not self._include_stop:
            end = max(self._released, end - self._longest_stop + 1)
        new = self.text[self._released:end]
        self._released = end
        return new

    @property
    def released_text(self) -> str:
        return self.text[:self._released]
