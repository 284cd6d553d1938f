"""The command-line options of `trio-llm serve` and `trio-llm generate`, with vLLM's names.

A `vllm serve` command line carries over wherever the feature exists; a flag
trio-llm cannot honour is refused with a one-line reason (`refused_flags`),
never silently accepted. Every option has a help text, and `--help` shows its
default.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from dataclasses import MISSING, Field, fields
from typing import Any

from engine.config import KV_CACHE_DTYPES, QUANTIZATIONS, SAME_AS_FIELD, TRUST_REMOTE_CODE_REFUSED, EngineConfig, Flag
from web.chat.parser_names import REASONING_PARSERS, TOOL_PARSERS
from web.http.cors import CorsSettings
from web.http.settings import ServerSettings
from web.vllm_flags import ENGINE_FLAGS, SERVER_FLAGS, add_foreign_flags, foreign_flag_notes, foreign_flag_refusals


def add_engine_options(p: argparse.ArgumentParser, *, seed: bool = True, serves: bool = True) -> None:
    """The engine's options, one per `EngineConfig` field that declares a flag (`engine.config.flag`),
    in field order; `seed=False` for a command whose --seed means something else; `serves=False`
    for one that exits once it has its answers: it compiles before its first step (a compile left
    to a child process would be killed at exit, never saved)."""
    for option, declared in _flagged_fields():
        if option.name == "seed" and not seed:
            continue
        names = declared.names or ("--" + option.name.replace("_", "-"),)
        keywords = dict(declared.argparse)
        if "action" not in keywords and "choices" not in keywords and "metavar" not in keywords:
            keywords["metavar"] = names[0].lstrip("-").replace("-", "_").upper()
        default = option.default if declared.cli_default is SAME_AS_FIELD else declared.cli_default
        if default is MISSING:  # a field built by its factory: the flag's absence means its defaults
            default = None
        if option.name == "compile_in_background" and not serves:
            default = False
        p.add_argument(*names, dest=option.name, default=default, help=declared.help, **keywords)
    add_foreign_flags(p, ENGINE_FLAGS)


def _flagged_fields() -> list[tuple[Field[Any], Flag]]:
    return [(option, option.metadata["flag"]) for option in fields(EngineConfig) if "flag" in option.metadata]


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from the parsed options: each flagged field's value (through
    its `from_cli`; None, a flag not given, leaves the field's default), and what vLLM's environment
    variables add. (`generate`'s own --seed seeds its sampling and the engine both.)"""
    chosen: dict[str, Any] = {}
    for option, declared in _flagged_fields():
        value = getattr(args, option.name, None)
        if value is None and declared.from_cli is None:  # not given: the field's default
            continue
        chosen[option.name] = declared.from_cli(value) if declared.from_cli is not None else value
    chosen["kv_cache_memory_bytes"] = kv_cache_bytes(args.kv_cache_memory_bytes, args.device, os.environ)
    if args.pipeline_parallel_size > 1:
        chosen["pipeline_layer_partition"] = layer_partition_from_env()
    # the flag without --enable-lora is refused; vLLM's variable, set for a whole machine, is not
    chosen["allow_runtime_lora_updating"] = args.allow_runtime_lora_updating or (
        args.enable_lora and runtime_lora_updating_from(os.environ))
    chosen.pop("trust_remote_code", None)  # refused before anything is built (refused_flags)
    return chosen


def runtime_lora_updating_from(environ: Mapping[str, str]) -> bool:
    """vLLM's switch: `VLLM_ALLOW_RUNTIME_LORA_UPDATING` set to 1 or true (any case)."""
    return environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


def kv_cache_bytes(flag: int | None, device: str, environ: Mapping[str, str]) -> int | None:
    """The flag; else on CPU vLLM-CPU's `VLLM_CPU_KVCACHE_SPACE` (GiB); else None (the engine's
    default: what --gpu-memory-utilization leaves on CUDA, 1 GiB elsewhere)."""
    if flag is not None:
        return flag
    space = environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    if not space or space == "0" or device.startswith("cuda"):  # vLLM reads 0 as "its default"
        return None
    try:
        return int(float(space) * (1 << 30))
    except ValueError:
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must be a number of GiB, got {space!r}") from None


