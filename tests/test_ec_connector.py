"""The EC connector: encoder outputs through a shared directory, non-blocking deferral in the
scheduler, the deferral deadline, damaged files, and start-up errors."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import trio

from engine import EngineConfig, SamplingParams, open_engine
from engine import testing as probes
from engine.config import ECTransferConfig
from engine.ec.connector import ECConnectorGate, SharedStorageConnector
from engine.ec.storage import entry_path, save_rows
from engine.errors import RequestFailedError
from engine.mm_features import ImageFeature
from engine.render.image import ImageProcessorConfig, decode_image, mm_hash
from engine.sched.block_manager import KVBlockManager
from engine.sched.request import Request, RequestStatus
from engine.sched.scheduler import Scheduler, SchedulerConfig
from engine.testing import FakeExecutor
from tests.multimodal_helpers import ROWS, data_url, image_message, make_tiny_llava, png_bytes, random_image
from web.cli import main

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return make_tiny_llava(tmp_path_factory.mktemp("models") / "tiny-llava")[0]


def ec(role: str, root: Path) -> ECTransferConfig:
    return ECTransferConfig("shared_storage", role, {"shared_storage_path": str(root)})


def image_hash(model_dir: Path, image) -> str:
    return mm_hash(decode_image(png_bytes(image), 1 << 24), ImageProcessorConfig.from_model_dir(model_dir))


async def chat_once(engine, messages) -> object:
    return [o async for o in engine.chat(messages, GREEDY)][-1]


# ---- the scheduler with the gate (sync, a store in a temp directory) ----------------------------
def gated_scheduler(root: Path) -> tuple[Scheduler, SharedStorageConnector]:
    connector = SharedStorageConnector(ec("ec_consumer", root), 5.0, wake=lambda: None)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, encoder_budget_rows=64,
                             encoder_cache_rows=64)
    scheduler = Scheduler(config, KVBlockManager(64, 4, enable_prefix_caching=False), [ECConnectorGate(connector)],
                          external=connector)
    connector.has_local = scheduler.encoder_cache.has
    return scheduler, connector


def image_request(rid: str, hashes: list[str]) -> Request:
    tokens, features = [1, 2], []
    for h in hashes:
        features.append(ImageFeature(h, len(tokens), 10))
        tokens += [9] * 10 + [3]
    return Request(rid, tokens, SamplingParams(max_tokens=2), max_tokens=2, mm_features=features)


def test_a_deferred_request_allocates_nothing_and_the_text_behind_it_runs(tmp_path):
    scheduler, connector = gated_scheduler(tmp_path)
    save_rows(tmp_path, "aa11", torch.zeros(10, 4))
    scheduler.add_request(image_request("img", ["aa11"]))
    scheduler.add_request(Request("text", list(range(40)), SamplingParams(max_tokens=2), max_tokens=2))
    out = scheduler.schedule()
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("text", 40)]  # its full share of the budget
    assert scheduler.kv.block_ids("img") == [] and connector.deferrals == 1
    assert list(scheduler.waiting)[0].request_id == "img"  # back at the front, its place kept
    out = scheduler.schedule()  # still loading: asked again, deferred again, no second load
    assert connector.deferrals == 2 and connector._inbox.statistics().current_buffer_used == 1
    connector._loaded["aa11"] = torch.ones(10, 4)  # the load task finished
    connector._pending.discard("aa11")
    out = scheduler.schedule()
    assert "img" in [s.request_id for s in out.scheduled]
    assert list(out.ec_loads) == ["aa11"] and out.encoder_inputs == {}  # loaded, not encoded
    assert connector.loads == 1 and connector.loaded("aa11") is None


def test_only_images_from_num_computed_tokens_on_are_asked_about(tmp_path):
    scheduler, connector = gated_scheduler(tmp_path)
    for h in ("bb22", "cc33"):
        save_rows(tmp_path, h, torch.zeros(10, 4))
    request = image_request("r", ["bb22", "cc33"])
    request.num_computed_tokens = 13  # past the first image (positions 2..11)
    assert not connector.ensure_cache_available(request, request.num_computed_tokens)
    assert connector._pending == {"cc33"}


def test_images_the_store_lacks_are_encoded_locally(tmp_path):
    scheduler, connector = gated_scheduler(tmp_path)
    scheduler.add_request(image_request("r", ["dd44"]))
    out = scheduler.schedule()
    assert out.encoder_inputs == {"r": [0]} and connector.deferrals == 0


def test_an_abort_while_deferred_leaves_nothing_behind(tmp_path):
    scheduler, connector = gated_scheduler(tmp_path)
    save_rows(tmp_path, "ee55", torch.zeros(10, 4))
    scheduler.add_request(image_request("r", ["ee55"]))
    scheduler.schedule()
    scheduler.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_work() and scheduler.requests == {}
    assert scheduler.schedule().is_empty


# ---- engines --------------------------------------------------------------------------------
async def test_producer_to_consumer_through_the_shared_directory(llava, tmp_path):
    image = random_image(seed=7)
    messages = image_message(data_url(png_bytes(image)))
    base = EngineConfig(model=str(llava), num_kv_blocks=64)
    async with open_engine(base) as single:
        expected = await chat_once(single, messages)
    async with open_engine(replace(base, ec_transfer_config=ec("ec_producer", tmp_path))) as producer:
        await chat_once(producer, messages)
    assert entry_path(tmp_path, image_hash(llava, image)).is_file()
    assert not list(tmp_path.glob(".*"))  # no temporary file left
    async with open_engine(replace(base, ec_transfer_config=ec("ec_consumer", tmp_path))) as consumer:
        got = await chat_once(consumer, messages)
        assert await consumer.core.executor.collective_rpc(probes.encoder_runs) == [0]  # never ran the encoder
        stats = consumer.stats()
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert stats.ec_connector_loads == 1 and stats.mm_encoder_runs == 0


async def test_a_damaged_store_entry_falls_back_to_local_encoding(llava, tmp_path):
    image = random_image(seed=8)
    entry_path(tmp_path, image_hash(llava, image)).write_bytes(b"\x00" * 100)  # truncated garbage
    config = EngineConfig(model=str(llava), num_kv_blocks=64, ec_transfer_config=ec("ec_consumer", tmp_path))
    async with open_engine(config) as engine:
        output = await chat_once(engine, image_message(data_url(png_bytes(image))))
        assert await engine.core.executor.collective_rpc(probes.encoder_runs) == [1]
    assert len(output.outputs[0].token_ids) == 8


def fake_vision_executor() -> FakeExecutor:
    executor = FakeExecutor(step_time=0.01, vocab_size=520)
    executor.info = replace(executor.info, image_token_id=512, image_rows=ROWS)
    return executor


async def test_under_mock_clock_a_slow_load_defers_only_its_request(llava, tmp_path, autojump_clock):
    image = random_image(seed=9)
    save_rows(tmp_path, image_hash(llava, image), torch.zeros(ROWS, 64))
    loads = []

    async def slow_loader(path):
        loads.append(trio.current_time())
        await trio.sleep(5)  # five virtual seconds
        return torch.zeros(ROWS, 64)

    config = EngineConfig(model=str(llava), num_kv_blocks=64, ec_transfer_config=ec("ec_consumer", tmp_path))
    finished = {}
    async with open_engine(config, executor=fake_vision_executor(), ec_loader=slow_loader) as engine:
        async def run(name, messages):
            await chat_once(engine, messages)
            finished[name] = trio.current_time()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "image", image_message(data_url(png_bytes(image))))
            for i in range(3):
                nursery.start_soon(run, f"text{i}", [{"role": "user", "content": f"just text {i}"}])
        stats = engine.stats()
    start = loads[0]
    assert all(finished[f"text{i}"] - start < 1 for i in range(3))  # text flowed while the image loaded
    assert 5 <= finished["image"] - start < 6  # deferred exactly until the load ended, then served
    assert stats.ec_deferrals >= 1 and stats.ec_connector_loads == 1 and stats.mm_encoder_runs == 0


async def test_the_deferral_deadline_fails_only_that_request(llava, tmp_path, autojump_clock):
    image = random_image(seed=10)
    save_rows(tmp_path, image_hash(llava, image), torch.zeros(ROWS, 64))

    async def stuck_loader(path):
        await trio.sleep_forever()

    config = EngineConfig(model=str(llava), num_kv_blocks=64, ec_transfer_config=ec("ec_consumer", tmp_path),
                          ec_defer_timeout=2.0)
    async with open_engine(config, executor=fake_vision_executor(), ec_loader=stuck_loader) as engine:
        with pytest.raises(RequestFailedError, match="--ec-defer-timeout"):
            await chat_once(engine, image_message(data_url(png_bytes(image))))
        assert trio.current_time() >= 2.0
        text = await chat_once(engine, [{"role": "user", "content": "still here"}])
        assert len(text.outputs[0].token_ids) == 8


@pytest.mark.parametrize("value, key", [
    ('{"ec_connector": "nixl"}', "ec_connector"),
    ('{"ec_role": "leader", "ec_connector_extra_config": {"shared_storage_path": "/tmp/x"}}', "ec_role"),
    ('{"ec_connector_extra_config": {}}', "shared_storage_path"),
    ('{"ec_buffer_device": "cuda"}', "ec_buffer_device"),
    ("not json", "not valid JSON"),
])
def test_a_bad_ec_transfer_config_is_one_line_at_start_up(llava, capsys, value, key):
    assert main(["serve", str(llava), "--port", "0", "--ec-transfer-config", value]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err, err
