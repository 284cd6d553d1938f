"""`trio-llm bench quantized`: decode tok/s of float32, bfloat16, int8 (weight-only), w8a8, int4 and q8_0 against
llama.cpp (llama-cpp-python's `Llama`) on the same weights as GGUF F32 and Q8_0, and against the
memory-bandwidth floor, in one run.

Like for like: one checkpoint (exported to GGUF for llama.cpp by bench/gguf_export.py), the same
random token prompts, the same output length (greedy, no early stop), the same thread count on
both sides, the sides alternating first in each of `repeats` rounds, the median printed. Our side
runs the compiled engine at 1 and 16 concurrent streams. llama-cpp-python's `Llama` runs one
sequence at a time (its server serves requests one after another), so its 16-stream figure is 16
requests back to back: what a client of its server gets. The floor is one token per weight read
at batch 1: the bytes of the weights over the measured memory bandwidth.

tok/s counts every output token over the whole request, the prompt's prefill included (a 32-token
prompt for 32 tokens out: int8's prefill is a fifth of its time, since torch's int8 kernel is slow
at 32 rows). The decode column times one stream from its first token to its last, on both sides:
the rate a decode step runs at, which is what quantized weights speed up.
"""

from __future__ import annotations

import multiprocessing
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import trio

from bench.gguf_export import export_gguf
from bench.roofline import read_bandwidth
from bench.throughput import BenchSpec, _engine_run
from engine.api.open import open_engine
from engine.config import EngineConfig
from engine.cpu_binding import available_cpus, parse_cpu_threads_bind
from engine.executor.inproc import InProcExecutor
from engine.models.hf_config import read_config_json
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.worker.worker import Worker

OURS = {"float32": ("float32", None), "bfloat16": ("bfloat16", None), "int8": ("float32", "int8"),
        "w8a8": ("float32", "w8a8"), "int4": ("float32", "int4"), "q8_0": ("float32", "q8_0")}
LLAMA_CPP = ("F32", "Q8_0")


@dataclass
class Side:
    name: str
    weight_bytes: int = 0
    rates: dict[int, list[float]] = field(default_factory=dict)  # streams -> tok/s per round
    decode_rates: list[float] = field(default_factory=list)  # one stream, after its first token, per round

    def median(self, streams: int) -> float:
        return statistics.median(self.rates[streams])


class OurEngine:
    """One loaded (and compiled) engine per variant, kept across rounds."""

    def __init__(self, model_dir: str, dtype: str, quantization: str | None, threads: int, max_seqs: int) -> None:
        self.config = EngineConfig(model=model_dir, dtype=dtype, quantization=quantization, max_num_seqs=max_seqs,
                                   cpu_layout=parse_cpu_threads_bind(",".join(map(str, range(threads))),
                                                                     available_cpus()),
                                   adaptive_cpu_threads=False, enforce_eager=False, executor="inproc")
        self.worker = Worker(self.config)
        self.executor = InProcExecutor(self.config, self.worker)

    def rate(self, prompts: list[list[int]], spec: BenchSpec) -> float:
        return trio.run(_engine_run, self.config, self.executor, prompts, spec)

    def decode_rate(self, prompt: list[int], output_len: int) -> float:
        """Tokens/s of one stream after its first token (the prompt's prefill excluded)."""
        return trio.run(_engine_decode_rate, self.config, self.executor, prompt, output_len)

    @property
    def weight_bytes(self) -> int:
        """What a decode step reads (engine/models/decoder.py `step_read_bytes`)."""
        return int(getattr(self.worker.model, "step_read_bytes", 0))


class LlamaCpp:
    """llama.cpp in a child process of its own, measured on request: loaded into our process, its
    threads slowed every variant of ours by 15-33% at one stream (docs/benchmarks.md)."""

    def __init__(self, gguf_path: Path, threads: int, context: int) -> None:
        self.weight_bytes = gguf_path.stat().st_size - embedding_bytes(gguf_path)
        spawn = multiprocessing.get_context("spawn")
        self._conn, child_end = spawn.Pipe()
        self._child = spawn.Process(target=_serve_llama_cpp, args=(child_end, gguf_path, threads, context),
                                    daemon=True)
        self._child.start()
        child_end.close()

    def _ask(self, method: str, *args: Any) -> float:
        self._conn.send((method, args))
        answer: float = self._conn.recv()
        return answer

    def rate(self, prompts: list[list[int]], spec: BenchSpec) -> float:
        return self._ask("rate", prompts, spec)

    def decode_rate(self, prompt: list[int], output_len: int) -> float:
        return self._ask("decode_rate", prompt, output_len)

    def close(self) -> None:
        self._conn.send(None)
        self._child.join(timeout=60)


def _serve_llama_cpp(conn: Any, gguf_path: Path, threads: int, context: int) -> None:
    """The child's loop: each (method, args) asked is answered with its figure; None ends it."""
    model = _LlamaCppModel(gguf_path, threads, context)
    while (request := conn.recv()) is not None:
        method, args = request
        conn.send(getattr(model, method)(*args))


