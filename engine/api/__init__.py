"""The engine's public surface: what applications and the HTTP layer use.

Everything here is stable API; the layers below (`engine.core`, `engine.sched`,
`engine.worker`, ...) are the engine's own. `web/` imports the engine only
through this package, the toolkit `engine.concurrency`, and the plain-data
modules at the root of `engine` (the layering test checks it).
"""

from engine.api.async_engine import AsyncEngine
from engine.api.engine_client import open_engine_process
from engine.api.llm import LLM
from engine.api.open import open_engine
from engine.config import EngineConfig
from engine.core.stats import EngineStats, RequestRecord, StatsObserver
from engine.errors import EngineDeadError, InvalidRequestError, ModelLoadError, RequestFailedError
from engine.executor.base import Executor
from engine.model_info import ModelInfo, PoolerConfig
from engine.models.tiny import ARCHITECTURES, TinyModelSpec, ensure_default_model, make_model
from engine.outputs import CompletionOutput, Logprob, PoolingRequestOutput, PositionLogprobs, RequestOutput
from engine.pooling_params import PoolingParams
from engine.render.renderer import EngineInput
from engine.render.tokenizer import Tokenizer
from engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "ARCHITECTURES", "LLM", "AsyncEngine", "CompletionOutput", "EngineConfig", "EngineDeadError", "EngineInput",
    "EngineStats",
    "Executor", "InvalidRequestError", "Logprob", "ModelInfo", "ModelLoadError", "PoolerConfig",
    "PoolingParams", "PoolingRequestOutput", "PositionLogprobs", "RequestFailedError", "RequestOutput", "RequestRecord",
    "RequestOutputKind",
    "SamplingParams", "StatsObserver", "Tokenizer", "TinyModelSpec", "ensure_default_model", "make_model",
    "open_engine", "open_engine_process",
]
