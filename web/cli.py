"""The `trio-llm` command line: serve, make-model, generate, and commands from plug-ins.

It lives in `web/` because `serve` needs the HTTP layer, the top of the stack.
More commands come from the `trio_llm.commands` entry-point group: each entry
is a function that adds its sub-parser (setting `run` through
`set_defaults`). `trio-llm bench ...` arrives that way from the `bench`
package, so no module of the product imports the benchmarks.
"""

from __future__ import annotations

import argparse
import logging
import sys
from functools import partial
from importlib.metadata import entry_points
from typing import Any, TypeAlias

import trio

from engine.api import ARCHITECTURES, TinyModelSpec
from web.settings import ServerSettings

COMMAND_GROUP = "trio_llm.commands"
# What add_subparsers() returns (generic only to type checkers, hence the string).
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


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


def _engine_options(args: argparse.Namespace) -> dict[str, Any]:
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
    for plugin in entry_points(group=COMMAND_GROUP):
        plugin.load()(sub)
    return parser


def _add_serve(sub: Subcommands) -> None:
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (hypercorn, trio worker)")
    srv.add_argument("model", nargs="?", default=None, help="model directory (default: the embedded tiny model)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on every route but /health, /ping, /version "
                          "and /metrics")
    srv.add_argument("--metrics-require-key", action="store_true", help="/metrics needs the API key too")
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument("--max-queued-requests", type=int, default=None)
    srv.add_argument("--max-body-bytes", type=int, default=None,
                     help="request body limit (default 16 MiB, more with --enable-prompt-embeds)")
    srv.add_argument("--grace-period", type=float, default=30.0)
    srv.add_argument("--log-level", default=argparse.SUPPRESS, help="as the global --log-level")
    _add_engine_options(srv)
    srv.set_defaults(run=_serve)


def _add_make_model(sub: Subcommands) -> None:
    mk = sub.add_parser("make-model", help="write a tiny random-weight HF checkpoint with a local BPE tokenizer")
    defaults = TinyModelSpec()
    mk.add_argument("dir")
    mk.add_argument("--arch", default=defaults.arch, choices=sorted(ARCHITECTURES))
    for name in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "max_positions", "seed"):
        mk.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    mk.add_argument("--dtype", default=defaults.dtype, choices=["float32", "bfloat16", "float16"])
    mk.set_defaults(run=_make_model)


def _add_generate(sub: Subcommands) -> None:
    gen = sub.add_parser("generate", help="generate text for prompts with the engine")
    gen.add_argument("prompts", nargs="*", default=["The engine says"])
    gen.add_argument("--model", default=None, help="model directory (default: the embedded tiny model)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    _add_engine_options(gen)
    gen.set_defaults(run=_generate)


def model_dir(model: str | None) -> str:
    """`model`, or the embedded default model (created on first use)."""
    from engine.api import ensure_default_model
    return model or str(ensure_default_model())


def _serve(args: argparse.Namespace) -> int:
    from engine.api import EngineConfig
    from web.serve import serve
    engine_config = EngineConfig(model=model_dir(args.model), **_engine_options(args))
    settings = ServerSettings(api_key=args.api_key, metrics_require_key=args.metrics_require_key,
                              served_model_name=args.served_model_name,
                              max_queued_requests=args.max_queued_requests, max_body_bytes=args.max_body_bytes,
                              grace_period=args.grace_period)
    return trio.run(partial(serve, engine_config, settings, args.host, args.port, log_level=args.log_level))


def _make_model(args: argparse.Namespace) -> int:
    from engine.api import make_model
    spec = TinyModelSpec(arch=args.arch, layers=args.layers, hidden=args.hidden, heads=args.heads,
                         kv_heads=args.kv_heads, intermediate=args.intermediate, vocab=args.vocab,
                         max_positions=args.max_positions, dtype=args.dtype, seed=args.seed)
    print(make_model(args.dir, spec))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from engine.api import LLM, SamplingParams
    llm = LLM(model_dir(args.model), **_engine_options(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    for output in llm.generate(args.prompts, params, use_tqdm=False):
        print(f"{output.prompt!r} -> {output.outputs[0].text!r} ({output.outputs[0].finish_reason})")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
