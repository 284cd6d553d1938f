"""What one server holds: its settings, metrics, limiter, and the engine once it runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import anyio

from engine.api import AsyncEngine, EngineConfig, Executor, SpawnedEngine
from engine.lora_request import LoRARequest
from web.http.bodies import check_model
from web.http.errors import APIError
from web.http.metrics import ServerMetrics
from web.http.settings import ServerSettings
from web.http.sse import StreamStopper


@dataclass
class ServerState:
    engine_config: EngineConfig
    settings: ServerSettings
    executor: Executor | None = None  # tests inject a fake; None: the configured executor
    # An engine process `trio-llm serve` started before importing the server, for run_engine to adopt.
    spawned_engine: SpawnedEngine | None = None
    engine: AsyncEngine | None = None
    engine_error: BaseException | None = None
    # Called once if the engine dies while serving (serve() uses it to shut the server down).
    on_engine_failure: Callable[[], None] | None = None
    streams: StreamStopper = field(default_factory=StreamStopper)  # ends open streams at shutdown
    metrics: ServerMetrics = field(init=False)
    limiter: anyio.CapacityLimiter = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.model_name, log_requests=self.settings.log_requests)
        self.limiter = anyio.CapacityLimiter(self.settings.http_workers)

    @property
    def model_name(self) -> str:
        return self.settings.served_model_name or self.engine_config.served_model_name or self.engine_config.model

    @property
    def base_model_names(self) -> set[str]:
        """The names a request may give the base model by: the served name and the model path."""
        return {self.model_name, self.engine_config.model}

    @property
    def accepted_model_names(self) -> set[str]:
        return {*self.base_model_names, *self.lora_names}

    @property
    def lora_names(self) -> list[str]:
        """The LoRA adapters served now (configured, and loaded at run time)."""
        return self.engine.loras.names() if self.engine is not None else []

    def lora_request(self, requested: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); a 404 if it names neither
        (an adapter unloaded since the request was read)."""
        if requested is None or requested in self.base_model_names:
            return None
        lora = self.engine.loras.get(requested) if self.engine is not None else None
        if lora is None:
            check_model(requested, self.accepted_model_names)
        return lora

    def response_model(self, requested: str | None) -> str:
        """The `model` a response names: the adapter asked for, else the served model."""
        return requested if requested is not None and requested in self.lora_names else self.model_name

    @property
    def engine_alive(self) -> bool:
        return self.engine is not None and self.engine.is_running

    def engine_for_request(self) -> AsyncEngine:
        """The engine, if it runs and its queue has room; otherwise the 503 to answer."""
        if not self.engine_alive:
            raise APIError(503, "the engine is not running", code="engine_dead")
        assert self.engine is not None
        bound = self.settings.max_queued_requests
        if bound is not None and self.engine.stats().num_waiting >= bound:
            raise APIError(503, f"the server is at capacity ({bound} requests are waiting); retry shortly",
                           code="queue_full", headers={"Retry-After": "1"})
        return self.engine
