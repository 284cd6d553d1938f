"""What a pooling request asks for: the task, normalization and output size.

Plain data, validated at construction (`InvalidRequestError` naming the field),
sent to the worker with the request.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequestError

TASKS = ("embed", "token_embed", "classify")


@dataclass(frozen=True)
class PoolingParams:
    """`embed`: one vector per input (pooled as the model's pooling config says);
    `token_embed`: one vector per token; `classify`: the classification head's logits.

    `normalize`: L2-normalize the vectors (default: as the model's config says).
    `dimensions`: keep the first N dimensions, then renormalize (Matryoshka models only;
    the engine checks the model supports it)."""

    task: str = "embed"
    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise InvalidRequestError(f"task must be one of {TASKS}, got {self.task!r}", param="task")
        if self.dimensions is not None and self.dimensions < 1:
            raise InvalidRequestError(f"dimensions must be at least 1, got {self.dimensions}", param="dimensions")
