"""Length-prefixed frames over a trio byte stream, pickled with protocol 5.

A frame is a header (`<I` pickle length, `<I` buffer count, then one `<Q`
length per buffer) followed by the pickle and the raw buffers. Tensors are
pickled as out-of-band buffers of their bytes: `send` writes their memory
straight to the socket (no copy into the pickle), and `receive` rebuilds
them over the received bytes (no copy out).

Both ends are our own processes, so pickle is the right tool; frames never
come from the network.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import struct
from typing import Any

import torch
import trio

_HEAD = struct.Struct("<II")
_LEN = struct.Struct("<Q")
MAX_FRAME_BUFFERS = 1 << 16


def _tensor_from_buffer(buffer: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    flat = torch.frombuffer(buffer, dtype=torch.uint8) if len(memoryview(buffer)) else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def _reduce_tensor(tensor: torch.Tensor) -> Any:
    if tensor.device.type != "cpu" or tensor.layout != torch.strided:
        return tensor.__reduce_ex__(5)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return _tensor_from_buffer, (pickle.PickleBuffer(raw.data), tensor.dtype, tuple(tensor.shape))


# A dispatch table, not `reducer_override`: that is a Python call for every object pickled.
_DISPATCH = {**copyreg.dispatch_table, torch.Tensor: _reduce_tensor}


def dumps(obj: Any) -> list[bytes | memoryview]:
    """The frame for `obj`, as pieces to write in order (the buffers are not copied)."""
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=5, buffer_callback=buffers.append)
    pickler.dispatch_table = _DISPATCH
    pickler.dump(obj)
    views = [b.raw() for b in buffers]
    head = _HEAD.pack(out.tell(), len(views)) + b"".join(_LEN.pack(v.nbytes) for v in views)
    return [head, out.getbuffer(), *views]


SMALL_PIECE = 64 << 10  # pieces below this are joined: one syscall beats a copy of a few KiB


async def send(stream: trio.abc.SendStream, obj: Any) -> None:
    """Write one frame. Not safe to call from two tasks at once on one stream.

    A cancelled send may leave a half-written frame: the stream is then unusable, and its owner
    closes it.
    """
    pending: list[bytes | memoryview] = []
    for piece in dumps(obj):
        if len(piece) < SMALL_PIECE:
            pending.append(piece)
            continue
        if pending:
            await stream.send_all(b"".join(pending))
            pending = []
        await stream.send_all(piece)
    if pending:
        await stream.send_all(b"".join(pending))


class FrameReader:
    """Reads whole frames from a byte stream (one reader task per stream)."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buffer = bytearray()

    async def receive(self) -> Any:
        """The next object; raises `EOFError` when the stream ends between frames.

        Cancellation while a frame is half read leaves the reader unusable; its owner closes the
        stream.
        """
        pickle_len, num_buffers = _HEAD.unpack(await self._exactly(_HEAD.size, eof_ok=True))
        if num_buffers > MAX_FRAME_BUFFERS:
            raise ValueError(f"corrupt frame: {num_buffers} buffers")
        lengths = [_LEN.unpack(await self._exactly(_LEN.size))[0] for _ in range(num_buffers)]
        data = await self._exactly(pickle_len)
        buffers = [await self._exactly(n) for n in lengths]
        return pickle.loads(data, buffers=buffers)

    async def _exactly(self, size: int, eof_ok: bool = False) -> bytearray:
        while len(self._buffer) < size:
            chunk = await self._stream.receive_some(max(65536, size - len(self._buffer)))
            if not chunk:
                if eof_ok and not self._buffer:
                    raise EOFError("the stream ended")
                raise EOFError("the stream ended inside a frame")
            self._buffer += chunk
        if len(self._buffer) == size:
            data, self._buffer = self._buffer, bytearray()
            return data
        data = self._buffer[:size]
        del self._buffer[:size]
        return data
