"""Moving step data between host and device without making the host wait for the device.

On CUDA, `torch.tensor(values, device="cuda")` copies from pageable memory, which synchronises the
stream: the host waits for every kernel queued so far, the opposite of what a step loop that runs
ahead of the device wants. The same holds for `.tolist()` and `.item()` the other way. So:

- host -> device: `to_device` stages the values in pinned memory and copies without blocking;
- device -> host: `HostCopy` copies into pinned memory on a side stream and records an event; the
  step's one host sync is waiting for that event.

On CPU both are plain tensor operations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list as a tensor on `device`, without waiting for the device's queued work."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class HostCopy:
    """Device tensors copied into host memory without waiting: on CUDA, into pinned memory on
    `side_stream` (ordered after the work queued so far on the current stream), the copy's
    completion recorded there as an event. Waiting for it is the step's one host sync: `wait` in a
    worker thread, or a `DeviceEvent` recorded on `stream` and awaited on the event loop. On CPU the
    tensors are host tensors already and `stream` is None."""

    def __init__(self, tensors: list[torch.Tensor], side_stream: Any = None) -> None:
        self.stream: Any = None
        self._event: Any = None
        if not tensors[0].is_cuda:
            self._host = tensors
            return
        device = tensors[0].device
        self.stream = side_stream if side_stream is not None else torch.cuda.current_stream(device)
        self.stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self.stream):
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                          for t in tensors]
            for t in tensors:  # the caching allocator must not hand `t` out again before the copy ran
                t.record_stream(self.stream)
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves it untyped
            self._event.record(self.stream)

    def is_done(self) -> bool:
        """Whether the copy has finished (never blocks)."""
        return self._event is None or bool(self._event.query())

    def wait(self) -> None:
        """Block this thread (a worker's, never the event loop's) until the copy is done."""
        if self._event is not None:
            self._event.synchronize()

    def tensors(self) -> list[torch.Tensor]:
        """The host copies: complete once `wait` returned or `is_done()`."""
        return self._host
