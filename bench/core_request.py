"""What one request costs on the engine process's wire: the frozen `EngineCoreRequest` against the
scheduler `Request`s the client used to send (one per sample, with the prompt twice and the
scheduler's own fields), pickled as `engine.ipc.wire` does, and msgspec's msgpack when installed.

Figures are a round trip (encode + decode) per request, best of 5 rounds, in one process.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from collections.abc import Callable
from typing import Any

from engine.core.engine_core import scheduler_requests
from engine.core_request import EngineCoreRequest
from engine.sampling_params import SamplingParams

CASES = ((1, 128), (4, 128), (1, 2048))  # (n, prompt tokens)


def _best_microseconds(fn: Callable[[], Any], reps: int = 2000) -> float:
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        rounds.append((time.perf_counter() - start) / reps * 1e6)
    return min(rounds)


def _request(n: int, prompt_len: int) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=128, stop=("\n\n",), n=n).with_eos((2,))
    return EngineCoreRequest("cmpl-0123456789abcdef", "x" * (4 * prompt_len), tuple(range(prompt_len)), params,
                             max_tokens=128, arrival_time=123.4)


def _pickled(message: Any) -> tuple[int, float]:
    return len(pickle.dumps(message, 5)), _best_microseconds(lambda: pickle.loads(pickle.dumps(message, 5)))


def run() -> str:
    lines = ["case              | scheduler Requests (before) | EngineCoreRequest (pickle) | "
             "EngineCoreRequest (msgspec)"]
    for n, prompt_len in CASES:
        request = _request(n, prompt_len)
        old_size, old_us = _pickled(("add", request.request_id, request.prompt, scheduler_requests(request)))
        new_size, new_us = _pickled(("add", request))
        lines.append(f"n={n} prompt={prompt_len:<5}  | {old_size:6d} B {old_us:6.1f} us        | "
                     f"{new_size:6d} B {new_us:6.1f} us       | {_msgspec(request)}")
    return "\n".join(lines)


def _msgspec(request: EngineCoreRequest) -> str:
    try:
        import msgspec
    except ImportError:
        return "not installed"
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(EngineCoreRequest)
    if decoder.decode(encoder.encode(request)) != dataclasses.replace(request):
        return "round trip differs"
    size = len(encoder.encode(request))
    return f"{size:6d} B {_best_microseconds(lambda: decoder.decode(encoder.encode(request))):6.1f} us"
