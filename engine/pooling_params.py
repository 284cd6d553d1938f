"""What a pooling request asks for: the task, normalization and output size.

Plain data, validated at construction (`InvalidRequestError` naming the field),
sent to the worker with the request.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequestError

TASKS = ("embed", "token_embed", "classify")  # what the engine can pool; a model serves some (check_pooling)


@dataclass(frozen=True)
class PoolingParams:
    """`embed`: one vector per input (pooled as the model's pooling config says);
    `token_embed`: one vector per token; `classify`: the classification head's logits.

    `normalize`: L2-normalize the vectors (default: as the model's config says).
    `use_activation` (vLLM's newer name): for embed and token_embed, `normalize`; for classify,
    whether the server turns logits into probabilities (the engine returns logits either way).
    `dimensions`: keep the first N dimensions, then renormalize (Matryoshka models only;
    the engine checks the model supports it). A task the model does not serve is refused
    when the request is submitted ("Unsupported task: ...")."""

    task: str = "embed"
    normalize: bool | None = None
    dimensions: int | None = None
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.task, str):
            raise InvalidRequestError(f"task must be a string, got {self.task!r}", param="task")
        if self.use_activation is not None and self.task != "classify":
            if self.normalize is not None and self.normalize != self.use_activation:
                raise InvalidRequestError("normalize and use_activation disagree; give one", param="use_activation")
            object.__setattr__(self, "normalize", self.use_activation)
        if self.dimensions is not None and self.dimensions < 1:
            raise InvalidRequestError(f"dimensions must be at least 1, got {self.dimensions}", param="dimensions")
