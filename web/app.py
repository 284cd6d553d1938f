"""The Quart-Trio app: the engine opens in the app's lifespan, inside the app nursery.

    app = create_app(EngineConfig(model=...), ServerSettings(api_key=...))

`app_from_env()` is the factory for `hypercorn -k trio 'web.app:app_from_env()'`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import anyio
import trio
from anyio.abc import TaskStatus
from quart import Response, g, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from engine.api import (
    EngineConfig,
    EngineDeadError,
    Executor,
    InvalidRequestError,
    RequestFailedError,
    open_engine,
    open_engine_process,
)
from engine.concurrency.offload import run_sized
from engine.ids import random_id
from web.anthropic import routes as anthropic_routes
from web.http import cors, load_tracking, orca
from web.http.errors import APIError, bad_request
from web.http.keepalive import KeepAliveGuard
from web.http.load_tracking import ServerLoad
from web.http.requests import OFFLOAD_BODY_BYTES, read_body, read_request, top_level_keys
from web.http.settings import ServerSettings
from web.http.startup import describe_engine, engine_death, explain
from web.http.state import ServerState
from web.openai import routes as openai_routes
from web.openai.completions import create_chat_completion, create_completion
from web.pooling import routes as pooling_routes
from web.pooling.handlers import create_embeddings
from web.pooling.protocol import EmbeddingRequest
from web.vllm import routes as vllm_routes

logger = logging.getLogger(__name__)


class RootPathOptional:
    """`--root-path` as vLLM (ASGI under uvicorn) has it: a proxy may or may not strip the prefix,
    so a path under it is served without it, and any other path is served as it is (`/health`
    at the root answers; Quart alone would 404 every path outside the prefix)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        root = scope.get("root_path", "")
        path = scope.get("path", "")
        if root and path != root and not path.startswith(root.rstrip("/") + "/"):
            scope = {**scope, "root_path": ""}
        await self.app(scope, receive, send)


def create_app(engine_config: EngineConfig, settings: ServerSettings | None = None, *,
               executor: Executor | None = None, on_ready: Callable[[], None] | None = None,
               exit_on_failed_start: bool = False) -> QuartTrio:
    """The app; the engine opens when it starts serving. `executor` replaces the configured one
    (tests pass a fake); `on_ready` runs once the engine is up (the process entry points pass
    `engine.api.tune_collector_for_serving`); with `exit_on_failed_start` (hypercorn's factory) a
    failed engine start ends the process with status 1."""
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
    # Responses sent before their request body is in must leave the connection usable or closed.
    app.asgi_app = KeepAliveGuard(app.asgi_app)  # type: ignore[method-assign,assignment]
    load = ServerLoad(app.asgi_app, state.settings.enable_server_load_tracking)
    app.asgi_app = load  # type: ignore[method-assign,assignment]
    app.asgi_app = RootPathOptional(app.asgi_app)  # type: ignore[method-assign,assignment]

    @app.before_serving
    async def start_engine() -> None:
        if state.engine is None:  # serve() opens it first, before the port is bound
            try:
                await app.nursery.start(run_engine, state)
            except Exception as exc:
                if not exit_on_failed_start:
                    raise
                # hypercorn logs a failed lifespan start-up and exits 0, and a SystemExit raised here
                # hangs its lifespan task: a supervisor must see a failure, so the process ends now.
                # Nothing runs yet (open_engine has cleaned up what it started); the log is flushed.
                logger.critical("trio-llm: the engine failed to start: %s", explain(exc) or repr(exc))
                logging.shutdown()
                os._exit(1)
        assert state.engine is not None
        embeds_limits = state.engine.prompt_embeds_limits
        app.config["MAX_CONTENT_LENGTH"] = state.settings.body_limit(
            embeds_limits.max_payload_bytes if embeds_limits else None)
        if on_ready is not None:
            on_ready()

    @app.before_request
    async def authenticate() -> None:
        if request.method != "OPTIONS" and request.path not in state.settings.open_paths():
            _check_api_key(state.settings.api_key)

    if state.settings.enable_request_id_headers:
        @app.after_request
        async def request_id_header(response: Response) -> Response:
            """--enable-request-id-headers: the client's X-Request-Id echoed, or a new one."""
            response.headers["X-Request-Id"] = request.headers.get("X-Request-Id") or random_id()
            return response

    @app.after_request
    async def orca_load_report(response: Response) -> Response:
        """An ORCA load report on a generation answer whose request asked for one (web.http.orca)."""
        asked = request.headers.get(orca.REQUEST_HEADER)
        if asked and request.path in orca.REPORTING_PATHS and state.engine is not None:
            report = orca.load_report(asked, state.engine.stats())
            if report is not None:
                response.headers[orca.RESPONSE_HEADER] = report
        return response

    cors.register(app, state.settings.cors)
    _register_error_handlers(app)
    for family in (openai_routes, anthropic_routes, pooling_routes, vllm_routes):
        family.register(app, state)
    _register_invocations(app, state)
    load_tracking.register(app, load)
    return app


