"""The thread tuner (engine/worker/thread_tuner.py) on fake step timings: it keeps the count that
steps fastest, moves when a busy neighbour changes which that is, and probes less on a steady
machine."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.cpu_binding import parse_cpu_threads_bind
from engine.worker.thread_tuner import STEP_UNIT, ThreadTuner
from engine.worker.worker import thread_tuner_for


def run_steps(tuner: ThreadTuner, steps: int, seconds: Callable[[int], float], shape: int = 16) -> list[int]:
    """Run `steps` steps whose time depends on the thread count; the counts used, in order."""
    used = []
    for _ in range(steps):
        threads = tuner.next_threads()
        used.append(threads)
        tuner.record(threads, shape, seconds(threads))
    return used


def quiet(threads: int) -> float:  # two cores, nothing else running: two threads are faster
    return {1: 0.058, 2: 0.035}[threads]


def busy(threads: int) -> float:  # a busy loop on one of the two cores: one thread is faster
    return {1: 0.060, 2: 0.148}[threads]


def test_on_a_quiet_machine_it_keeps_every_thread_and_probes_ever_less_often():
    tuner = ThreadTuner(2)
    used = run_steps(tuner, 2000, quiet)
    assert tuner.threads == 2 and tuner.switches == 0
    probes = used.count(1)
    assert 0 < probes <= 4 * (2000 // 256 + 4)  # probes back off to one every 256 steps
    assert tuner.interval == tuner.max_interval


def test_a_busy_neighbour_moves_it_to_fewer_threads_and_back_when_it_leaves():
    tuner = ThreadTuner(2)
    run_steps(tuner, 100, quiet)
    assert tuner.threads == 2
    used = run_steps(tuner, 300, busy)
    assert tuner.threads == 1
    assert used[-100:].count(1) >= 90  # the slow count only in an occasional probe
    run_steps(tuner, 600, quiet)
    assert tuner.threads == 2 and tuner.switches == 2


def test_small_differences_within_the_margin_do_not_move_it():
    tuner = ThreadTuner(2)
    run_steps(tuner, 1000, lambda threads: 0.050 if threads == 1 else 0.051)
    assert tuner.threads == 2 and tuner.switches == 0


def test_probes_are_compared_only_with_steps_of_the_same_shape():
    """A probe of prompt steps (many tokens, slow whatever the count) says nothing against decode
    steps of another shape: no move."""
    tuner = ThreadTuner(2)
    run_steps(tuner, 40, quiet, shape=16)
    for _ in range(100):
        threads = tuner.next_threads()
        shape = 16 if threads == 2 else 512
        tuner.record(threads, shape, 0.001 if threads == 1 else 0.035)
    assert tuner.threads == 2 and tuner.switches == 0


def test_on_many_cores_it_walks_down_one_thread_at_a_time_while_that_pays():
    tuner = ThreadTuner(8)
    # Four of the eight cores are busy: four threads step fastest, more or fewer lose.
    run_steps(tuner, 2000, lambda threads: 0.010 * (1 + abs(threads - 4) / 2))
    assert tuner.threads == 4


def test_one_thread_is_never_probed_against_another():
    tuner = ThreadTuner(1)
    assert set(run_steps(tuner, 500, lambda threads: 0.01)) == {1}
    with pytest.raises(ValueError, match="at least 1"):
        ThreadTuner(0)


@pytest.mark.parametrize(("bind", "cpus", "torch_threads", "start", "most"), [
    ("none", (0, 1), 2, 2, 2),  # unbound: torch's default count
    ("none", tuple(range(16)), 16, 16, 16),
    ("auto", (0, 1), 2, 2, 2),  # CPU 0 kept for the server, one compute CPU; CPU 0 borrowable, from the start
    ("auto", tuple(range(16)), 16, 16, 16),
    ("auto", (0,), 1, 1, 1),  # one CPU: nothing bound
    ("2-3,7", tuple(range(8)), 8, 3, 3),  # a list: one thread per listed CPU, nothing borrowed
    ("none", (0, 1, 2, 3), 3, 3, 3),  # OMP_NUM_THREADS=3 (torch's count) on four CPUs
])
def test_the_threads_a_step_starts_on_and_may_use_on_each_layout(bind, cpus, torch_threads, start, most):
    tuner = thread_tuner_for(parse_cpu_threads_bind(bind, cpus), torch_threads)
    assert (tuner.threads, tuner.max_threads) == (start, most)


def test_auto_starts_on_the_borrowable_cpu_too_and_a_busy_server_takes_it_back_within_the_first_probe():
    """`auto` on two CPUs starts with two threads, one on the server's CPU (idle before anything is
    served); while the server keeps that CPU busy, the first probe moves the steps off it. From one
    thread (a tuner started there), a quiet server's CPU is taken."""
    auto = thread_tuner_for(parse_cpu_threads_bind("auto", (0, 1)), 2)
    used = run_steps(auto, 200, busy)
    assert auto.threads == 1 and auto.switches == 1
    assert used.index(1) <= auto.min_interval / (busy(2) / STEP_UNIT) + 1  # the first probe, in weighted steps
    borrowing = ThreadTuner(2, start=1)
    used = run_steps(borrowing, 40, quiet)
    assert used[0] == 1 and borrowing.threads == 2
    with pytest.raises(ValueError, match="start must be between 1 and max_threads"):
        ThreadTuner(2, start=3)