def add_server_options(srv: argparse.ArgumentParser) -> None:
    srv.add_argument("--host", default="0.0.0.0",
                     help="address to listen on: every interface, as vLLM (127.0.0.1: this machine only; without "
                          "--api-key start-up warns that anyone who reaches the port can use it)")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on every route but /health, /ping, /version "
                          "and /metrics")
    srv.add_argument("--metrics-require-key", action="store_true", help="/metrics needs the API key too")
    srv.add_argument("--served-model-name", default=None,
                     help="the model's name in the API (default: its path or hub id)")
    srv.add_argument("--max-queued-requests", type=int, default=None,
                     help="waiting requests beyond this get 503 + Retry-After (default: no bound)")
    srv.add_argument("--max-body-bytes", type=int, default=None,
                     help="request body limit (default 16 MiB, more with --enable-prompt-embeds)")
    srv.add_argument("--grace-period", type=float, default=30.0,
                     help="seconds in-flight requests get on SIGINT/SIGTERM")
    srv.add_argument("--ssl-keyfile", default=None, help="TLS private key (with --ssl-certfile)")
    srv.add_argument("--ssl-certfile", default=None, help="TLS certificate chain (with --ssl-keyfile)")
    srv.add_argument("--root-path", default="", help="the path prefix a proxy serves the API under")
    srv.add_argument("--log-level", default=argparse.SUPPRESS, help="as the global --log-level")
    srv.add_argument("--uvicorn-log-level", dest="log_level", default=argparse.SUPPRESS,
                     help="vLLM's name for --log-level")
    for flag, what in (("--allowed-origins", "origins"), ("--allowed-methods", "methods"),
                       ("--allowed-headers", "headers")):
        srv.add_argument(flag, type=json.loads, default=["*"], help=f"CORS: allowed {what}, a JSON list")
    srv.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    srv.add_argument("--enable-log-requests", action="store_true",
                     help="log a JSON line per finished request: id, tokens, queue time, TTFT, total time, finish "
                          "reason (never the prompt)")
    srv.add_argument("--disable-log-requests", action="store_true", help="vLLM's older flag: the default here")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help='tool_choice "auto": find tool calls in what the model writes (with --tool-call-parser)')
    srv.add_argument("--tool-call-parser", default=None, choices=list(TOOL_PARSERS),
                     help="the format tool calls are written in: hermes (<tool_call>...</tool_call>), llama3_json, "
                          "openai (gpt-oss's harmony messages to functions.NAME; needs --reasoning-parser "
                          "openai_gptoss)")
    srv.add_argument("--trust-request-chat-template", action="store_true",
                     help="accept a chat_template in chat requests (a template runs in a sandbox, but it is the "
                          "client's code)")
    srv.add_argument("--uds", default=None, help="serve on this Unix domain socket instead of --host/--port")
    srv.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                     help="serve GET /tokenizer_info: the tokenizer's configuration and special tokens")
    srv.add_argument("--enable-request-id-headers", action="store_true",
                     help="an X-Request-Id header on every response (the client's, or a new one)")
    srv.add_argument("--enable-server-load-tracking", action="store_true",
                     help="GET /load answers how many generation and pooling requests are being served")
    srv.add_argument("--enable-force-include-usage", action="store_true",
                     help="usage in every response, streamed ones too (as if stream_options.include_usage)")
    srv.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                     help="put the model's reasoning in reasoning_content: its <think>...</think> part (qwen3, "
                          "deepseek_r1), or gpt-oss's analysis channel (openai_gptoss)")
    srv.add_argument("--allow-unknown-fields", action="store_true",
                     help="log and ignore request fields neither OpenAI nor vLLM defines (default: 400 naming them)")
    add_foreign_flags(srv, SERVER_FLAGS)


