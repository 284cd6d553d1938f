"""`trio-llm bench structured`: JSON-schema-constrained generation against unconstrained, and the
event loop while grammars compile, in one run on the default model.

- throughput: output tokens/s at each concurrency, unconstrained and constrained to a JSON schema
  (an array of short strings), `--output-len` tokens each in both (ignore_eos: once a JSON
  answer closes, its mask allows only EOS, and the request goes on), so both keep the same batch
  and the difference is the constraint's cost per token; round by round, the best of each kept.
- the budget: the same with a schema of unbounded numbers and strings (`UNBOUNDED`), whose
  answers run to `--output-len` unless the budget plan closes them in time; the table says how
  many of them parse.
- loop lag: the engine's loop-lag probe (every 5 ms) while 16 requests with 16 distinct schemas
  compile and run, against 16 unconstrained requests: p99 of each.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import anyio
import trio

from engine.api import EngineConfig, SamplingParams, ensure_default_model, open_engine
from engine.core.stats import NullObserver
from engine.sampling_params import RequestOutputKind
from engine.structured_outputs import StructuredOutputs
from web.chat.tools import is_json

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["items"],
          "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 12}}}}


UNBOUNDED = {"type": "object", "required": ["id", "score", "name", "tags"],
             "properties": {"id": {"type": "integer"}, "score": {"type": "number"}, "name": {"type": "string"},
                            "tags": {"type": "array", "items": {"type": "string"}}}}


def distinct_schema(i: int) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "required": [f"field_{i}", "n"],
            "properties": {f"field_{i}": {"type": "string", "maxLength": 8 + i}, "n": {"type": "integer"}}}


class Lags(NullObserver):
    def __init__(self) -> None:
        self.lags: list[float] = []

    def on_loop_lag(self, lag: float) -> None:
        self.lags.append(lag)


async def _run_batch(engine: Any, params: list[SamplingParams], texts: list[str] | None = None) -> tuple[int, float]:
    produced = 0

    async def one(p: SamplingParams) -> None:
        nonlocal produced
        async for output in engine.generate("Give me a list:", p):
            produced += len(output.outputs[0].token_ids)
        if texts is not None:
            texts.append(output.outputs[0].text)

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for p in params:
            tg.start_soon(one, p)
    return produced, time.perf_counter() - started



def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0


async def run_all(model: str, concurrencies: list[int], output_len: int, rounds: int) -> list[str]:
    lags = Lags()
    config = EngineConfig(model=model, max_num_seqs=64, loop_lag_interval=0.005)
    lines = ["| concurrency | unconstrained tok/s | JSON schema tok/s | ratio | unbounded JSON tok/s | ratio | "
             "unbounded answers that parse |", "| --- | --- | --- | --- | --- | --- | --- |"]
    async with open_engine(config, observer=lags) as engine:
        free = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=1.0,
                              output_kind=RequestOutputKind.FINAL_ONLY)
        constrained = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=1.0,
                                     output_kind=RequestOutputKind.FINAL_ONLY,
                                     structured_outputs=StructuredOutputs(json=SCHEMA))
        unbounded = SamplingParams(max_tokens=output_len, temperature=1.0, output_kind=RequestOutputKind.FINAL_ONLY,
                                   structured_outputs=StructuredOutputs(json=UNBOUNDED))
        await _run_batch(engine, [constrained, free, unbounded])  # warm up (and compile the schemas once)
        for concurrency in concurrencies:
            best = {"free": 0.0, "json": 0.0, "unbounded": 0.0}
            answers: list[str] = []
            for _ in range(rounds):
                for name, params in (("free", free), ("json", constrained), ("unbounded", unbounded)):
                    seeded = [SamplingParams(**{**params.__dict__, "seed": s}) for s in range(concurrency)]
                    tokens, seconds = await _run_batch(engine, seeded, answers if name == "unbounded" else None)
                    best[name] = max(best[name], tokens / seconds)
            parsed = sum(is_json(text) for text in answers)
            lines.append(f"| {concurrency} | {best['free']:.0f} | {best['json']:.0f} | "
                         f"{best['json'] / best['free']:.2f} | {best['unbounded']:.0f} | "
                         f"{best['unbounded'] / best['free']:.2f} | {parsed} of {len(answers)} |")
        lag_rows = []
        for name, batch in (
                ("16 unconstrained requests", [free] * 16),
                ("16 requests, 16 distinct schemas compiling", [
                    SamplingParams(max_tokens=32, temperature=1.0, output_kind=RequestOutputKind.FINAL_ONLY,
                                   structured_outputs=StructuredOutputs(json=distinct_schema(i))) for i in range(16)])):
            lags.lags.clear()
            await _run_batch(engine, batch)
            lag_rows.append(f"| {name} | {statistics.median(lags.lags) * 1e3:.2f} | {_p99(lags.lags) * 1e3:.2f} | "
                            f"{len(lags.lags)} |")
    return lines + ["", "| event loop while | lag p50 ms | lag p99 ms | probes |", "| --- | --- | --- | --- |",
                    *lag_rows]


def run(model: str | None, concurrencies: list[int], output_len: int, rounds: int) -> str:
    model_path = model or str(ensure_default_model())
    lines = trio.run(run_all, model_path, concurrencies, output_len, rounds)
    return "\n".join([f"model {model_path}; {output_len} output tokens at most; best of {rounds} rounds", *lines])
