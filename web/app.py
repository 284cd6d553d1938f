"""The Quart-Trio app: the engine opens in the app's lifespan, inside the app nursery.

    app = create_app(EngineConfig(model=...), ServerSettings(api_key=...))

`app_from_env()` is the factory for `hypercorn -k trio 'web.app:app_from_env()'`.
"""

from __future__ import annotations

import gc
import hmac
import logging
import os

import anyio
import trio
from anyio.abc import TaskStatus
from quart import request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from engine.api.async_engine import open_engine
from engine.concurrency.loop_lag import run_loop_lag_probe
from engine.config import EngineConfig
from engine.errors import EngineDeadError, InvalidRequestError
from engine.executor.base import Executor
from web import admin_api, openai_api, pooling_api
from web.errors import APIError
from web.settings import ServerSettings
from web.state import ServerState

logger = logging.getLogger(__name__)


# Collector thresholds for a serving process (Python's defaults: 700, 10, 10).
SERVER_GC_THRESHOLDS = (20_000, 50, 100)


def create_app(engine_config: EngineConfig, settings: ServerSettings | None = None, *,
               executor: Executor | None = None) -> QuartTrio:
    state = ServerState(engine_config, settings or ServerSettings(), executor)
    app = QuartTrio(__name__)
    app.config.update(
        MAX_CONTENT_LENGTH=state.settings.body_limit(),  # raised for prompt embeddings once the engine is up
        RESPONSE_TIMEOUT=None,  # generations stream for as long as they take
        BODY_TIMEOUT=60,
        # hypercorn has already let in-flight requests finish (the grace period) when this runs.
        BACKGROUND_TASK_SHUTDOWN_TIMEOUT=None,
    )
    app.extensions["trio_llm"] = state

    @app.before_serving
    async def start_engine() -> None:
        await app.nursery.start(_run_engine, state)
        embeds_limits = state.engine.renderer.embeds_limits
        app.config["MAX_CONTENT_LENGTH"] = state.settings.body_limit(
            embeds_limits.max_payload_bytes if embeds_limits else None)
        # Everything alive now (modules, the model, the tokenizer) lives as long as the server: move it
        # out of the collector's sight. Measured (docs/decisions.md): full collections walking it paused
        # the loop for up to 134 ms under load; after the freeze the loop-lag p99 fell from <= 250 ms
        # to <= 25 ms and /v1/embeddings gained ~12%.
        gc.freeze()
        # Requests' objects are freed by reference counting; the cyclic collector, run every 700 net
        # allocations, mostly walks the live objects of requests in flight. Measured (docs/decisions.md):
        # ~110 us of collection per /v1/embeddings request by default; with these thresholds almost none.
        gc.set_threshold(*SERVER_GC_THRESHOLDS)
        app.nursery.start_soon(run_loop_lag_probe, state.metrics.observe_loop_lag, state.settings.loop_lag_interval)

    @app.before_request
    async def authenticate() -> None:
        _check_api_key(state.settings.api_key)

    _register_error_handlers(app)
    openai_api.register(app, state)
    pooling_api.register(app, state)
    admin_api.register(app, state)
    return app


async def _run_engine(state: ServerState, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Hold the engine open for the app's lifetime. A start-up failure fails the server start;
    a failure while serving is recorded, and the server answers 503 from then on."""
    started = False
    try:
        async with open_engine(state.engine_config, executor=state.executor, observer=state.metrics) as engine:
            state.engine = engine
            scheduler = engine.core.scheduler
            state.metrics.bind(running=lambda: scheduler.num_running, waiting=lambda: engine.core.num_waiting_requests,
                               kv_usage=lambda: scheduler.kv.usage)
            task_status.started()
            started = True
            await trio.sleep_forever()
    except* Exception as group:
        if not started:
            raise
        state.engine_error = group
        logger.error("the engine failed; the server now answers 503", exc_info=group)


def _check_api_key(api_key: str | None) -> None:
    if api_key is None or not request.path.startswith("/v1"):
        return
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    # Constant-time: the comparison takes as long whatever prefix of the key is right.
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), api_key.encode()):
        raise APIError(401, "invalid or missing API key; send 'Authorization: Bearer <key>'", code="invalid_api_key")


def _register_error_handlers(app: QuartTrio) -> None:
    @app.errorhandler(APIError)
    async def api_error(error: APIError):
        return error.response()

    @app.errorhandler(InvalidRequestError)
    async def invalid(error: InvalidRequestError):
        return APIError(400, str(error), param=error.param).response()

    @app.errorhandler(EngineDeadError)
    async def dead(error: EngineDeadError):
        return APIError(503, str(error), code="engine_dead").response()

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException):
        status = error.code or 500
        messages = {404: f"no route for {request.method} {request.path}",
                    405: f"method {request.method} is not allowed for {request.path}",
                    413: f"the request body exceeds the limit of {app.config['MAX_CONTENT_LENGTH']} bytes"}
        return APIError(status, messages.get(status, error.description or error.name)).response()


def app_from_env() -> QuartTrio:
    """App factory for `hypercorn -k trio 'web.app:app_from_env()'`.

    Reads TRIO_LLM_MODEL (default: the embedded model), TRIO_LLM_API_KEY,
    TRIO_LLM_SERVED_MODEL_NAME and TRIO_LLM_MAX_NUM_SEQS.
    """
    from engine.models.tiny import ensure_default_model
    model = os.environ.get("TRIO_LLM_MODEL") or str(ensure_default_model())
    engine_config = EngineConfig(model=model, max_num_seqs=int(os.environ.get("TRIO_LLM_MAX_NUM_SEQS", "256")))
    settings = ServerSettings(api_key=os.environ.get("TRIO_LLM_API_KEY"),
                              served_model_name=os.environ.get("TRIO_LLM_SERVED_MODEL_NAME"))
    return create_app(engine_config, settings)