def _register_invocations(app: QuartTrio, state: ServerState) -> None:
    @app.post("/invocations")
    async def invocations() -> Response:
        """SageMaker's entry point, as vLLM serves it: the body's shape picks the endpoint
        (`messages`: chat, `prompt`: completions, `input`: embeddings)."""
        body = await read_body()
        g.trio_llm_body = body
        keys = await run_sized(top_level_keys, body, size=len(body), inline_below=OFFLOAD_BODY_BYTES,
                               limiter=state.limiter)
        if "messages" in keys:
            return await create_chat_completion(state)
        if "prompt" in keys or "prompt_embeds" in keys:
            return await create_completion(state)
        if "input" in keys:
            return await create_embeddings(state, await read_request(state, EmbeddingRequest))
        raise bad_request("/invocations takes a chat (messages), completions (prompt) or embeddings (input) body")


async def run_engine(state: ServerState, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Hold the engine open for the app's lifetime. A start-up failure fails the server start;
    a failure while serving is recorded, the server answers 503 from then on, and
    `state.on_engine_failure` is called. Cancellation closes the engine (its open requests
    end with `EngineDeadError`)."""
    started = False
    config = state.engine_config
    if config.loop_lag_interval is None:
        config = replace(config, loop_lag_interval=state.settings.loop_lag_interval)
    started_at = anyio.current_time()
    apart = engine_in_own_process(state)
    if apart:
        opened = open_engine_process(config, observer=state.metrics, spawned=state.spawned_engine)
    else:
        opened = open_engine(config, executor=state.executor, observer=state.metrics)
    try:
        async with opened as engine:
            state.engine = engine
            state.metrics.bind(engine.stats, engine.engine_stats)
            for line in describe_engine(engine, config, anyio.current_time() - started_at, list(engine.engine_pids)):
                logger.info("%s", line)
            task_status.started()
            started = True
            await anyio.sleep_forever()
    except* Exception as group:
        if not started:
            raise
        state.engine_error = group
        death = engine_death(group)  # a process that exited: one line; anything else is a bug to show whole
        if death is not None:
            logger.error("the engine failed: %s; the server now answers 503", death)
            logger.debug("how the engine failed", exc_info=group)
        else:
            logger.error("the engine failed; the server now answers 503", exc_info=group)
        if state.on_engine_failure is not None:
            state.on_engine_failure()


def engine_in_own_process(state: ServerState) -> bool:
    """The server runs its engine core in a process of its own (`open_engine_process`), as vLLM's
    API server does, unless a test injects an executor or `--executor inproc` asks for one process."""
    return state.executor is None and state.engine_config.executor != "inproc"


def _check_api_key(api_key: str | None) -> None:
    if api_key is None:
        return
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if not header and "x-api-key" in request.headers:  # Anthropic's clients send the key there
        scheme, token = "bearer", request.headers["x-api-key"]
    # Digests of both, compared in constant time: the time taken says nothing about how much of
    # the key is right, nor how long it is (vLLM compares the same way).
    given, expected = hashlib.sha256(token.encode()).digest(), hashlib.sha256(api_key.encode()).digest()
    if not hmac.compare_digest(given, expected) or scheme.lower() != "bearer":
        raise APIError(401, "invalid or missing API key; send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                       code="invalid_api_key")


def _register_error_handlers(app: QuartTrio) -> None:
    @app.errorhandler(APIError)
    async def api_error(error: APIError) -> Response:
        return error.response()

    @app.errorhandler(InvalidRequestError)
    async def invalid(error: InvalidRequestError) -> Response:
        return APIError(400, str(error), param=error.param).response()

    @app.errorhandler(RequestFailedError)
    async def failed(error: RequestFailedError) -> Response:
        return APIError(500, str(error), code="request_failed").response()

    @app.errorhandler(EngineDeadError)
    async def dead(error: EngineDeadError) -> Response:
        return APIError(503, str(error), code="engine_dead").response()

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:
        status = error.code or 500
        messages = {404: f"no route for {request.method} {request.path}",
                    405: f"method {request.method} is not allowed for {request.path}",
                    413: f"the request body exceeds the limit of {app.config['MAX_CONTENT_LENGTH']} bytes"}
        return APIError(status, messages.get(status, error.description or error.name)).response()


def app_from_env() -> QuartTrio:
    """App factory for `hypercorn -k trio 'web.app:app_from_env()'`.

    Reads TRIO_LLM_MODEL (default: the embedded model), TRIO_LLM_API_KEY,
    TRIO_LLM_SERVED_MODEL_NAME and TRIO_LLM_MAX_NUM_SEQS. Logs as `trio-llm serve` does, and
    makes SIGTERM the graceful stop SIGINT is there (in-flight requests get hypercorn's
    `--graceful-timeout`).
    """
    from engine.api import ensure_default_model, tune_collector_for_serving
    _log_to_stderr("web", "engine")  # the start-up lines; hypercorn configures only its own loggers
    model = os.environ.get("TRIO_LLM_MODEL") or str(ensure_default_model())
    engine_config = EngineConfig(model=model, max_num_seqs=int(os.environ.get("TRIO_LLM_MAX_NUM_SEQS", "256")))
    settings = ServerSettings(api_key=os.environ.get("TRIO_LLM_API_KEY"),
                              served_model_name=os.environ.get("TRIO_LLM_SERVED_MODEL_NAME"))
    app = create_app(engine_config, settings, on_ready=tune_collector_for_serving, exit_on_failed_start=True)

    @app.before_serving
    async def stop_gracefully_on_sigterm() -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGINT) not in (signal.SIG_IGN, signal.SIG_DFL):
            await app.nursery.start(_sigterm_as_sigint)  # installed before the first request
        elif multiprocessing.parent_process() is None:  # -w 0 (hypercorn's own workers are its children)
            logger.warning("SIGINT is ignored in this process (started in the background by a shell, or by nohup?): "
                           "SIGTERM will stop the server at once, without --graceful-timeout for open requests")

    return app


def _log_to_stderr(*names: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
    for name in names:
        named = logging.getLogger(name)
        if not named.handlers:
            named.addHandler(handler)
            named.setLevel(logging.INFO)
            named.propagate = False


async def _sigterm_as_sigint(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """hypercorn's trio worker run in its own process (`-w 0`) stops gracefully on SIGINT, which
    trio raises in its main task as KeyboardInterrupt, and not at all on SIGTERM, whose default
    ends the process at once (exit 143, no grace period): turn the one into the other. (With a
    supervisor, `-w 1` and more, the workers ignore SIGINT and the supervisor handles SIGTERM: this
    is not installed there.) Runs until the app nursery is cancelled; it reports started once
    SIGTERM is ours, so serving begins only then (with `start_soon` nothing ensured it: two full
    test runs saw a stream cut after SIGTERM with no line from here, cause not yet confirmed)."""
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        task_status.started()
        async for _ in signals:
            logger.info("received SIGTERM: shutting down gracefully")
            _interrupt_the_main_task()
            return


@trio.lowlevel.enable_ki_protection
def _interrupt_the_main_task() -> None:
    """SIGINT, raised where trio defers it: KeyboardInterrupt then reaches trio's main task
    (hypercorn's `worker_serve`, which stops gracefully on it), not this app's task."""
    signal.raise_signal(signal.SIGINT)
