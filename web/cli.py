"""The `trio-llm` command line: serve, make-model, generate, and commands from plug-ins.

It lives in `web/` because `serve` needs the HTTP layer, the top of the stack.
More commands come from the `trio_llm.commands` entry-point group: each entry
is a function that adds its sub-parser (setting `run` through
`set_defaults`). `trio-llm bench ...` arrives that way from the `bench`
package, so no module of the product imports the benchmarks.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import re
import sys
from contextlib import AbstractAsyncContextManager, nullcontext
from functools import partial
from importlib.metadata import entry_points
from pathlib import Path
from typing import NoReturn, TypeAlias

import trio

from engine.api import ARCHITECTURES, SHAPES, SpawnedEngine, TinyModelSpec, engine_process_started, shaped_spec
from engine.config import EngineConfig
from engine.cpu_binding import bind_this_thread
from engine.log_format import configure_logging
from web import options
from web.http.settings import ServerSettings
from web.http.startup import check_port_free, startup_failure

COMMAND_GROUP = "trio_llm.commands"
# What add_subparsers() returns (generic only to type checkers, hence the string).
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


DESCRIPTION = ("trio-llm: an LLM inference and serving engine with vLLM's v1 architecture, on trio. "
               "`trio-llm serve` serves the OpenAI-compatible HTTP API; `trio-llm COMMAND --help` describes each "
               "command.")

# What each make-model size means, for its --help.
MODEL_SIZES = {"layers": "decoder layers", "hidden": "hidden size", "heads": "attention heads",
               "kv_heads": "key/value heads (grouped-query attention)", "intermediate": "MLP intermediate size",
               "vocab": "vocabulary size (rows of the embedding and the LM head)",
               "max_positions": "context length (max_position_embeddings)", "seed": "seed of the random weights",
               "experts": "experts per MoE layer (MoE architectures)",
               "top_k": "experts each token is routed to (MoE architectures)",
               "sliding_window": "attention window in positions (mistral, gemma3)",
               "head_dim": "dims per attention head (default: hidden / heads)"}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already says what its default
    is, or there is none to tell (None)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is None:
            return text
        return super()._get_help_string(action)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line: the error, the closest option or choice
    ("did you mean"), and where the usage is. (argparse prints the whole usage first: 65 lines for
    `serve`.) Sub-commands' parsers are of this class too (add_subparsers uses the parent's)."""

    def error(self, message: str) -> NoReturn:
        hint = self._closest(message)
        self.exit(2, f"{self.prog}: error: {message}{f' (did you mean {hint}?)' if hint else ''}; "
                     f"see {self.prog} --help\n")

    def _closest(self, message: str) -> str | None:
        if message.startswith("unrecognized arguments: "):
            given = [word.split("=")[0] for word in message.split(": ", 1)[1].split() if word.startswith("-")]
            known = list(self._option_string_actions)
        else:
            choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
            if choice is None:
                return None
            given, known = [choice.group(1)], re.findall(r"'?([^',\s]+)'?", choice.group(2))
        for word in given:
            close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
            if close:
                return close[0]
        return None


def _parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = OneLineErrorParser(prog="trio-llm", description=DESCRIPTION)
    parser.add_argument("--log-level", default="info", help="debug, info, warning or error")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_make_model(sub)
    _add_generate(sub)
    for plugin in entry_points(group=COMMAND_GROUP):
        plugin.load()(sub)
    return parser


def _add_serve(sub: Subcommands) -> None:
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (hypercorn, trio worker)",
                         formatter_class=HelpFormatter)
    srv.add_argument("model", nargs="?", default=None,
                     help="directory or hub id (default: the embedded tiny model)")
    srv.add_argument("--model", dest="model_option", default=None, help="vLLM's other spelling of the model argument")
    options.add_server_options(srv)
    options.add_engine_options(srv)
    srv.set_defaults(run=_serve, command_parser=srv)


def _add_make_model(sub: Subcommands) -> None:
    mk = sub.add_parser("make-model", help="write a tiny random-weight HF checkpoint with a local BPE tokenizer",
                        formatter_class=HelpFormatter)
    defaults = TinyModelSpec()
    mk.add_argument("dir", help="where to write it")
    mk.add_argument("--shape", default=None, choices=sorted(SHAPES),
                    help="a real model's sizes (random weights); the size options below override it")
    mk.add_argument("--arch", default=None, choices=sorted(ARCHITECTURES),
                    help=f"the architecture (default: {defaults.arch}, or the shape's)")
    for name in MODEL_SIZES:
        mk.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                        help=f"the model's {MODEL_SIZES[name]} (default: {getattr(defaults, name)}, or the shape's)")
    mk.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help=f"the weights' dtype (default: {defaults.dtype})")
    mk.add_argument("--force", action="store_true", help="replace a directory that is not empty")
    mk.set_defaults(run=_make_model, command_parser=mk)


