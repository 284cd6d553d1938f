"""--gpu-memory-utilization (engine/worker/gpu_memory.py): the arithmetic, and the start-up path
from the config to the KV cache's size, with the card's numbers from a fake probe. The profile
forward passes themselves run for real, on CPU."""

from __future__ import annotations

import pytest

from engine import EngineConfig, open_engine
from engine.config import CompilationConfig
from engine.errors import ModelLoadError
from engine.worker import worker
from engine.worker.cuda_graphs import CallThrough
from engine.worker.gpu_memory import MemoryProfile, kv_cache_budget, measure
from engine.worker.worker import Worker
from tests.conftest import engine_config

GIB = 1 << 30


def test_the_kv_cache_gets_what_the_share_leaves_after_weights_activations_graphs_and_the_rest():
    profile = MemoryProfile(total=80 * GIB, weights=16 * GIB, activations=2 * GIB, graphs=GIB // 2, other=GIB)
    assert kv_cache_budget(profile, 0.9) == int(72 * GIB) - 16 * GIB - 2 * GIB - GIB // 2 - GIB
    with pytest.raises(ModelLoadError) as refused:
        kv_cache_budget(profile, 0.2)
    line = str(refused.value)
    assert "\n" not in line and "--gpu-memory-utilization 0.2 allows 16.00 of 80.00 GiB" in line
    assert "weights 16.00 GiB, activations 2.00 GiB, CUDA graphs 0.50 GiB, outside torch 1.00 GiB" in line


class FakeCard:
    """A card of `total` bytes holding `weights` in torch tensors and `other` outside torch; each
    profiled run peaks `extra[i]` bytes above the weights. Runs what it is given."""

    def __init__(self, total: int, weights: int, other: int, extra: list[int]) -> None:
        self.total, self.weights, self.other, self.extra = total, weights, other, list(extra)
        self.runs = 0

    def card(self) -> tuple[int, int]:
        return self.total - self.weights - self.other, self.total

    def reserved(self) -> int:
        return self.weights

    def allocated(self) -> int:
        return self.weights

    def peak_while(self, run) -> int:
        run()
        self.runs += 1
        return self.weights + self.extra.pop(0)


def test_a_profile_reads_the_weights_then_each_runs_peak_and_what_is_outside_torch():
    card = FakeCard(total=100, weights=30, other=5, extra=[20, 8])
    assert measure(card, lambda: None, lambda: None) == MemoryProfile(100, 30, 20, 8, 5)
    assert measure(FakeCard(100, 30, 5, [20]), lambda: None, None).graphs == 0


@pytest.fixture
def on_a_fake_card(monkeypatch):
    """Engines size their KV cache as on CUDA (a profile run), on a fake card, the model on CPU."""
    cards: list[FakeCard] = []

    def card_for(self) -> FakeCard:
        return cards[-1]

    monkeypatch.setattr(EngineConfig, "measures_kv_cache",
                        property(lambda self: self.kv_cache_memory_bytes is None))
    monkeypatch.setattr(Worker, "_memory_probe", card_for)
    monkeypatch.setattr(Worker, "_captures_graphs", lambda self: True)
    monkeypatch.setattr(worker, "CudaGraphCapture", CallThrough)
    return cards


async def test_the_engine_sizes_its_kv_cache_by_the_utilization_after_a_profile_run(tiny_model_dir, on_a_fake_card):
    """Both profile runs (the largest step, the largest decode graph) run the model, and the cache
    holds what 0.5 of the card leaves; --kv-cache-memory-bytes, given, wins without a profile."""
    card = FakeCard(total=64 << 20, weights=4 << 20, other=2 << 20, extra=[3 << 20, 1 << 20])
    on_a_fake_card.append(card)
    # mode 0: the graphs capture the eager model (compiling it is tests/test_cuda_graphs.py's matter)
    config = engine_config(tiny_model_dir, num_kv_blocks=None, gpu_memory_utilization=0.5, enforce_eager=False,
                           compilation_config=CompilationConfig(mode=0))
    async with open_engine(config) as engine:
        expected = ((32 << 20) - (4 << 20) - (3 << 20) - (1 << 20) - (2 << 20)) // engine.info.kv_bytes_per_block
        assert card.runs == 2 and engine.info.num_kv_blocks == expected
    on_a_fake_card.append(FakeCard(total=64 << 20, weights=0, other=0, extra=[]))
    given = engine_config(tiny_model_dir, num_kv_blocks=None, kv_cache_memory_bytes=8 << 20)
    async with open_engine(given) as engine:
        assert engine.info.num_kv_blocks == (8 << 20) // engine.info.kv_bytes_per_block
    assert on_a_fake_card[-1].runs == 0


async def test_a_card_too_small_fails_start_up_in_one_line_naming_the_numbers(tiny_model_dir, on_a_fake_card):
    on_a_fake_card.append(FakeCard(total=16 << 20, weights=6 << 20, other=1 << 20, extra=[2 << 20]))
    config = engine_config(tiny_model_dir, num_kv_blocks=None, gpu_memory_utilization=0.5)
    with pytest.raises(ModelLoadError, match=r"no GPU memory left for the KV cache: --gpu-memory-utilization 0.5 "
                                             r"allows 0.01 of 0.02 GiB"):
        async with open_engine(config):
            pass
