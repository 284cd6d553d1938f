"""`trio-llm bench quantized`: decode tok/s of float32, bfloat16, int8 (weight-only), w8a8, int4 and q8_0 against
llama.cpp's own server on the same weights as GGUF F32 and Q8_0, and against the memory-bandwidth
floor, in one run.

Like for like: one checkpoint, converted for llama.cpp by llama.cpp's own `convert_hf_to_gguf.py`
(`--outtype f32` and `q8_0`); the same random token prompts, the same output length (greedy, no
early stop), the same thread count on both sides, the sides alternating first in each of `repeats`
rounds, the median printed. Our side runs the compiled engine in this process at 1 and 16
sequences together; llama.cpp runs as its users serve concurrent clients, `llama-server -np N`
(continuous batching over N slots), the N sequences sent together, one non-streamed request each
(`LlamaServer`). The floor is one token per weight read at batch 1: the bytes of the weights over
the measured memory bandwidth.

tok/s counts every output token over the whole request, the prompt's prefill included (a 32-token
prompt for 32 tokens out: int8's prefill is a fifth of its time, since torch's int8 kernel is slow
at 32 rows). The decode column is one stream's decode rate, its prompt's prefill excluded: ours
timed from its first token to its last, llama-server's its own `predicted_per_second`.
"""

from __future__ import annotations

import random
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import trio

from bench import http
from bench.gguf_fidelity import convert_q8_0
from bench.roofline import read_bandwidth
from bench.side_by_side import healthy, llama_server_command
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


class LlamaServer:
    """llama.cpp's own server on a file made by llama.cpp's converter: `llama-server -np SLOTS -t
    THREADS` (continuous batching over its slots, its other defaults), in a process of its own.
    Each figure comes from requests sent together, as our engine's prompts run together: one
    non-streamed `/completion` per sequence, so HTTP costs a request and a response per sequence,
    not per token. tok/s is over the batch's wall time; the decode rate is the server's own
    (`timings.predicted_per_second`: its decode steps, no HTTP)."""

    def __init__(self, binary: Path, gguf_path: Path, threads: int, slots: int, context: int, port: int) -> None:
        self.weight_bytes = gguf_path.stat().st_size - embedding_bytes(gguf_path)
        self.url = f"http://127.0.0.1:{port}"
        command = [*llama_server_command(str(binary), str(gguf_path), port, slots), "-t", str(threads),
                   "-c", str(slots * context)]
        self.log = Path(tempfile.mkdtemp(prefix="trio-llm-llama-server-")) / "server.log"
        with self.log.open("wb") as log:  # the child keeps its own descriptor
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        trio.run(self._until_healthy)

    async def _until_healthy(self) -> None:
        """Poll /health (an external process: there is nothing to await) until it answers 200."""
        with trio.fail_after(300):
            while not await healthy(self.url):
                if self._process.poll() is not None:
                    raise RuntimeError(f"llama-server exited with {self._process.returncode}; see {self.log}")
                await trio.sleep(0.2)

    async def _complete(self, prompt: list[int], output_len: int) -> dict[str, Any]:
        body = {"prompt": prompt, "n_predict": output_len, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                "cache_prompt": False}
        response = await http.request(self.url, "POST", "/completion", body)
        answer: dict[str, Any] = response.json()
        assert answer["timings"]["predicted_n"] == output_len, answer["timings"]
        return answer

    async def _together(self, prompts: list[list[int]], output_len: int) -> float:
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for prompt in prompts:
                nursery.start_soon(self._complete, prompt, output_len)
        return len(prompts) * output_len / (time.perf_counter() - start)

    def rate(self, prompts: list[list[int]], spec: BenchSpec) -> float:
        return trio.run(self._together, prompts, spec.output_len)

    def decode_rate(self, prompt: list[int], output_len: int) -> float:
        """The server's decode tokens/s of one sequence (its prompt's prefill excluded)."""
        return float(trio.run(self._complete, prompt, output_len)["timings"]["predicted_per_second"])

    def close(self) -> None:
        self._process.send_signal(signal.SIGINT)
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


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
        repeats: int = 3, threads: int = 2, llama_dir: Path | None = None,
        variants: tuple[str, ...] = tuple(OURS), port: int = 8093) -> tuple[list[Side], float, str]:
    """`llama_dir`: where ../shared/tools/llama-server built llama.cpp (its sources and
    build/bin); None: our variants alone."""
    torch.set_num_threads(threads)
    contenders: dict[str, OurEngine | LlamaServer] = {}
    for name in ("float32", *variants) if "float32" not in variants else variants:  # float32: the ratios' base
        dtype, quantization = OURS[name]
        contenders[name] = OurEngine(model_dir, dtype, quantization, threads, max(streams))
    workdir = Path(tempfile.mkdtemp(prefix="trio-llm-gguf-"))
    if llama_dir is not None:
        binary = llama_dir / "build" / "bin" / "llama-server"
        for offset, qtype in enumerate(LLAMA_CPP):  # both served throughout (an idle llama-server computes nothing)
            path = convert_q8_0(model_dir, workdir / f"model-{qtype}.gguf", llama_dir, qtype.lower())
            contenders[f"llama.cpp {qtype}"] = LlamaServer(binary, path, threads, max(streams),
                                                           input_len + output_len + 8, port + offset)
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
        if isinstance(contender, LlamaServer):
            contender.close()
    settings = (f"threads={threads} on both sides (llama.cpp: llama-server -np {max(streams)} -t {threads} on files "
                f"made by its convert_hf_to_gguf.py, the sequences sent together), prompts of {input_len} random "
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
