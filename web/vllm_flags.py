"""The `vllm serve` flags trio-llm has no feature behind, each answered once, in one table.

A newcomer's `vllm serve` command line should start trio-llm or say in one line why not. Every
flag here is one of:

- *noted*: what it asks for is already so here, or it tunes something trio-llm does not have
  (`--swap-space`: preempted requests are recomputed, never swapped, as in vLLM v1). It is
  accepted, and start-up logs one line saying it changes nothing and why;
- *noted for some values*: `--load-format auto` is what trio-llm does; `pt` is refused;
- *refused*: it asks for a feature trio-llm lacks (`--speculative-config`). The command stops
  with one line naming the flag and the reason, before anything loads.

Flags trio-llm implements are declared with the other options (web/options.py); this table is
only for the rest, so `--help` lists every flag a vLLM user may bring.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ForeignFlag:
    """A vLLM flag without a feature behind it here. `takes_value`: it is followed by a value.
    `harmless`: the values that ask for nothing trio-llm does not already do (None: every value;
    empty: none, the flag is refused). `why`: the reason, for the note or the refusal."""

    flag: str
    why: str
    takes_value: bool = True
    harmless: tuple[str, ...] | None = None

    def refuses(self, value: str | None) -> bool:
        return self.harmless is not None and value not in self.harmless


_REFUSED: tuple[str, ...] = ()  # `harmless=_REFUSED`: refused whatever its value

ENGINE_FLAGS = (
    ForeignFlag("--disable-log-stats", "trio-llm logs no periodic stats lines; /metrics serves them",
                takes_value=False),
    ForeignFlag("--swap-space", "preempted requests are recomputed, never swapped to CPU memory (as in vLLM v1)"),
    ForeignFlag("--disable-custom-all-reduce", "tensor-parallel collectives run on torch.distributed (gloo on CPU)",
                takes_value=False),
    ForeignFlag("--max-seq-len-to-capture", "the compiled decode graph takes every sequence length"),
    ForeignFlag("--max-parallel-loading-workers", "each rank loads its own weights in one pass"),
    ForeignFlag("--tokenizer-pool-size", "long prompts are tokenized in --renderer-workers threads"),
    ForeignFlag("--disable-sliding-window", "not implemented: a model's sliding window (Mistral's) is always "
                "applied", takes_value=False, harmless=_REFUSED),
    ForeignFlag("--load-format", "weights load from safetensors (or a GGUF file given as the model); other "
                "formats are not read", harmless=("auto", "safetensors", "gguf")),
    ForeignFlag("--tokenizer-mode", "the tokenizer is the model's tokenizer.json, read by the tokenizers "
                "library (auto); slow and mistral tokenizers are not implemented", harmless=("auto", "hf")),
    ForeignFlag("--cpu-offload-gb", "weights stay where the model runs: there is no offload to move them from",
                harmless=("0",)),
    ForeignFlag("--speculative-config", "speculative decoding is not implemented", harmless=_REFUSED),
    ForeignFlag("--kv-transfer-config", "KV transfer between instances is not implemented (the encoder cache "
                "has --ec-transfer-config)", harmless=_REFUSED),
    ForeignFlag("--enable-sleep-mode", "sleep mode frees GPU memory; nothing here holds any",
                takes_value=False),
    ForeignFlag("--hf-overrides", "the checkpoint's config.json is used as written", harmless=_REFUSED),
    ForeignFlag("--override-generation-config", "give sampling defaults with --generation-config DIR (a "
                "generation_config.json), or per request", harmless=_REFUSED),
    ForeignFlag("--worker-cls", "workers are trio-llm's own", harmless=("auto",)),
    ForeignFlag("--worker-extension-cls", "workers take no extensions", harmless=("",)),
    ForeignFlag("--code-revision", "trio-llm runs no code from model repositories", harmless=_REFUSED),
)

SERVER_FLAGS = (
    ForeignFlag("--disable-fastapi-docs", "no API docs pages are served", takes_value=False),
    ForeignFlag("--disable-uvicorn-access-log", "no access log is written (--enable-log-requests logs requests)",
                takes_value=False),
    ForeignFlag("--disable-frontend-multiprocessing", "the engine core keeps its own process; "
                "--distributed-executor-backend uni runs it in the server's", takes_value=False),
    ForeignFlag("--max-log-len", "--enable-log-requests never logs prompts, so there is nothing to shorten"),
    ForeignFlag("--response-role", "chat answers come from the assistant role", harmless=("assistant",)),
    ForeignFlag("--middleware", "no ASGI middleware is loaded from the command line", harmless=_REFUSED),
    ForeignFlag("--otlp-traces-endpoint", "OpenTelemetry tracing is not implemented", harmless=_REFUSED),
)


class _Record(argparse.Action):
    """Stores a foreign flag's value (or None for a switch) in `namespace.foreign_flags`."""

    def __init__(self, option_strings: Sequence[str], dest: str, foreign: ForeignFlag, **kwargs: Any) -> None:
        self.foreign = foreign
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        given = dict(getattr(namespace, "foreign_flags", None) or {})
        given[self.foreign.flag] = values
        namespace.foreign_flags = given


def add_foreign_flags(parser: argparse.ArgumentParser, flags: Sequence[ForeignFlag]) -> None:
    """Declares `flags` (their help says what each does here), recorded in `args.foreign_flags`."""
    parser.set_defaults(foreign_flags={})
    for foreign in flags:
        if foreign.harmless is None:
            help_text = f"vLLM's flag, accepted: no effect here ({foreign.why})"
        elif foreign.harmless:
            help_text = f"vLLM's flag: {', '.join(foreign.harmless)} accepted, other values refused ({foreign.why})"
        else:
            help_text = f"vLLM's flag, refused: {foreign.why}"
        parser.add_argument(foreign.flag, action=_Record, foreign=foreign, nargs=None if foreign.takes_value else 0,
                            dest="foreign_flags", default=argparse.SUPPRESS, metavar="VALUE", help=help_text)


ALL_FLAGS = {foreign.flag: foreign for foreign in (*ENGINE_FLAGS, *SERVER_FLAGS)}


def _given(args: argparse.Namespace) -> Iterator[tuple[ForeignFlag, str | None, str]]:
    """Each foreign flag given: the flag, its value (None for a switch), and how to show both."""
    for flag, value in (getattr(args, "foreign_flags", None) or {}).items():
        value = value if isinstance(value, str) else None
        yield ALL_FLAGS[flag], value, flag if value is None else f"{flag} {value}"


def foreign_flag_notes(args: argparse.Namespace) -> list[str]:
    """A line for each foreign flag given and accepted: why it changes nothing here."""
    return [f"{shown} changes nothing here: {foreign.why}" for foreign, value, shown in _given(args)
            if not foreign.refuses(value)]


def foreign_flag_refusals(args: argparse.Namespace) -> list[str]:
    """A line for each foreign flag given that cannot be honoured, with the reason."""
    return [f"{shown}: {foreign.why}" for foreign, value, shown in _given(args) if foreign.refuses(value)]
