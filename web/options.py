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
from typing import Any

from engine.config import (
    CompilationConfig,
    ECTransferConfig,
    EngineConfig,
    EplbConfig,
    LoRAModule,
    PoolerOptions,
    StructuredOutputsConfig,
)
from engine.cpu_binding import available_cpus, parse_cpu_threads_bind
from web.http.cors import CorsSettings
from web.http.settings import ServerSettings
from web.vllm_flags import ENGINE_FLAGS, SERVER_FLAGS, add_foreign_flags, foreign_flag_notes, foreign_flag_refusals

HASH_ALGOS = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
# vLLM's --dtype spellings: its other names for the same dtypes
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
QUANTIZATIONS = ["int8", "w8a8", "int4"]


def add_engine_options(p: argparse.ArgumentParser, *, seed: bool = True) -> None:
    """The engine's options; `seed=False` for a command whose --seed means something else."""
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", *DTYPE_ALIASES],
                   help="weights and activations (auto: the checkpoint's torch_dtype; half: float16, float: float32, "
                        "as in vLLM)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="requests in one batch at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens in one step at most (default: max(2048, max-num-seqs))")
    p.add_argument("--max-logprobs", type=int, default=20, help="the largest logprobs / prompt_logprobs accepted")
    p.add_argument("--max-prompts-per-request", type=int, default=2048,
                   help="prompts (or embeddings inputs) one request may carry")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="memory for the KV cache, per rank (default: VLLM_CPU_KVCACHE_SPACE GiB if set, else 1 GiB)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="KV cache blocks, whatever --kv-cache-memory-bytes allows (vLLM's name; the cache is on the "
                        "--device)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of each GPU the engine may use (default 0.9): the KV cache takes what the weights, "
                        "activations and CUDA graphs leave, measured at start-up; CUDA only "
                        "(--kv-cache-memory-bytes wins)")
    p.add_argument("--device", default="cpu", help="torch device the model runs on")
    if seed:
        p.add_argument("--seed", type=int, default=0, help="seed of the sampler's generator for unseeded requests")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of shared prompt prefixes")
    p.add_argument("--prefix-caching-hash-algo", default="sha256", choices=HASH_ALGOS,
                   help="block identity (xxhash: faster, not cryptographic: only if every prompt is trusted)")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts over several steps")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="the waiting queue's order: arrival, or each request's `priority` (lower first; ties by "
                        "arrival)")
    p.add_argument("--cpu-threads-bind", default="auto",
                   help="CPUs of the forward pass: auto (the default, as vLLM-CPU's: all but the first, which the "
                        "HTTP server keeps; it survives a busy neighbour, docs/benchmarks.md), none (no binding, "
                        "torch's default threads) or a list such as 1 or 0-2,5 (vLLM-CPU's VLLM_CPU_OMP_THREADS_BIND)")
    p.add_argument("--adaptive-cpu-threads", action=argparse.BooleanOptionalAction, default=True,
                   help="let each forward pass use between 1 thread and one per compute CPU, whichever steps "
                        "fastest now (fewer when another process takes a core); --no-adaptive-cpu-threads keeps "
                        "one per compute CPU")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule each step while the one before it runs (vLLM's async scheduling; default: on "
                        "with one worker on CUDA, off on CPU)")
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="run every step on the eager model (default: decode steps run one graph compiled at "
                        "start-up, by AOTInductor for dense models and torch.compile for MoE ones, cached on disk)")
    p.add_argument("--compilation-config", "-cc", default=None,
                   help='compiled decode graphs, a JSON object: {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, '
                        '64], "cache_dir": "~/.cache/trio-llm/torch_compile"} (the cache follows XDG_CACHE_HOME)')
    p.add_argument("--structured-outputs-config", default=None,
                   help='structured outputs, a JSON object: {"max_integer_digits": 18} (JSON schema integers '
                        'without bounds get that many digits at most; null: unbounded)')
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="worker processes, one per rank")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="pipeline stages of worker processes, each holding consecutive layers (times "
                        "--tensor-parallel-size ranks each); as many steps in flight as stages")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engines behind this server, each with its own scheduler, KV cache and workers (the "
                        "compute CPUs split between them); requests go to the least loaded, prefix-aware")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: split the experts over the tensor-parallel ranks instead of sharding each")
    p.add_argument("--enable-eplb", action="store_true",
                   help="MoE models: rebalance experts over the ranks by their measured load")
    p.add_argument("--eplb-config", default=None,
                   help='EPLB settings, a JSON object: {"window_size": 1000, "step_interval": 3000, '
                        '"num_redundant_experts": 0, "use_async": true, "log_balancedness": false}')
    p.add_argument("--limit-mm-per-prompt", type=json.loads, default=None,
                   help='images per prompt at most, as vLLM spells it: \'{"image": 4}\' (default 999)')
    p.add_argument("--allowed-media-domains", nargs="*", default=[],
                   help="hosts http(s) image URLs may name (default: none; only data: URLs)")
    p.add_argument("--ec-transfer-config", default=None,
                   help='share encoder outputs between instances, a JSON object: {"ec_connector": "shared_storage", '
                        '"ec_role": "ec_producer|ec_consumer|ec_both", "ec_connector_extra_config": '
                        '{"shared_storage_path": "/path"}}')
    p.add_argument("--ec-defer-timeout", type=float, default=30.0,
                   help="seconds a request may wait for its encoder outputs from the EC connector; then it fails")
    p.add_argument("--distributed-executor-backend", "--executor", dest="executor", default=None,
                   choices=["mp", "ray", "uni", "inproc"],
                   help="where the model runs: mp (worker processes of this machine), ray (Ray actors, on the "
                        "cluster at RAY_ADDRESS or a local one), uni or inproc (a thread of the engine); default: "
                        "uni, or mp with tensor parallelism")
    p.add_argument("--quantization", "-q", default=None, metavar="{" + ",".join(QUANTIZATIONS) + "}",
                   help="quantized linear layers, quantized at load: int8 weight-only per output channel, w8a8 with "
                        "activations quantized per row at run time too, or int4 weight-only in groups of 32 "
                        "(default: as stored; a GGUF file of quantized tensors runs as int8)")
    p.add_argument("--pooling-type", default=None, choices=["mean", "cls", "last"],
                   help="how embeddings pool hidden states (default: the model's config; decoders: last); "
                        "--pooler-config's pooling_type says the same")
    p.add_argument("--pooler-config", default=None,
                   help='vLLM\'s pooling options as JSON: {"task": "embed"|"classify", "pooling_type": '
                        '"MEAN"|"CLS"|"LAST", "use_activation": bool, "enable_chunked_processing": bool, '
                        '"max_embed_len": int}')
    p.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                   help="generate: serve generation only; pooling: serve embeddings, pooling, score and rerank "
                        "only; auto: what the model can")
    p.add_argument("--enable-prompt-embeds", action="store_true",
                   help="accept prompt_embeds (base64 torch.save tensors) in completions")
    p.add_argument("--renderer-workers", type=int, default=None,
                   help="threads that tokenize long prompts and decode prompt embeddings (default: CPUs - 1, <= 4)")
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults: auto (the model's generation_config.json), vllm (none), or a directory")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one (default: the tokenizer's)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="refused: trio-llm runs no code from model directories")
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (--lora-modules)")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help='LoRA adapters (PEFT directories) as name=path, or JSON {"name": ..., "path": ..., '
                        '"base_model_name": ...}; a request names one in its model field')
    p.add_argument("--max-loras", type=int, default=1, help="LoRA adapters in one batch")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="LoRA adapters held in memory (default --max-loras; least recently used are evicted)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the largest LoRA rank served")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter, with slots for any adapter up to "
                        "--max-lora-rank (also VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)")
    add_foreign_flags(p, ENGINE_FLAGS)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from the parsed options."""
    return {"dtype": DTYPE_ALIASES.get(args.dtype, args.dtype), "tokenizer": args.tokenizer,
            "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_logprobs": args.max_logprobs, "block_size": args.block_size,
            "num_kv_blocks": args.num_gpu_blocks_override, "max_prompts_per_request": args.max_prompts_per_request,
            "kv_cache_memory_bytes": kv_cache_bytes(args.kv_cache_memory_bytes, args.device, os.environ),
            **({} if args.gpu_memory_utilization is None else {"gpu_memory_utilization": args.gpu_memory_utilization}),
            "device": args.device, "seed": getattr(args, "seed", None) or 0,
            "enable_prefix_caching": args.enable_prefix_caching,
            "prefix_caching_hash_algo": args.prefix_caching_hash_algo,
            "enable_chunked_prefill": args.enable_chunked_prefill, "scheduling_policy": args.scheduling_policy,
            "cpu_layout": parse_cpu_threads_bind(args.cpu_threads_bind, available_cpus()),
            "adaptive_cpu_threads": args.adaptive_cpu_threads,
            "enforce_eager": args.enforce_eager, "async_scheduling": args.async_scheduling,
            "compilation_config": CompilationConfig.from_json(args.compilation_config or "{}"),
            "structured_outputs_config": StructuredOutputsConfig.from_json(args.structured_outputs_config or "{}"),
            "enable_prompt_embeds": args.enable_prompt_embeds,
            "renderer_workers": args.renderer_workers, "tensor_parallel_size": args.tensor_parallel_size,
            "data_parallel_size": args.data_parallel_size, "pipeline_parallel_size": args.pipeline_parallel_size,
            "pipeline_layer_partition": layer_partition_from_env() if args.pipeline_parallel_size > 1 else None,
            "executor": "inproc" if args.executor == "uni" else args.executor,
            "pooling_type": args.pooling_type, "chat_template": args.chat_template,
            "quantization": args.quantization,
            "pooler_config": PoolerOptions.from_json(args.pooler_config or "{}"), "runner": args.runner,
            "generation_config": args.generation_config,
            "enable_expert_parallel": args.enable_expert_parallel, "enable_eplb": args.enable_eplb,
            "eplb_config": EplbConfig.from_json(args.eplb_config or "{}"),
            "limit_images_per_prompt": images_per_prompt(args.limit_mm_per_prompt),
            "allowed_media_domains": tuple(args.allowed_media_domains),
            "ec_transfer_config": ECTransferConfig.from_json(args.ec_transfer_config) if args.ec_transfer_config
            else None,
            "ec_defer_timeout": args.ec_defer_timeout,
            "enable_lora": args.enable_lora,
            "lora_modules": tuple(LoRAModule.parse(text) for text in args.lora_modules),
            "max_loras": args.max_loras, "max_cpu_loras": args.max_cpu_loras, "max_lora_rank": args.max_lora_rank,
            # the flag without --enable-lora is refused; vLLM's variable, set for a whole machine, is not
            "allow_runtime_lora_updating": args.allow_runtime_lora_updating
            or (args.enable_lora and runtime_lora_updating_from(os.environ))}


def runtime_lora_updating_from(environ: Mapping[str, str]) -> bool:
    """vLLM's switch: `VLLM_ALLOW_RUNTIME_LORA_UPDATING` set to 1 or true (any case)."""
    return environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


def images_per_prompt(value: Any) -> int:
    """--limit-mm-per-prompt: {"image": N}; other modalities are refused (trio-llm reads images only)."""
    if value is None:
        return 999
    if not isinstance(value, dict) or set(value) - {"image"}:
        raise ValueError('--limit-mm-per-prompt takes {"image": N}: images are the only modality served')
    count = value.get("image", 999)
    if type(count) is not int or count < 0:
        raise ValueError(f"--limit-mm-per-prompt image must be a non-negative integer, got {count!r}")
    return count


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
    srv.add_argument("--served-model-name", default=None, help="the model's name in the API (default: its path)")
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
    srv.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                     help="the format tool calls are written in: hermes (<tool_call>...</tool_call>), llama3_json")
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
    srv.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                     help="put the model's <think>...</think> part in reasoning_content")
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
    if getattr(args, "trust_remote_code", False):
        reasons.append("--trust-remote-code: trio-llm runs no code from model directories; it loads the "
                       "architectures it implements (Llama, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, LLaVA, "
                       "BERT and its cross-encoders, ColBERT) from their weights")
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
