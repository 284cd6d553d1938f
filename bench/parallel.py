"""`trio-llm bench parallel MODEL_DIR`: served tok/s of trio-llm with N data-parallel engines
(`--kind data`) or N pipeline stages (`--kind pipeline`) against one, like for like.

Every setting is the same `trio-llm serve` on the same checkpoint with the same options (by
default `--cpu-threads-bind` every CPU: every CPU computes in every setting; with `-dp 2` each
engine binds half of them, with `-pp 2` each stage's worker process gets half the threads),
loaded with the same streaming completions as `trio-llm bench serve`.
`--repeats` rounds, the order of the settings flipping from round to round; medians and each
round's figure are printed, and each setting's CPU layout as its log states it.
"""

from __future__ import annotations

import statistics

from bench.serve import _percentile
from bench.side_by_side import ServerRun, rate, serve_and_load, stated_settings, trio_llm_command

FLAGS = {"data": ("--data-parallel-size", "dp"), "pipeline": ("--pipeline-parallel-size", "pp")}


async def run(model: str, kind: str, sizes: list[int], levels: list[int], num_requests: int, input_len: int,
              output_len: int, vocab: int, extra: list[str], repeats: int = 3, port: int = 8290) -> str:
    flag, short = FLAGS[kind]
    runs: dict[int, list[ServerRun]] = {size: [] for size in sizes}
    for round_ in range(repeats):
        order = sizes if round_ % 2 == 0 else sizes[::-1]
        for size in order:
            command = [*trio_llm_command(model, port, "float32", extra), flag, str(size)]
            if kind == "pipeline":
                command += ["--distributed-executor-backend", "mp"]  # one stage: one worker process too
            log_path = f"/tmp/bench-parallel-{short}{size}-{round_}.log"
            result = await serve_and_load(f"{short}={size}", command, port, levels, num_requests, input_len,
                                          output_len, vocab, log_path)
            result.settings = stated_settings("trio-llm", log_path)
            runs[size].append(result)
    return report(runs, short, model, extra, input_len, output_len, repeats)


def report(runs: dict[int, list[ServerRun]], short: str, model: str, extra: list[str], input_len: int,
           output_len: int, repeats: int) -> str:
    base = min(runs)
    lines = [f"model={model} float32, trio-llm serve {' '.join(extra)} input_len={input_len} "
             f"output_len={output_len} rounds={repeats}, order flipped each round (logs: /tmp/bench-parallel-*.log)"]
    for size, results in runs.items():
        lines.append(f"{short}={size} settings: {results[0].settings}")
    lines.append(f"setting | concurrency | tok/s per round | median tok/s | vs {short}={base} | TTFT p50 ms | "
                 "ITL p50 ms")
    for size, results in runs.items():
        for level in results[0].levels:
            rates = [rate(r.levels[level]) for r in results]
            baseline = statistics.median(rate(r.levels[level]) for r in runs[base])
            ttft = statistics.median(_percentile(r.levels[level].ttft, .5) for r in results) * 1000
            itl = statistics.median(_percentile(r.levels[level].itl, .5) for r in results) * 1000
            lines.append(f"{short}={size} | {level} | {', '.join(f'{x:.1f}' for x in rates)} | "
                         f"{statistics.median(rates):.1f} | {statistics.median(rates) / baseline:.2f}x | "
                         f"{ttft:.1f} | {itl:.1f}")
    return "\n".join(lines)
