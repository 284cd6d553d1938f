"""Frames between the engine and its worker processes: tensors travel as out-of-band buffers."""

from __future__ import annotations

import pickle

import torch
import trio
import trio.testing

from engine.ipc import wire


def test_tensors_are_sent_as_buffers_not_inside_the_pickle():
    tensor = torch.randn(64, 32).to(torch.bfloat16)
    head, pickled, *buffers = wire.dumps({"embeds": tensor})
    assert [len(b) for b in buffers] == [tensor.numel() * 2]
    assert len(pickled) < 1000  # the data is not in the pickle


async def test_round_trip_of_mixed_tensors_and_plain_data():
    tensors = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "strided": torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2],
        "empty": torch.zeros(0, 7),
        "ints": torch.arange(10),
        "scalar": torch.tensor(2.5),
    }
    message = {"tensors": tensors, "ids": [1, 2, 3], "text": "x" * 70_000}  # and a piece over SMALL_PIECE
    left, right = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wire.send, left, message)
        received = await wire.FrameReader(right).receive()
    assert received["ids"] == [1, 2, 3] and received["text"] == message["text"]
    for name, tensor in tensors.items():
        got = received["tensors"][name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor), name


async def test_a_stream_ending_between_frames_is_eof_and_inside_one_is_an_error():
    left, right = trio.testing.memory_stream_pair()
    reader = wire.FrameReader(right)
    await left.send_all(b"".join(bytes(p) for p in wire.dumps("whole")))
    await left.send_all(bytes(wire.dumps("cut")[0])[:5])
    await left.aclose()
    assert await reader.receive() == "whole"
    try:
        await reader.receive()
    except EOFError as exc:
        assert "inside a frame" in str(exc)
    else:
        raise AssertionError("a truncated frame was accepted")
    assert pickle.loads(bytes(wire.dumps([1])[1])) == [1]