def test_long_prompt_steps_count_for_their_time_so_the_first_probe_comes_after_one_of_them():
    """Prompt chunks that take seconds each: the probe of the borrowable CPU comes after the first
    and is judged on one step; the probe back, one step too, costs so much that the next is ages away."""
    def prompt_chunk(threads: int) -> float:
        return {1: 10.0, 2: 5.5}[threads]

    tuner = ThreadTuner(2, start=1)
    used = run_steps(tuner, 6, prompt_chunk, shape=2048)
    assert used == [1, 2, 2, 1, 2, 2] and tuner.threads == 2
    assert set(run_steps(tuner, 60, prompt_chunk, shape=2048)) == {2}


def test_a_burst_counts_its_decodes_so_the_first_probe_comes_after_as_many_decodes_as_steps():
    """Decode bursts of 32 (one call each, a few ms on a small model): the first probe follows the
    first 32 decodes, as it would one decode a call, not 32 bursts (~1,000 tokens) into the run;
    one burst is a whole probe."""
    def burst(threads: int) -> float:  # 32 decodes: two threads lose on this machine
        return {1: 0.024, 2: 0.032}[threads]

    tuner = ThreadTuner(2)
    used = []
    for _ in range(24):
        threads = tuner.next_threads()
        used.append(threads)
        tuner.record(threads, (32, 32), burst(threads), steps=32)
    # The probe of one thread wins at the second burst; the probe back, 32 decodes later, loses and
    # costs a third of a burst's 32 steps, so the next waits ~500 decodes (2% of the time).
    assert used[:6] == [2, 1, 1, 2, 1, 1] and tuner.threads == 1
    assert used[6:].count(2) == 1 and used.index(2, 4) > 16


def test_a_hopeless_probe_ends_after_one_step_and_the_next_waits_until_its_cost_is_small():
    """Two threads beside a busy neighbour can be 100x slower (an OpenMP barrier waits out the
    neighbour's time slice): once on one thread, probing two may cost at most a few per cent."""
    def seconds(threads: int) -> float:
        return {1: 0.003, 2: 0.300}[threads]

    tuner = ThreadTuner(2)
    run_steps(tuner, 40, seconds)
    assert tuner.threads == 1
    used = run_steps(tuner, 20000, seconds)
    probe_time = used.count(2) * seconds(2)
    assert 0 < used.count(2) <= 10
    assert probe_time / sum(map(seconds, used)) < 0.05


def test_a_neighbour_arriving_after_a_long_quiet_spell_is_answered_within_a_few_steps():
    """Probes have backed off to one every 256 steps; the first steps that run several times
    slower bring the next probe forward."""
    tuner = ThreadTuner(2)
    run_steps(tuner, 3000, quiet)
    assert tuner.interval == tuner.max_interval

    def busy_and_hopeless(threads: int) -> float:
        return {1: 0.003, 2: 0.300}[threads]

    used = run_steps(tuner, 20, busy_and_hopeless)
    assert tuner.threads == 1
    assert used[:3].count(2) >= 1 and used.count(2) <= 2


@pytest.mark.parametrize(("options", "line"), [
    ({"cpu_layout": parse_cpu_threads_bind("1-2", (0, 1, 2))},
     "compute threads on CPUs 1,2, event loop on CPUs 0; each step 1-2 compute threads, whichever steps fastest"),
    ({"cpu_layout": parse_cpu_threads_bind("auto", (0, 1))},  # one compute CPU, and the server's lent
     "compute threads on CPUs 1, event loop on CPUs 0; each step 1-2 compute threads, whichever steps fastest, "
     "the last on CPUs 0 of the event loop's, lent while that is faster"),
    ({"cpu_layout": parse_cpu_threads_bind("auto", (0, 1)), "adaptive_cpu_threads": False},  # nothing lent
     "compute threads on CPUs 1, event loop on CPUs 0, 1 compute threads (one per compute CPU)"),
    ({"adaptive_cpu_threads": False}, "not bound (--cpu-threads-bind none), N compute threads (torch's default)"),
])
def test_the_start_up_line_says_how_many_threads_a_step_gets(options, line):
    import torch

    from engine.config import EngineConfig
    from web.http.startup import _cpus_line

    assert _cpus_line(EngineConfig(model="m", **options)).startswith(line.replace("N", str(torch.get_num_threads())))


def test_serve_defaults_to_vllm_cpus_layout_with_adaptive_threads_and_both_can_be_turned_off():
    from engine.cpu_binding import available_cpus
    from web.cli import _parser
    from web.options import engine_config

    default = engine_config("m", _parser().parse_args(["serve", "m"]))
    assert default.cpu_layout == parse_cpu_threads_bind("auto", available_cpus())
    assert default.adaptive_cpu_threads is True
    fixed = engine_config("m", _parser().parse_args(["serve", "m", "--cpu-threads-bind", "none",
                                                     "--no-adaptive-cpu-threads"]))
    assert fixed.cpu_layout is None and fixed.adaptive_cpu_threads is False


@pytest.mark.parametrize("adaptive", [True, False])
async def test_the_worker_times_every_step_for_its_tuner_unless_the_count_is_fixed(tiny_model_dir, adaptive):
    from engine import open_engine
    from tests.conftest import engine_config
    from tests.helpers import final_output, greedy

    async with open_engine(engine_config(tiny_model_dir, adaptive_cpu_threads=adaptive)) as engine:
        await final_output(engine, [5, 6, 7], greedy(20, ignore_eos=True))
        await engine.core.wait_until_idle()  # the last step's token is out before its thread returns
        tuner = engine.core.executor.worker.thread_tuner
        steps = engine.core.num_steps  # a decode burst (the CPU default) is one step of the core's
    if adaptive:
        assert tuner is not None and tuner.steps == steps >= 2
    else:
        assert tuner is None
