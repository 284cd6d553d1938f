"""`FastSocketStream` keeps trio's stream contract, but for checkpoints on calls that need not wait."""

from __future__ import annotations

import socket

import trio
import trio.testing

from engine.ipc.fast_socket import FastSocketStream


class _Checkpointing(FastSocketStream):
    """Adds the checkpoints FastSocketStream leaves out (and only those), so trio's
    conformance check can judge everything else it promises."""

    async def send_all(self, data):
        await trio.lowlevel.checkpoint_if_cancelled()
        await super().send_all(data)
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def receive_some(self, max_bytes=None):
        await trio.lowlevel.checkpoint_if_cancelled()
        data = await super().receive_some(max_bytes)
        await trio.lowlevel.cancel_shielded_checkpoint()
        return data

    async def send_eof(self):
        await trio.lowlevel.checkpoint_if_cancelled()
        await super().send_eof()
        await trio.lowlevel.cancel_shielded_checkpoint()


async def _pair(cls=_Checkpointing):
    a, b = socket.socketpair()
    return cls(a), cls(b)


async def _clogged_pair():
    s, r = await _pair()
    # Fill the buffers until the socket stops being writable (a Unix socket reports itself
    # writable again while a quarter of its send buffer is free, so fill to the last byte).
    # Both directions: trio's two-way check also uses this pair flipped.
    for stream in (s, r):
        for chunk in (b"x" * 65536, b"x"):
            while stream.try_send(chunk):
                pass
    return s, r


async def test_it_passes_trios_half_closeable_stream_check():
    await trio.testing.check_half_closeable_stream(_pair, _clogged_pair)


async def test_the_one_guarantee_it_drops_a_ready_socket_does_not_checkpoint():
    s, r = await _pair(FastSocketStream)
    async with s, r:
        with trio.testing.assert_no_checkpoints():
            await s.send_all(b"ping")
            assert await r.receive_some(4) == b"ping"
