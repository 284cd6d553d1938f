"""The engine's public surface: what applications and the HTTP layer use.

Everything here is stable API; the layers below (`engine.core`, `engine.sched`,
`engine.worker`, ...) are the engine's own. `web/` imports the engine only
through this package, the toolkit `engine.concurrency`, and the plain-data
modules at the root of `engine` (the layering test checks it).

This is the one table of public names: `engine/__init__.py` hands every name on to it, so
`from engine import open_engine` and `from engine.api import open_engine` are the same object.
Names are imported on first use (PEP 562), as vLLM's package does: `from engine.api import
engine_process_started` or `TinyModelSpec` costs no torch import, so `trio-llm serve` can start its
engine process before the server imports torch (web/cli.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.api.async_engine import AsyncEngine
    from engine.api.llm import LLM
    from engine.api.open import open_engine, open_engine_process
    from engine.beam_search_params import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from engine.config import EngineConfig, LoRAModule
    from engine.core.data_parallel import data_parallel_configs
    from engine.core.engine_spawn import SpawnedEngine, engine_process_started
    from engine.core.gc_tuning import tune_collector_for_serving
    from engine.core.stats import EngineStats, RequestRecord, StatsObserver
    from engine.errors import EngineDeadError, InvalidRequestError, LoRAError, ModelLoadError, RequestFailedError
    from engine.executor.base import Executor
    from engine.lora_request import LoRARequest
    from engine.model_info import ModelInfo, PoolerConfig
    from engine.models.tiny import ARCHITECTURES, SHAPES, TinyModelSpec, ensure_default_model, make_model, shaped_spec
    from engine.outputs import CompletionOutput, Logprob, PoolingRequestOutput, PositionLogprobs, RequestOutput
    from engine.pooling_params import PoolingParams
    from engine.render.renderer import EngineInput
    from engine.render.tokenizer import Tokenizer
    from engine.sampling_params import RequestOutputKind, SamplingParams

_WHERE = {
    "ARCHITECTURES": "engine.models.tiny",
    "SHAPES": "engine.models.tiny",
    "shaped_spec": "engine.models.tiny",
    "AsyncEngine": "engine.api.async_engine",
    "BeamSearchOutput": "engine.beam_search_params",
    "BeamSearchParams": "engine.beam_search_params",
    "BeamSearchSequence": "engine.beam_search_params",
    "CompletionOutput": "engine.outputs",
    "EngineConfig": "engine.config",
    "EngineDeadError": "engine.errors",
    "EngineInput": "engine.render.renderer",
    "EngineStats": "engine.core.stats",
    "ensure_default_model": "engine.models.tiny",
    "Executor": "engine.executor.base",
    "InvalidRequestError": "engine.errors",
    "LLM": "engine.api.llm",
    "LoRARequest": "engine.lora_request",
    "LoRAError": "engine.errors",
    "LoRAModule": "engine.config",
    "Logprob": "engine.outputs",
    "make_model": "engine.models.tiny",
    "ModelInfo": "engine.model_info",
    "ModelLoadError": "engine.errors",
    "open_engine": "engine.api.open",
    "open_engine_process": "engine.api.open",
    "engine_process_started": "engine.core.engine_spawn",
    "data_parallel_configs": "engine.core.data_parallel",
    "SpawnedEngine": "engine.core.engine_spawn",
    "tune_collector_for_serving": "engine.core.gc_tuning",
    "PoolerConfig": "engine.model_info",
    "PoolingParams": "engine.pooling_params",
    "PoolingRequestOutput": "engine.outputs",
    "PositionLogprobs": "engine.outputs",
    "RequestFailedError": "engine.errors",
    "RequestOutput": "engine.outputs",
    "RequestOutputKind": "engine.sampling_params",
    "RequestRecord": "engine.core.stats",
    "SamplingParams": "engine.sampling_params",
    "StatsObserver": "engine.core.stats",
    "TinyModelSpec": "engine.models.tiny",
    "Tokenizer": "engine.render.tokenizer",
}

__all__ = [
    "ARCHITECTURES", "LLM", "SHAPES", "LoRAError", "LoRAModule", "LoRARequest",
    "AsyncEngine", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "CompletionOutput",
    "EngineConfig", "EngineDeadError",
    "EngineInput", "EngineStats", "Executor", "InvalidRequestError", "Logprob", "ModelInfo", "ModelLoadError",
    "PoolerConfig", "PoolingParams", "PoolingRequestOutput", "PositionLogprobs", "RequestFailedError",
    "RequestOutput", "RequestOutputKind", "RequestRecord", "SamplingParams", "SpawnedEngine", "StatsObserver",
    "TinyModelSpec", "Tokenizer", "data_parallel_configs", "engine_process_started", "ensure_default_model",
    "make_model", "open_engine",
    "open_engine_process", "shaped_spec", "tune_collector_for_serving",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # once: later lookups do not come here
    return value
