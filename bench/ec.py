"""`trio-llm bench ec`: text requests beside image requests whose encoder outputs arrive through
the EC connector with a delay, three ways in one run, each on a fresh consumer engine:

- text only: the text requests alone (the floor to compare with);
- deferral: text + image requests; a request whose images are still loading is skipped for the
  step (`step_skipped_waiting`) and the requests behind it run;
- blocking: the same mix, but a request waiting for its images holds up everything behind it
  (the lookup "waits in place").

The store is filled first by a producer engine encoding the images for real; the consumer's
loads read those files after `--load-delay` seconds. Text requests arrive one every `--gap`
seconds in every variant (the same times), the image requests spread evenly among them.
Figures: text throughput (text output tokens over the time until the last text request
finished), text TTFT p50 / p90 (from each request's own arrival), and when the last image
request finished.
"""

from __future__ import annotations

import base64
import io
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import trio
from PIL import Image

from bench.models import cached_model
from engine.api import EngineConfig, SamplingParams, TinyModelSpec, make_model, open_engine
from engine.config import ECTransferConfig
from engine.ec.storage import load_rows
from engine.sampling_params import RequestOutputKind

SPEC = TinyModelSpec(arch="llava", layers=4, hidden=256, heads=4, kv_heads=2, intermediate=768, vocab=4096)


@dataclass
class Result:
    name: str
    text_tok_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    text_done_s: float
    images_done_s: float | None
    deferrals: int

    def row(self) -> str:
        images = "-" if self.images_done_s is None else f"{self.images_done_s:.2f}"
        return (f"| {self.name} | {self.text_tok_s:.0f} | {self.ttft_p50_ms:.0f} | {self.ttft_p90_ms:.0f} | "
                f"{self.text_done_s:.2f} | {images} | {self.deferrals} |")


def image_url(seed: int) -> str:
    pixels = (np.random.RandomState(seed).rand(64, 64, 3) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_messages(seed: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(seed)}},
                                         {"type": "text", "text": "describe the picture"}]}]


def text_messages(seed: int) -> list[dict[str, Any]]:
    words = random.Random(seed).choices(["the", "engine", "serves", "text", "while", "images", "load"], k=24)
    return [{"role": "user", "content": " ".join(words)}]


async def fill_store(model: str, root: Path, num_images: int) -> None:
    config = EngineConfig(model=model, num_kv_blocks=256,
                          ec_transfer_config=ECTransferConfig(ec_role="ec_producer",
                                                              ec_connector_extra_config={"shared_storage_path":
                                                                                         str(root)}))
    async with open_engine(config) as engine, anyio.create_task_group() as tg:
        for seed in range(num_images):
            tg.start_soon(_drain, engine, image_messages(seed), SamplingParams(max_tokens=1))


async def _drain(engine: Any, messages: list[dict[str, Any]], params: SamplingParams) -> None:
    async for _ in engine.chat(messages, params):
        pass


def arrivals(num_text: int, num_images: int, gap: float) -> list[tuple[float, str, int]]:
    """(seconds from start, kind, seed): text requests every `gap` seconds, whatever else arrives,
    so every variant sends its text at the same times; image requests spread evenly between them."""
    plan = [(i * gap, "text", i) for i in range(num_text)]
    span = num_text * gap
    plan += [((i + 0.5) * span / num_images, "image", i) for i in range(num_images)]
    return sorted(plan)


async def run_variant(name: str, model: str, root: Path, num_text: int, num_images: int, output_len: int,
                      delay: float, blocking: bool, gap: float, image_output_len: int) -> Result:
    async def slow_loader(path: Path) -> Any:
        await anyio.sleep(delay)
        return await anyio.to_thread.run_sync(load_rows, path)

    config = EngineConfig(model=model, num_kv_blocks=1024, max_num_seqs=64,
                          ec_transfer_config=ECTransferConfig(ec_role="ec_consumer",
                                                              ec_connector_extra_config={"shared_storage_path":
                                                                                         str(root)}))
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0,
                            output_kind=RequestOutputKind.DELTA)
    image_params = SamplingParams(max_tokens=image_output_len, ignore_eos=True, temperature=0.0)
    ttfts: list[float] = []
    text_done: list[float] = []
    images_done: list[float] = []
    async with open_engine(config, ec_loader=slow_loader, ec_blocking=blocking) as engine:
        await _drain(engine, text_messages(-1), SamplingParams(max_tokens=4))  # warm up
        started = time.perf_counter()

        async def text(seed: int) -> None:
            arrived, first = time.perf_counter(), True
            async for _ in engine.chat(text_messages(seed), params):
                if first:
                    ttfts.append(time.perf_counter() - arrived)
                    first = False
            text_done.append(time.perf_counter() - started)

        async def image(seed: int) -> None:
            await _drain(engine, image_messages(seed), image_params)
            images_done.append(time.perf_counter() - started)

        async with anyio.create_task_group() as tg:
            for at, kind, seed in arrivals(num_text, num_images, gap):
                await anyio.sleep(max(0.0, started + at - time.perf_counter()))
                tg.start_soon(image if kind == "image" else text, seed)
        deferrals = engine.stats().ec_deferrals
    ttfts.sort()
    return Result(name, num_text * output_len / max(text_done), statistics.median(ttfts) * 1e3,
                  ttfts[int(0.9 * (len(ttfts) - 1))] * 1e3, max(text_done), max(images_done) if images_done else None,
                  deferrals)


async def run_all(model: str, num_text: int, num_images: int, output_len: int, delay: float,
                  gap: float, image_output_len: int) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="trio-llm-ec-") as tmp:
        root = Path(tmp)
        await fill_store(model, root, num_images)
        common = (model, root, num_text)
        return [await run_variant("text only", *common, 0, output_len, delay, False, gap, image_output_len),
                await run_variant("deferral (non-blocking)", *common, num_images, output_len, delay, False, gap,
                                  image_output_len),
                await run_variant("blocking lookup", *common, num_images, output_len, delay, True, gap,
                                  image_output_len)]


def run(model: str | None, num_text: int, num_images: int, output_len: int, delay: float,
        gap: float, image_output_len: int) -> str:
    model_path = cached_model(model, "bench-llava", lambda path: make_model(path, SPEC))
    results = trio.run(run_all, model_path, num_text, num_images, output_len, delay, gap, image_output_len)
    lines = [f"model {model_path}; {num_text} text requests arriving one every {gap:g} s, {num_images} image "
             f"requests spread among them, {output_len} output tokens per text request and {image_output_len} per "
             f"image request; each image's encoder output arrives "
             f"{delay:g} s after it is asked for",
             "| variant | text tok/s | text TTFT p50 ms | text TTFT p90 ms | last text done s | last image done s | "
             "deferrals |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [r.row() for r in results]
    floor, deferral, blocking = results
    lines.append(f"text throughput with deferral: {deferral.text_tok_s / floor.text_tok_s:.1%} of text only, "
                 f"{deferral.text_tok_s / blocking.text_tok_s:.2f}x the blocking lookup's")
    return "\n".join(lines)