def _add_generate(sub: Subcommands) -> None:
    gen = sub.add_parser("generate", help="generate text for prompts with the engine",
                         formatter_class=HelpFormatter)
    gen.add_argument("prompts", nargs="*", default=["The engine says"])
    gen.add_argument("--model", default=None,
                     help="directory or hub id (default: the embedded tiny model)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    options.add_engine_options(gen, seed=False, serves=False)
    gen.set_defaults(run=_generate, command_parser=gen)


def model_dir(model: str | None) -> str:
    """`model`, or the embedded default model (created on first use)."""
    from engine.api import ensure_default_model
    return model or str(ensure_default_model())


def _refused(command: str, args: argparse.Namespace) -> bool:
    """Whether the command line asks for something that cannot be honoured: a line is printed for
    each such flag. (A vLLM flag accepted with no effect here is logged as a note instead.)"""
    refused = options.refused_flags(args)
    if getattr(args, "model_option", None) and args.model and args.model_option != args.model:
        refused.append(f"two models given: {args.model} and --model {args.model_option}; give one")
    for reason in refused:
        print(f"trio-llm {command}: {reason}", file=sys.stderr)
    for note in options.option_notes(args):
        logging.getLogger("trio_llm.serve").info("note: %s", note)
    return bool(refused)


def _serve(args: argparse.Namespace) -> int:
    if _refused("serve", args):
        return 2
    args.model = args.model or args.model_option
    try:
        if args.uds is None:
            check_port_free(args.host, args.port)  # before loading a model that may take minutes
        engine_config = options.engine_config(model_dir(args.model), args)
        layout = engine_config.cpu_layout
        server_cpus = None if layout is None else layout.server_binding(engine_config.tunes_cpu_threads)
        if server_cpus is not None:  # the event loop's thread, and every thread it starts
            bind_this_thread(server_cpus)
        run = partial(_serve_engine_first, engine_config, options.server_settings(args), args.host, args.port,
                      args.log_level)
        return int(trio.run(run))
    except BaseException as exc:  # start-up failures become one line (the traceback too with debug)
        return startup_failure(exc, debug=args.log_level.lower() == "debug")


async def _serve_engine_first(engine_config: EngineConfig, settings: ServerSettings, host: str, port: int,
                              log_level: str) -> int:
    """Start the engine process, then import the server (quart, hypercorn, the engine API, torch)
    while it imports torch: the two overlap (~0.5 s of a warm start). Nothing
    imported so far pulls in torch (tests/test_startup.py checks)."""
    starting: AbstractAsyncContextManager[SpawnedEngine | None] = nullcontext()  # --executor inproc: none
    if engine_config.executor != "inproc":
        starting = engine_process_started()
    async with starting as spawned:
        from web.serve import serve
        return await serve(engine_config, settings, host, port, log_level=log_level, spawned_engine=spawned)


def _make_model(args: argparse.Namespace) -> int:
    from engine.api import make_model
    try:
        given = {name: getattr(args, name) for name in (*MODEL_SIZES, "arch", "dtype")}
        spec = shaped_spec(args.shape, **given)
    except ValueError as exc:
        print(f"trio-llm make-model: {exc}", file=sys.stderr)
        return 2
    target = Path(args.dir)
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not args.force:
        print(f"trio-llm make-model: {target} exists and is not empty; pass --force to replace it", file=sys.stderr)
        return 1
    print(make_model(target, spec))
    return 0


def _generate(args: argparse.Namespace) -> int:
    if _refused("generate", args):
        return 2
    try:
        from engine.api import LLM, SamplingParams
        llm = LLM(model_dir(args.model), **options.engine_options(args))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    except BaseException as exc:  # as serve: a failure users can fix is one line
        return startup_failure(exc, debug=args.log_level.lower() == "debug", command="generate")
    for output in outputs:
        print(f"{output.prompt!r} -> {output.outputs[0].text!r} ({output.outputs[0].finish_reason})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's own parser, with its usage (not the top level's)
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    configure_logging(args.log_level.upper())
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
