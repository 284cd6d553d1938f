"""Running a real hypercorn server with the app on 127.0.0.1 and a free port, inside the test's nursery."""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

import trio
from hypercorn.trio import serve as hypercorn_serve
from quart_trio import QuartTrio

from web.app import create_app
from web.http.settings import ServerSettings
from web.http.state import ServerState
from web.serve import hypercorn_config


@dataclass
class RunningServer:
    url: str
    state: ServerState
    app: QuartTrio

    @property
    def engine(self):
        return self.state.engine


# What the Messages and Responses tests share: a chat template that writes each role, content and
# tool call on a line (a test reads the rendered conversation back), and the tool they call.
CONVERSATION_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] or '' }}"
                         "{% for c in m.get('tool_calls') or [] %} CALL {{ c['function']['name'] }}{% endfor %}\n"
                         "{% endfor %}assistant:")
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 10}}}


def record_chat_prompts(server: RunningServer) -> list[list[dict]]:
    """The conversations the server's engine renders from now on, in order (each as the chat
    template receives it)."""
    seen: list[list[dict]] = []
    original = server.engine.chat_prompt

    async def recording(messages, **kwargs):
        seen.append(messages)
        return await original(messages, **kwargs)

    server.engine.chat_prompt = recording
    return seen


@asynccontextmanager
async def running_server(engine_config, settings: ServerSettings | None = None, executor=None):
    settings = settings or ServerSettings()
    app = create_app(engine_config, settings, executor=executor)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        config = hypercorn_config("127.0.0.1", 0, settings, log_level="warning")
        binds = await nursery.start(partial(hypercorn_serve, app, config, shutdown_trigger=stop.wait))
        try:
            yield RunningServer(binds[0], app.extensions["trio_llm"], app)
        finally:
            stop.set()