class _LlamaCppModel:
    def __init__(self, gguf_path: Path, threads: int, context: int) -> None:
        from llama_cpp import Llama
        self.llm: Any = Llama(model_path=str(gguf_path), n_threads=threads, n_threads_batch=threads, n_ctx=context,
                         n_batch=context, verbose=False, seed=0)

    def rate(self, prompts: list[list[int]], spec: BenchSpec) -> float:
        """Each prompt's `output_len` greedy tokens, one request after another."""
        start = time.perf_counter()
        for prompt in prompts:
            self.llm.reset()
            for produced, _ in enumerate(self.llm.generate(prompt, temp=0.0, top_k=1, reset=True), 1):
                if produced == spec.output_len:
                    break
        return len(prompts) * spec.output_len / (time.perf_counter() - start)

    def decode_rate(self, prompt: list[int], output_len: int) -> float:
        """Tokens/s of one sequence after its first token (the prompt's prefill excluded)."""
        self.llm.reset()
        times = []
        for _ in self.llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            times.append(time.perf_counter())
            if len(times) == output_len:
                break
        return (len(times) - 1) / (times[-1] - times[0])


async def _engine_decode_rate(config: EngineConfig, executor: InProcExecutor, prompt: list[int],
                              output_len: int) -> float:
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0,
                            output_kind=RequestOutputKind.DELTA)
    times = []
    async with open_engine(config, executor=executor) as engine:
        async for out in engine.generate(prompt, params):
            times.extend([time.perf_counter()] * len(out.outputs[0].token_ids))
    assert len(times) == output_len, len(times)
    return (len(times) - 1) / (times[-1] - times[0])


def embedding_bytes(gguf_path: Path) -> int:
    """The bytes of a GGUF file's token table when an output tensor of its own exists (else the
    table is the output layer, read whole every step)."""
    from engine.models.gguf_file import gguf_reader
    tensors = {t.name: t for t in gguf_reader(str(gguf_path)).tensors}
    return int(tensors["token_embd.weight"].n_bytes) if "output.weight" in tensors else 0


def run(model_dir: str, streams: tuple[int, ...] = (1, 16), input_len: int = 32, output_len: int = 32,
        repeats: int = 3, threads: int = 2, with_llama_cpp: bool = True,
        variants: tuple[str, ...] = tuple(OURS)) -> tuple[list[Side], float, str]:
    torch.set_num_threads(threads)
    contenders: dict[str, OurEngine | LlamaCpp] = {}
    for name in ("float32", *variants) if "float32" not in variants else variants:  # float32: the ratios' base
        dtype, quantization = OURS[name]
        contenders[name] = OurEngine(model_dir, dtype, quantization, threads, max(streams))
    workdir = Path(tempfile.mkdtemp(prefix="trio-llm-gguf-"))
    if with_llama_cpp:
        for qtype in LLAMA_CPP:
            path = export_gguf(model_dir, workdir / f"model-{qtype}.gguf", qtype)
            contenders[f"llama.cpp {qtype}"] = LlamaCpp(path, threads, input_len + output_len + 8)
    vocab = int(read_config_json(model_dir)["vocab_size"])
    sides = {name: Side(name) for name in contenders}
    names = list(contenders)
    for level in streams:
        spec = BenchSpec(num_prompts=level, input_len=input_len, output_len=output_len, concurrency=level)
        rng = random.Random(level)
        prompts = [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(level)]
        for name in names:  # warm-up: load, compile each batch size once, fill caches
            contenders[name].rate(prompts[:level], BenchSpec(level, input_len, 2, level))
            sides[name].weight_bytes = contenders[name].weight_bytes
        for round_index in range(repeats):
            order = names if round_index % 2 == 0 else names[::-1]
            for name in order:
                sides[name].rates.setdefault(level, []).append(contenders[name].rate(prompts, spec))
                if level == 1:
                    sides[name].decode_rates.append(contenders[name].decode_rate(prompts[0], output_len))
    for contender in contenders.values():
        if isinstance(contender, LlamaCpp):
            contender.close()
    settings = (f"threads={threads} on both sides (llama.cpp in a process of its own), prompts of {input_len} random "
                f"tokens, {output_len} greedy output tokens each, median of {repeats} rounds alternating the order")
    return list(sides.values()), read_bandwidth(), settings


def report(sides: list[Side], bandwidth: float, settings: str, streams: tuple[int, ...] = (1, 16)) -> str:
    head = "| weights | MiB read a step | " + " | ".join(f"tok/s at {s}" for s in streams) + \
        " | decode tok/s at 1 (after the first token) | floor tok/s at 1 (bytes / bandwidth) | decode: share of floor |"
    lines = [settings, f"memory bandwidth (a large copy): {bandwidth / 1e9:.1f} GB/s", "", head,
             "| --- " * (len(streams) + 5) + "|"]
    float32 = next(x for x in sides if x.name == "float32")
    base = {s: float32.median(s) for s in streams}
    for side in sides:
        floor = bandwidth / side.weight_bytes if side.weight_bytes else float("nan")
        cells = [f"{side.median(s):.1f} ({side.median(s) / base[s]:.2f}x f32)" for s in streams]
        decode = statistics.median(side.decode_rates) if side.decode_rates else float("nan")  # 1 in streams
        cells.append(f"{decode:.1f} ({decode / statistics.median(float32.decode_rates or [decode]):.2f}x f32)")
        lines.append(f"| {side.name} | {side.weight_bytes / 2**20:.0f} | " + " | ".join(cells) +
                     f" | {floor:.1f} | {decode / floor:.2f} |")
    return "\n".join(lines)
