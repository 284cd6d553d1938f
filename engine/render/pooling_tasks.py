"""Which pooling tasks an engine serves: the model's capabilities, narrowed by `--runner` and
`--pooler-config`'s task (vLLM's rules). Plain functions of the config and the model's facts,
checked once at start-up and again for every pooling request."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.model_info import ModelInfo


def capable_pooling_tasks(info: ModelInfo) -> tuple[str, ...]:
    """The pooling tasks the model could serve with some --pooler-config task."""
    if info.pooler.late_interaction:
        return ("token_embed",)
    return ("classify", "embed", "token_embed") if info.num_labels else ("embed", "token_embed")


def served_pooling_tasks(config: EngineConfig, info: ModelInfo) -> tuple[str, ...]:
    """--pooler-config's task (embed brings token_embed), else the model's own (classify for a
    classification head, embed and token_embed otherwise); none under --runner generate.
    `ValueError` for a runner or task the model cannot serve."""
    if config.runner == "generate":
        if info.kind == "encoder":
            raise ValueError(f"--runner generate: this model ({info.architecture}) is a pooling model and cannot "
                             "generate")
        return ()
    capable, task = capable_pooling_tasks(info), config.pooler_config.task
    if task is None:
        return ("classify",) if "classify" in capable else capable
    if task not in capable:
        raise ValueError(f"--pooler-config task {task!r}: this model ({info.architecture}) can serve "
                         f"{', '.join(capable)}")
    return ("classify",) if task == "classify" else tuple(t for t in capable if t != "classify")
