"""The messages between the server process and the engine process, and the wire form of outputs.

Both ends are our own processes over `engine.ipc.wire` frames (pickle protocol 5, tensors out
of band). The frequent messages are plain tuples, as the executor's calls are (pickling a dataclass
costs ~10x a tuple of builtins):

- server -> engine, one frame per batch of posted messages: a list of `(ADD, EngineCoreRequest)`,
  `(ABORT, request_id)` and `(CALL, token, method, args)` (one of `CORE_CALLS`, awaited on the
  core in a task of its own). The end of the stream stops the engine.
- engine -> server, one frame per step: a `StepReport` tuple (every request's outputs of the step,
  the observer calls the step made, a snapshot of the core, and the calls answered).

A `RequestOutput` crosses without its prompt: the server keeps each request's prompt and prompt
token ids from its `ADD` and puts them back (`RequestPrompt`), so a step's frame carries only what
the step produced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.core.engine_core import OutputItem
from engine.core.output_processor import RequestPrompt
from engine.core.stats import EngineStats
from engine.model_info import ModelInfo
from engine.outputs import CompletionOutput, RequestOutput

ADD, ABORT, CALL = 0, 1, 2
# The core's async methods a CALL may name (the client side's own methods of the same names).
CORE_CALLS = frozenset({"wait_until_idle", "add_lora", "remove_lora"})


@dataclass
class EngineInit:
    """The first frame to a new engine process."""

    config: EngineConfig


@dataclass
class EngineReady:
    pid: int
    info: ModelInfo  # sized
    sampling_defaults: dict[str, Any]
    stats: EngineStats
    worker_pids: tuple[int, ...]  # the executor's worker processes (none when the worker is a thread here)


@dataclass
class EngineStartFailed:
    error: BaseException  # what `open_engine` would have raised (a RuntimeError with its text if it
    # could not be pickled)


@dataclass
class EngineFailed:
    """The engine core failed while serving; the engine process exits after this frame."""

    error: BaseException


@dataclass(frozen=True)
class CoreSnapshot:
    """The core's state after a step, for `AsyncEngine.stats()` and white-box tests."""

    stats: EngineStats | None  # None: as the last report's (`Outbox.take`: within a decode burst)
    adds_received: int  # ADD messages the engine process has read (the rest are in flight)
    num_steps: int
    num_requests: int
    core_dead: bool = False  # the core has stopped (its failure follows in `EngineFailed`)


# outputs: (request_id, encoded output, or None when the request's outputs end);
# observed: (StatsObserver method name, args); answered: (CALL token, the error it raised or None).
# The calls return nothing but success or their error.
Answer = tuple[int, BaseException | None]
StepReport = tuple[list[tuple[str, Any]], list[tuple[str, tuple[Any, ...]]], CoreSnapshot, list[Answer]]


def encode_output(item: OutputItem) -> Any:
    """A step's output for the wire: a `RequestOutput` as a tuple without its prompt; anything else
    (pooling outputs, errors) as it is."""
    if type(item) is not RequestOutput:
        return item
    completions = [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason)
                   for c in item.outputs]
    return completions, item.finished, item.prompt_logprobs, item.num_cached_tokens, item.metrics


def decode_output(request_id: str, encoded: Any, prompt: RequestPrompt) -> OutputItem:
    """The `OutputItem` `encode_output` was given, with the prompt put back."""
    if type(encoded) is not tuple:
        return encoded  # type: ignore[no-any-return]
    completions, finished, prompt_logprobs, num_cached_tokens, metrics = encoded
    return RequestOutput(request_id, prompt.prompt, prompt.visible_token_ids,
                         [CompletionOutput(*c) for c in completions], finished, prompt_logprobs, num_cached_tokens,
                         metrics, prompt.num_prompt_tokens)
