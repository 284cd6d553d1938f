"""A model's tokenizer: `tokenizer.json` through the `tokenizers` library, with the
special tokens and chat template from `tokenizer_config.json` and the EOS ids
from `generation_config.json`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from engine.errors import ModelLoadError
from engine.models.hf_config import read_json_file, require_model_dir

# Texts this long are encoded without the GIL (see Tokenizer._encode); shorter ones are cheaper
# through `encode`, which skips the library's thread pool.
GIL_FREE_CHARS = 4096


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = require_model_dir(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{path} is missing: the engine needs a `tokenizers` tokenizer.json")
        self.backend = HFTokenizer.from_file(str(path))
        # Some tokenizer.json files pad or truncate every encoding (all-MiniLM-L6-v2 pads to 128);
        # the engine wants the text's own tokens and decides about length itself.
        self.backend.no_padding()
        self.backend.no_truncation()
        cfg = read_json_file(model_dir / "tokenizer_config.json")
        gen = read_json_file(model_dir / "generation_config.json")
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.pad_token = _token_text(cfg.get("pad_token"))
        # transformers 5 (and llava-hf checkpoints) keep the template beside the tokenizer config
        template_file = model_dir / "chat_template.jinja"
        self.chat_template: str | None = cfg.get("chat_template") or (
            template_file.read_text() if template_file.is_file() else None)
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        self.bos_token_id = self.token_to_id(self.bos_token)
        self.eos_token_ids = self._eos_ids(gen)
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)

    def _eos_ids(self, generation_config: dict[str, Any]) -> tuple[int, ...]:
        ids: list[int] = []
        gen_eos = generation_config.get("eos_token_id")
        if gen_eos is not None:
            ids.extend(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        own = self.token_to_id(self.eos_token)
        if own is not None and own not in ids:
            ids.append(own)
        return tuple(int(i) for i in ids)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._encode(text, add_special_tokens).ids
        if (add_special_tokens and self.add_bos_token and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids = [self.bos_token_id] + ids
        return ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Many texts in one call (the tokenizers library parallelizes it without the GIL); a few
        texts one by one, which skips starting its thread pool."""
        if self.add_bos_token or len(texts) < 8:
            return [self.encode(t, add_special_tokens) for t in texts]
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def _encode(self, text: str, add_special_tokens: bool) -> Any:
        """The tokenizers library's encoding of `text`. Its `encode` holds the GIL for the whole call
        (a 15 MiB text: 13 s in which the event loop's thread could not run), its `encode_batch`
        releases it: long texts, which are tokenized in worker threads, go through the latter."""
        if len(text) < GIL_FREE_CHARS:
            return self.backend.encode(text, add_special_tokens=add_special_tokens)
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def encode_truncated(self, text: str, max_tokens: int) -> list[int]:
        """Token ids with special tokens, the text cut from the right so that all fit `max_tokens`."""
        encoding = self._encode(text, False)
        encoding.truncate(max(0, max_tokens - self.backend.num_special_tokens_to_add(False)))
        return self.backend.post_process(encoding).ids[:max_tokens]

    def encode_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        """A sentence pair as one sequence (e.g. `[CLS] a [SEP] b [SEP]`) and its segment ids."""
        encoding = self.backend.encode(first, second, add_special_tokens=True)
        return encoding.ids, encoding.type_ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)