def server_settings(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings(api_key=args.api_key, metrics_require_key=args.metrics_require_key,
                          served_model_name=args.served_model_name, max_queued_requests=args.max_queued_requests,
                          max_body_bytes=args.max_body_bytes, grace_period=args.grace_period,
                          ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, root_path=args.root_path,
                          log_requests=args.enable_log_requests, allow_unknown_fields=args.allow_unknown_fields,
                          enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                          reasoning_parser=args.reasoning_parser,
                          trust_request_chat_template=args.trust_request_chat_template,
                          enable_request_id_headers=args.enable_request_id_headers, uds=args.uds,
                          enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                          enable_force_include_usage=args.enable_force_include_usage,
                          enable_server_load_tracking=args.enable_server_load_tracking,
                          cors=CorsSettings(tuple(args.allowed_origins), tuple(args.allowed_methods),
                                            tuple(args.allowed_headers), args.allow_credentials))


def option_notes(args: argparse.Namespace) -> list[str]:
    """A line for each flag given that changes nothing on this command line (vLLM flags with no
    feature here, and device-specific ones on another device)."""
    notes = foreign_flag_notes(args)
    if getattr(args, "gpu_memory_utilization", None) is not None and not args.device.startswith("cuda"):
        notes.append("--gpu-memory-utilization changes nothing here: it sizes the KV cache on CUDA devices; on "
                     "CPU the cache is --kv-cache-memory-bytes (or VLLM_CPU_KVCACHE_SPACE GiB), as on vLLM-CPU")
    return notes


def refused_flags(args: argparse.Namespace) -> list[str]:
    """One line per flag given that trio-llm cannot honour."""
    reasons = foreign_flag_refusals(args)
    quantization = getattr(args, "quantization", None)
    if quantization is not None and quantization not in QUANTIZATIONS:
        reasons.append(f"--quantization {quantization}: not implemented here; trio-llm quantizes float checkpoints "
                       f"at load ({', '.join(QUANTIZATIONS)}), loads llm-compressor int8 checkpoints and GGUF files "
                       "as they are (no --quantization needed)")
    kv_cache_dtype = getattr(args, "kv_cache_dtype", "auto")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        reasons.append(f"--kv-cache-dtype {kv_cache_dtype}: not implemented here; the KV cache is held in the model's "
                       f"dtype (auto), bfloat16 or float16")
    if getattr(args, "trust_remote_code", False):
        reasons.append("--trust-remote-code" + TRUST_REMOTE_CODE_REFUSED.removeprefix("trust_remote_code"))
    if getattr(args, "eplb_config", None) is not None and not getattr(args, "enable_eplb", False):
        reasons.append("--eplb-config takes effect only with --enable-eplb; add it, or drop --eplb-config")
    utilization = getattr(args, "gpu_memory_utilization", None)
    if utilization is not None and not 0 < utilization <= 1:
        reasons.append(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
        value = getattr(args, name, ["*"])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            reasons.append(f"--{name.replace('_', '-')} takes a JSON list of strings, e.g. '[\"*\"]'")
    if getattr(args, "enable_log_requests", False) and getattr(args, "disable_log_requests", False):
        reasons.append("--enable-log-requests and --disable-log-requests contradict each other")
    if bool(getattr(args, "ssl_keyfile", None)) != bool(getattr(args, "ssl_certfile", None)):
        reasons.append("--ssl-keyfile and --ssl-certfile go together")
    return reasons


def engine_config(model: str, args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=model, **engine_options(args))


def layer_partition_from_env() -> tuple[int, ...] | None:
    """vLLM's VLLM_PP_LAYER_PARTITION ("16,8": layers per pipeline stage), if set; a value that is
    not a list of integers is a `ValueError` naming it."""
    value = os.environ.get("VLLM_PP_LAYER_PARTITION")
    if not value:
        return None
    try:
        return tuple(int(part) for part in value.split(","))
    except ValueError:
        raise ValueError(f"VLLM_PP_LAYER_PARTITION must be layers per stage, such as 16,8; got {value!r}") from None
