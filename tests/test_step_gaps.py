"""The device check's step-gap figure (`bench.gpu.step_gaps`): the idle time at step boundaries from a
profile's kernel intervals, and the profiled decode it is read from."""

from __future__ import annotations

from bench.gpu import _profiled_decode, step_gaps


def test_the_gaps_reported_are_the_longest_idle_times_and_overlapping_kernels_merge():
    # three steps of back-to-back kernels (one pair overlapping, as two streams' would), 0.2 and
    # 0.7 ms apart; inside a step the kernels touch or leave 10 us
    step = [(0.0, 1.0e-3), (0.9e-3, 1.5e-3), (1.51e-3, 2.0e-3)]
    kernels = [*step, *((s + 2.2e-3, e + 2.2e-3) for s, e in step), *((s + 4.9e-3, e + 4.9e-3) for s, e in step)]
    gaps = step_gaps(kernels, steps=3)
    assert [round(g * 1e3, 3) for g in gaps] == [0.7, 0.2]
    assert step_gaps(kernels, steps=1) == [] and step_gaps([], steps=5) == []


async def test_the_profiled_decode_counts_its_steps_and_on_the_cpu_finds_no_device_kernels(tiny_model_dir):
    kernels, steps = await _profiled_decode(tiny_model_dir, "cpu", tokens=8, vocab=500)
    assert kernels == [] and steps >= 8  # a prompt step (or more), then a step a token
