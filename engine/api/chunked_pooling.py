"""Embedding inputs longer than one step, in chunks (vLLM's `enable_chunked_processing`).

Each over-long input is cut into chunks of at most the engine's pooling limit (the context, or
the step's token budget if smaller); every chunk is pooled raw (no normalization, every
dimension) as a request of its own, batched with the rest; the chunks' vectors are combined as
their token-weighted mean, then cut and normalized as the request asked. For MEAN pooling this
is the mean over every token of the input, exactly; for CLS and LAST pooling it is the mean of
the chunks' vectors (vLLM's behaviour too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.errors import InvalidRequestError
from engine.outputs import PoolingRequestOutput
from engine.render.renderer import EngineInput


@dataclass
class ChunkPlan:
    chunks: list[EngineInput]  # every input's chunks, in input order
    owners: list[int]  # the input each chunk belongs to

    @classmethod
    def of(cls, rendered: list[EngineInput], chunk_size: int, max_embed_len: int | None) -> ChunkPlan:
        """Inputs longer than `chunk_size` cut into chunks; inputs of prompt embeddings or token types
        (sentence pairs) are left whole (the limit refuses them as before). An input over
        `max_embed_len` tokens is refused."""
        chunks: list[EngineInput] = []
        owners: list[int] = []
        for index, item in enumerate(rendered):
            length = len(item.token_ids)
            if max_embed_len is not None and length > max_embed_len:
                raise InvalidRequestError(f"This model's maximum embedding input length (max_embed_len) is "
                                          f"{max_embed_len} tokens. However, your request has {length} input "
                                          "tokens. Please reduce the length of the input.", param="input")
            if length <= chunk_size or item.embeds is not None or item.token_type_ids is not None:
                chunks.append(item)
                owners.append(index)
                continue
            for start in range(0, length, chunk_size):
                chunks.append(EngineInput(None, item.token_ids[start:start + chunk_size], cache_salt=item.cache_salt))
                owners.append(index)
        return cls(chunks, owners)

    def combine(self, outputs: list[PoolingRequestOutput], rendered: list[EngineInput],
                finish: Callable[[torch.Tensor], torch.Tensor]) -> list[PoolingRequestOutput]:
        """One output per input: its chunks' token-weighted mean vector, finished by `finish`."""
        sums: dict[int, torch.Tensor] = {}
        for owner, chunk, output in zip(self.owners, self.chunks, outputs, strict=True):
            weighted = output.data.float() * len(chunk.token_ids)
            sums[owner] = sums[owner] + weighted if owner in sums else weighted
        results = []
        for index, item in enumerate(rendered):
            first = outputs[self.owners.index(index)]
            vector = sums[index] / len(item.token_ids)
            results.append(PoolingRequestOutput(first.request_id, list(item.token_ids), finish(vector),
                                                metrics=dict(first.metrics)))
        return results
