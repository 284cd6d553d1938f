"""`trio-llm bench embed`: /v1/embeddings throughput against the bare model, in one run.

N sentences of about 20 words (drawn deterministically from the shipped
corpus). Offline: the bare encoder (no engine, no server) in batches of 32:
tokenize, pad, forward, pool, normalize. Server: a `trio-llm serve` child
process, one sentence per request, `concurrency` requests in flight, through
a thin trio-socket client holding one kept-alive connection per concurrent
stream of requests. Rounds alternate; the best of each is reported,
with the server's event-loop lag (its `trio_llm_event_loop_lag_seconds`
histogram, scraped before and after each server round).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import resources

import trio

from bench import http
from bench.http import RawResponse


def make_sentences(count: int, words: int = 20, seed: int = 0) -> list[str]:
    text = resources.files("engine").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    vocabulary = [w for w in text.split() if w.isalpha()]
    rng = random.Random(seed)
    return [" ".join(rng.choice(vocabulary) for _ in range(words)) + "." for _ in range(count)]


def offline_rate(model_dir: str, sentences: list[str], batch: int) -> float:
    """Sentences per second through the bare model."""
    import torch
    import torch.nn.functional as F

    from engine.models.hf_config import read_config_json
    from engine.models.loader import load_encoder
    from engine.models.pooler import read_pooler_config
    from engine.render.tokenizer import Tokenizer
    model = load_encoder(model_dir)
    pooler = read_pooler_config(model_dir, read_config_json(model_dir), default_pooling="cls")
    tokenizer = Tokenizer(model_dir)
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(sentences), batch):
            ids = tokenizer.encode_batch(sentences[i:i + batch])
            lengths = torch.tensor([len(x) for x in ids])
            padded = torch.zeros(len(ids), int(lengths.max()), dtype=torch.long)
            for row, x in enumerate(ids):
                padded[row, :len(x)] = torch.tensor(x)
            hidden = model(padded, torch.zeros_like(padded), lengths)
            mask = (torch.arange(padded.shape[1])[None, :] < lengths[:, None]).unsqueeze(-1)
            pooled = (hidden * mask).sum(1) / lengths[:, None] if pooler.pooling == "mean" else hidden[:, 0]
            F.normalize(pooled.float(), dim=-1)
    return len(sentences) / (time.perf_counter() - start)


async def _get(url: str, path: str) -> RawResponse:
    return await http.request(url, "GET", path)


def _lag_histogram(metrics: bytes) -> dict[str, float]:
    out = {}
    for line in metrics.decode().splitlines():
        if line.startswith("trio_llm_event_loop_lag_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            out[le] = float(line.rsplit(" ", 1)[1])
        elif line.startswith(("trio_llm_event_loop_lag_seconds_sum", "trio_llm_event_loop_lag_seconds_count")):
            out[line.split("{")[0].split(" ")[0].rsplit("_", 1)[1]] = float(line.rsplit(" ", 1)[1])
    return out


@dataclass
class ServerRound:
    rate: float
    lag_mean: float
    lag_p99_bucket: str
    lag_samples: int


async def server_round(url: str, sentences: list[str], concurrency: int) -> ServerRound:
    before = _lag_histogram((await _get(url, "/metrics")).body)
    queue = iter(sentences)

    async def client() -> None:
        connection = await http.Connection.open(url)
        try:
            for sentence in queue:
                response = await connection.post("/v1/embeddings", json.dumps({"input": sentence}).encode())
                if response.status != 200:
                    raise RuntimeError(f"request failed: {response.status} {response.body[:200]!r}")
        finally:
            await connection.aclose()

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(client)
    rate = len(sentences) / (time.perf_counter() - start)
    after = _lag_histogram((await _get(url, "/metrics")).body)
    count = after.get("count", 0) - before.get("count", 0)
    mean = (after.get("sum", 0) - before.get("sum", 0)) / count if count else float("nan")
    buckets = sorted((float("inf") if le == "+Inf" else float(le), after[le] - before.get(le, 0))
                     for le in after if le not in ("sum", "count"))
    p99 = next((le for le, n in buckets if n >= 0.99 * count), float("inf"))
    return ServerRound(rate, mean, f"<= {p99 * 1e3:g} ms", int(count))


async def run(model_dir: str, count: int, concurrency: int, batch: int, rounds: int, port: int) -> str:
    sentences = make_sentences(count)
    command = [sys.executable, "-m", "web.cli", "serve", model_dir, "--host", "127.0.0.1", "--port", str(port),
               "--max-num-seqs", "256"]
    server = await trio.lowlevel.open_process(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        with trio.fail_after(180):
            while True:
                try:
                    if (await _get(url, "/health")).status == 200:
                        break
                except OSError:
                    pass
                await trio.sleep(0.2)  # polling a child process's readiness: nothing to wait on instead
        offline, online = [], []
        for _ in range(rounds):
            offline.append(await trio.to_thread.run_sync(offline_rate, model_dir, sentences, batch))
            online.append(await server_round(url, sentences, concurrency))
    finally:
        server.send_signal(signal.SIGINT)
        with trio.CancelScope(shield=True):
            await server.wait()
    best = max(online, key=lambda r: r.rate)
    lines = [f"{count} sentences of ~20 words, {os.path.basename(model_dir.rstrip('/'))}, {rounds} rounds",
             f"offline bare model, batches of {batch}: " + ", ".join(f"{r:.1f}" for r in offline) + " sentences/s",
             f"server /v1/embeddings, concurrency {concurrency}: " + ", ".join(f"{r.rate:.1f}" for r in online)
             + " sentences/s",
             f"best server / best offline: {best.rate / max(offline):.3f} (target >= 0.8)",
             f"server loop lag during the best round: mean {best.lag_mean * 1e3:.2f} ms, p99 {best.lag_p99_bucket} "
             f"({best.lag_samples} probe samples)"]
    return "\n".join(lines)
