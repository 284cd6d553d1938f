"""Running the app under hypercorn's trio worker, from Python.

    trio.run(serve, engine_config, settings, "127.0.0.1", 8000)

SIGINT/SIGTERM (or `shutdown_trigger` returning) stops accepting
connections; in-flight requests get `settings.grace_period` seconds to
finish, the rest are cancelled (which aborts their engine requests); then
the engine closes and `serve` returns.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from quart_trio import QuartTrio

from engine.api import EngineConfig, Executor, SpawnedEngine, tune_collector_for_serving
from web.app import create_app, run_engine
from web.http.settings import ServerSettings
from web.http.state import ServerState

logger = logging.getLogger(__name__)
EVERY_INTERFACE = ("0.0.0.0", "::", "")  # hosts that bind every interface (vLLM's default)

def hypercorn_config(host: str, port: int, settings: ServerSettings, log_level: str = "info") -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [f"unix:{settings.uds}"] if settings.uds else [f"{host}:{port}"]
    config.graceful_timeout = settings.grace_period
    # hypercorn's own "Running on" line would repeat ours ("Serving on"): its log shows from warnings.
    config.loglevel = "DEBUG" if log_level.upper() == "DEBUG" else "WARNING"
    config.accesslog = None
    config.root_path = settings.root_path
    if settings.ssl_certfile and settings.ssl_keyfile:
        config.certfile, config.keyfile = settings.ssl_certfile, settings.ssl_keyfile
    return config


async def serve(engine_config: EngineConfig, settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000,
                *, shutdown_trigger: Callable[[], Awaitable[None]] | None = None, executor: Executor | None = None,
                log_level: str = "info", spawned_engine: SpawnedEngine | None = None,
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> int:
    """Serve until a signal (or `shutdown_trigger`), or until the engine dies; `task_status.started`
    gets the bound URLs. Returns the process's exit status: 0, or 1 when the engine died (a worker
    process exited, say): the server then stops as on SIGTERM, giving in-flight requests the grace
    period, and exits non-zero so a supervisor restarts it (vLLM exits too). `spawned_engine`: an
    engine process already started (`engine_process_started`), adopted instead of starting one.

    Cancellation stops the server at once: open connections are closed, their
    requests aborted, and the engine closed (a signal or `shutdown_trigger`
    gives in-flight requests the grace period first)."""
    app = create_app(engine_config, settings, executor=executor, on_ready=tune_collector_for_serving)
    state: ServerState = app.extensions["trio_llm"]
    state.spawned_engine = spawned_engine
    config = hypercorn_config(host, port, settings, log_level)
    stop = trio.Event()
    state.on_engine_failure = stop.set
    async with trio.open_nursery() as nursery:
        if shutdown_trigger is None:
            nursery.start_soon(_set_on_signal, stop)
        else:
            nursery.start_soon(_set_when_done, shutdown_trigger, stop)
        # The engine first: a start-up failure is raised here, before the port is bound, and the app
        # then finds it open. It closes when this nursery does, after hypercorn's graceful stop.
        await nursery.start(run_engine, state)
        nursery.start_soon(_end_streams_before_the_grace_period_ends, stop, state, settings.grace_period)
        binds = await nursery.start(_serve_then_stop, app, config, stop.wait, nursery.cancel_scope)
        for bind in binds:
            logger.info("Serving on %s", bind)
        if host in EVERY_INTERFACE and not settings.uds and not settings.api_key:
            logger.warning("listening on every interface (%s) with no --api-key: anyone who can reach this machine "
                           "can use the server; --host 127.0.0.1 serves this machine only", binds[0])
        task_status.started(binds)
    if state.engine_error is not None:
        logger.error("exiting with status 1: the engine died while serving")
        return 1
    return 0


# Streams still open this long before the grace period ends get their closing error event and
# [DONE] (a stream cut by hypercorn's cancellation would end mid-chunk, with no reason given).
STREAM_END_MARGIN = 1.0


async def _end_streams_before_the_grace_period_ends(stop: trio.Event, state: ServerState, grace: float) -> None:
    await stop.wait()
    await trio.sleep(max(0.0, grace - min(STREAM_END_MARGIN, grace / 4)))
    state.streams.stop_all()


async def _set_when_done(trigger: Callable[[], Awaitable[None]], stop: trio.Event) -> None:
    await trigger()
    stop.set()


async def _serve_then_stop(app: QuartTrio, config: HypercornConfig, shutdown_trigger: Callable[[], Awaitable[None]],
                           scope: trio.CancelScope, *,
                           task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    await hypercorn_serve(app, config, shutdown_trigger=shutdown_trigger, task_status=task_status)
    scope.cancel()  # stop the signal watcher too


async def _set_on_signal(stop: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            logger.info("received %s: shutting down gracefully", signal.Signals(signum).name)
            stop.set()
            return
