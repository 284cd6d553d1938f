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
from typing import Awaitable, Callable

import anyio
import trio
from anyio.abc import TaskStatus
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from engine.config import EngineConfig
from engine.executor.base import Executor
from web.app import create_app
from web.settings import ServerSettings

logger = logging.getLogger(__name__)


def hypercorn_config(host: str, port: int, settings: ServerSettings, log_level: str = "info") -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [f"{host}:{port}"]
    config.graceful_timeout = settings.grace_period
    config.loglevel = log_level.upper()
    config.accesslog = None
    return config


async def serve(engine_config: EngineConfig, settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000,
                *, shutdown_trigger: Callable[[], Awaitable[None]] | None = None, executor: Executor | None = None,
                log_level: str = "info", task_status: TaskStatus[list[str]] = anyio.TASK_STATUS_IGNORED) -> None:
    """Serve until a signal (or `shutdown_trigger`); `task_status.started` gets the bound URLs."""
    app = create_app(engine_config, settings, executor=executor)
    config = hypercorn_config(host, port, settings, log_level)
    async with trio.open_nursery() as nursery:
        if shutdown_trigger is None:
            stop = trio.Event()
            nursery.start_soon(_set_on_signal, stop)
            shutdown_trigger = stop.wait
        binds = await nursery.start(_serve_then_stop, app, config, shutdown_trigger, nursery.cancel_scope)
        task_status.started(binds)


async def _serve_then_stop(app, config, shutdown_trigger, scope: trio.CancelScope, *,
                           task_status: TaskStatus[list[str]] = anyio.TASK_STATUS_IGNORED) -> None:
    await hypercorn_serve(app, config, shutdown_trigger=shutdown_trigger, task_status=task_status)
    scope.cancel()  # stop the signal watcher too


async def _set_on_signal(stop: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            logger.info("received %s: shutting down gracefully", signal.Signals(signum).name)
            stop.set()
            return
