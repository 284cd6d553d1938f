"""The messages between the engine and a worker process, and their wire form.

Plain picklable data. Calls and replies, the frequent ones, travel as plain
tuples (see `to_wire`); the others as their dataclasses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# What `collective_rpc` calls on each worker: a `Worker` method's name, or a function taking the
# worker first (module-level, so that it pickles by name to a worker process), as vLLM's does.
RPCMethod = str | Callable[..., Any]


@dataclass
class Call:
    seq: int
    method: RPCMethod
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    reply_rank: int | None = None  # None: every worker replies


@dataclass
class Reply:
    seq: int
    value: Any


@dataclass
class Failure:
    seq: int
    error_type: str
    message: str
    traceback: str


@dataclass
class Shutdown:
    """Asks a worker to exit after the calls before it."""


@dataclass
class Init:
    """The first frame to a new worker: who it is and what to build."""

    rank: int
    world_size: int
    config: Any  # EngineConfig
    distributed_init_method: str | None = None
    torch_threads: int | None = None
    poll: bool = True  # poll for the next call while calls come quickly (only with a core to spare)


@dataclass
class Ready:
    rank: int
    pid: int


@dataclass
class StartupFailed:
    rank: int
    error: str


# On the wire a call and a reply are plain tuples: pickling a dataclass goes through copyreg and its
# `__dict__` (~4 us each way on the machine measured), a tuple of builtins ~0.4 us, and every call
# pays for four of them on its round trip. The other messages are rare and stay as they are.
_CALL, _REPLY = 0, 1


def to_wire(message: Any) -> Any:
    if type(message) is Call:
        return (_CALL, message.seq, message.method, message.args, message.kwargs, message.reply_rank)
    if type(message) is Reply:
        return (_REPLY, message.seq, message.value)
    return message


def from_wire(obj: Any) -> Any:
    if type(obj) is tuple:
        return Call(*obj[1:]) if obj[0] == _CALL else Reply(*obj[1:])
    return obj
