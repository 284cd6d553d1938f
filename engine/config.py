"""Engine configuration: frozen, validated at construction with clear `ValueError`s.

Values only known once the model is loaded (number of KV blocks, context
length, EOS ids) live in `engine.model_info.ModelInfo`, not here.
"""

from __future__ import annotations

import json
import os
from argparse import BooleanOptionalAction
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

from engine.cpu_binding import CpuLayout, available_cpus, parse_cpu_threads_bind

_DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's --dtype spellings: its other names for them
_POLICIES = ("fcfs", "priority")
_EXECUTORS = ("inproc", "mp", "ray")
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")  # engine.sched.prefix_hash.HASH_ALGOS
QUANTIZATIONS = ("int8", "w8a8", "int4", "q8_0", "q4_0")
# --kv-cache-dtype: vLLM's auto and bfloat16, and float16 (what llama.cpp holds its cache in); fp8 is not implemented
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")
# Decode bursts' length where they are the default (`EngineConfig.scheduler_steps`). A burst ends
# early when a request finishes or a message waits, so its length bounds only the KV slots taken
# ahead and how often a full schedule and a hand-off to the worker thread (~0.4 ms on a 2-core VM)
# break the run: on the small Llama's Q8_0 file 32 served one stream 1.05x and sixteen 1.04x what
# 8 did, and 8 one stream 1.36-1.4x what one did (docs/benchmarks.md, "Longer bursts").
CPU_BURST_STEPS = 32
Q8_0_ACTIVATIONS = ("auto", "float32", "int8")  # --q8-0-activations
TRUST_REMOTE_CODE_REFUSED = ("trust_remote_code: trio-llm runs no code from model directories; it loads the "
                             "architectures it implements (Llama, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, "
                             "LLaVA, BERT and its cross-encoders, ColBERT) from their weights")
_POOLING_TYPES = ("mean", "cls", "last")
_RUNNERS = ("auto", "generate", "pooling")


class _SameAsField:
    """`Flag.cli_default` when the parser's default is the field's."""

    def __repr__(self) -> str:
        return "SAME_AS_FIELD"


SAME_AS_FIELD: Any = _SameAsField()


@dataclass(frozen=True)
class Flag:
    """How an `EngineConfig` field is given on the command line. The field declares it once
    (`flag`); `web.options` builds the parser from it and turns what was parsed into the field's
    value (`from_cli`). `names`: the flags (default: --the-field-name); `cli_default`: the
    parser's default where it differs from the field's (None: "not given", the field's default
    then applies); `argparse`: the rest of `add_argument`'s keywords."""

    help: str
    names: tuple[str, ...] = ()
    argparse: dict[str, Any] = field(default_factory=dict)
    cli_default: Any = SAME_AS_FIELD
    from_cli: Callable[[Any], Any] | None = None


def flag(help: str, *, default: Any = MISSING, default_factory: Any = MISSING, names: tuple[str, ...] = (),
         cli_default: Any = SAME_AS_FIELD, from_cli: Callable[[Any], Any] | None = None, **argparse: Any) -> Any:
    """A dataclass field with its command-line flag (`Flag`)."""
    metadata = {"flag": Flag(help, names, argparse, cli_default, from_cli)}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _dtype_from_cli(value: str) -> str:
    return DTYPE_ALIASES.get(value, value)


def _executor_from_cli(value: str | None) -> str | None:
    return "inproc" if value == "uni" else value  # vLLM's name for one process


def _cpu_layout_from_cli(value: str) -> CpuLayout | None:
    return parse_cpu_threads_bind(value, available_cpus())


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


@dataclass(frozen=True)
class EplbConfig:
    """Expert-parallel load balancing (`--eplb-config`, vLLM's keys and defaults).

    Every `step_interval` engine steps, the load of the last `window_size` steps decides a new
    placement of the experts (with `num_redundant_experts` extra slots per MoE layer for
    replicas of hot experts); `use_async` moves the weights layer by layer while inference goes
    on, otherwise all at once at a step boundary."""

    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int = 0
    use_async: bool = True
    log_balancedness: bool = False

    def __post_init__(self) -> None:
        for name, minimum in (("window_size", 1), ("step_interval", 1), ("num_redundant_experts", 0)):
            value = getattr(self, name)
            if type(value) is not int or value < minimum:
                kind = "a positive integer" if minimum else "a non-negative integer"
                raise ValueError(f"eplb_config.{name} must be {kind}, got {value!r}")
        for name in ("use_async", "log_balancedness"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"eplb_config.{name} must be true or false, got {getattr(self, name)!r}")

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> EplbConfig:
        """From `--eplb-config`'s JSON object; `ValueError` naming an unknown key or a bad value."""
        return cls(**_json_options(text, "eplb_config", {f.name for f in fields(cls)}))


def _json_options(text: str | dict[str, Any], name: str, known: set[str]) -> dict[str, Any]:
    """A JSON object of options (a flag's value), with only `known` keys; `ValueError` otherwise."""
    try:
        raw = json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{name} has unknown key {unknown[0]!r}; known keys: {', '.join(sorted(known))}")
    return raw


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """`--structured-outputs-config` (vLLM's flag; our key): `max_integer_digits` bounds a JSON
    schema's integers that have no `minimum`/`maximum` to that many digits (default 18: any
    int64 a client's parser reads back exactly); null leaves them unbounded."""

    max_integer_digits: int | None = 18

    def __post_init__(self) -> None:
        digits = self.max_integer_digits
        if digits is not None and (type(digits) is not int or not 1 <= digits <= 300):
            raise ValueError(f"structured_outputs_config.max_integer_digits must be 1-300 or null, got {digits!r}")

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> StructuredOutputsConfig:
        """From `--structured-outputs-config`'s JSON object; `ValueError` naming an unknown key or a bad value."""
        return cls(**_json_options(text, "structured_outputs_config", {f.name for f in fields(cls)}))


_POOLING_TASKS = ("embed", "token_embed", "classify")


@dataclass(frozen=True)
class PoolerOptions:
    """`--pooler-config` (vLLM's flag and key names, the keys below): what a pooling model serves
    and how. `task`: the pooling task it serves (default: `classify` for a model with a
    classification head, `embed` with `token_embed` otherwise); `pooling_type`: MEAN, CLS or LAST
    over the hidden states (default: the model's sentence-transformers config); `use_activation`:
    the default for requests that leave it unset (embed: L2-normalize; classify: softmax or
    sigmoid; default true); `enable_chunked_processing`: embed inputs longer than the context in
    chunks of at most the context's length, pooled as their token-weighted mean; `max_embed_len`:
    the longest input accepted for embedding (default: the context's length)."""

    task: str | None = None
    pooling_type: str | None = None
    use_activation: bool | None = None
    enable_chunked_processing: bool = False
    max_embed_len: int | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in _POOLING_TASKS:
            raise ValueError(f"pooler_config.task must be one of {', '.join(_POOLING_TASKS)}, got {self.task!r}")
        if self.pooling_type is not None:
            kind = str(self.pooling_type).lower()
            if kind not in _POOLING_TYPES:
                raise ValueError(f"pooler_config.pooling_type must be MEAN, CLS or LAST, got {self.pooling_type!r}")
            object.__setattr__(self, "pooling_type", kind)
        for name in ("use_activation", "enable_chunked_processing"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"pooler_config.{name} must be true or false, got {value!r}")
        size = self.max_embed_len
        if size is not None and (type(size) is not int or size < 1):
            raise ValueError(f"pooler_config.max_embed_len must be a positive integer, got {size!r}")

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> PoolerOptions:
        """From `--pooler-config`'s JSON object; `ValueError` naming an unknown key or a bad value
        (vLLM's `seq_pooling_type` is taken as `pooling_type`)."""
        raw = dict(_json_options(text, "pooler_config", {f.name for f in fields(cls)} | {"seq_pooling_type"}))
        if "seq_pooling_type" in raw:
            raw["pooling_type"] = raw.pop("seq_pooling_type")
        return cls(**raw)


DEFAULT_KV_CACHE_BYTES = 1 << 30  # the KV cache off CUDA when no size is given


def vllm_capture_sizes(max_num_seqs: int, largest: int | None = None) -> tuple[int, ...]:
    """vLLM's default `cudagraph_capture_sizes`: 1, 2, 4, then every 8 up to 248, then every 16,
    up to `largest` (vLLM's `max_cudagraph_capture_size`; default min(2 x max_num_seqs, 512))."""
    top = min(max_num_seqs * 2, 512) if largest is None else largest
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, top + 1, 16)]
    return tuple(s for s in sizes if s <= top)



@dataclass(frozen=True)
class CompilationConfig:
    """`--compilation-config` (a subset of vLLM's keys): the batch sizes the decode graph is warmed
    up at on CPU (`cudagraph_capture_sizes`; default powers of two up to 64, capped at max_num_seqs;
    the graph's batch is dynamic, so the largest is what counts: larger batches run eagerly) or
    captured at on CUDA (default vLLM's: 1, 2, 4, every 8 to 248, every 16 above, up to
    `max_cudagraph_capture_size`, by default min(2 x max_num_seqs, 512); a batch is padded up to
    the next size), and
    where compiled artefacts are cached (`cache_dir`; default
    $XDG_CACHE_HOME/trio-llm/torch_compile, by default ~/.cache/trio-llm/torch_compile, or
    TORCHINDUCTOR_CACHE_DIR if set). `compile_prompts` (ours; default true): prompt chunks and
    the other steps the decode graph does not take run a compiled graph too, attention eager
    inside it (engine/worker/step_graph.py); false keeps them eager. `mode` (vLLM's: 0 none, 1-3
    compiled; default 3): 0 compiles nothing, so on CUDA the captured graphs replay the eager
    model's kernels and on CPU steps run eagerly; any other compiles as the default does."""

    cudagraph_capture_sizes: tuple[int, ...] | None = None
    max_cudagraph_capture_size: int | None = None
    cache_dir: str | None = None
    compile_prompts: bool = True
    mode: int | None = None

    @property
    def compiles(self) -> bool:
        """Whether the model is compiled (every `mode` but 0)."""
        return self.mode != 0

    def __post_init__(self) -> None:
        if self.mode is not None and (type(self.mode) is not int or not 0 <= self.mode <= 3):
            raise ValueError(f"compilation_config.mode must be 0, 1, 2 or 3 (vLLM's compilation modes), "
                             f"got {self.mode!r}")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None:
            if not isinstance(sizes, (list, tuple)) or not sizes or \
                    not all(type(b) is int and b >= 1 for b in sizes):
                raise ValueError(f"compilation_config.cudagraph_capture_sizes must be a non-empty list of positive "
                                 f"integers, got {sizes!r}")
            object.__setattr__(self, "cudagraph_capture_sizes", tuple(sorted(set(sizes))))
        largest = self.max_cudagraph_capture_size
        if largest is not None and (type(largest) is not int or largest < 1):
            raise ValueError("compilation_config.max_cudagraph_capture_size must be a positive integer, "
                             f"got {largest!r}")
        if self.cache_dir is not None and (not isinstance(self.cache_dir, str) or not self.cache_dir):
            raise ValueError(f"compilation_config.cache_dir must be a directory, got {self.cache_dir!r}")
        if not isinstance(self.compile_prompts, bool):
            raise ValueError(f"compilation_config.compile_prompts must be true or false, got {self.compile_prompts!r}")

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> CompilationConfig:
        """From `--compilation-config`'s JSON object; `ValueError` naming an unknown key or a bad value."""
        return cls(**_json_options(text, "compilation_config", {f.name for f in fields(cls)}))


def eager_by_default() -> bool:
    """TRIO_LLM_ENFORCE_EAGER=1 makes eager the default where `enforce_eager` is not given (the
    test suite sets it: its many short-lived engines would each compile)."""
    return os.environ.get("TRIO_LLM_ENFORCE_EAGER", "") not in ("", "0")


_EC_ROLES = ("ec_producer", "ec_consumer", "ec_both")


@dataclass(frozen=True)
class ECTransferConfig:
    """`--ec-transfer-config` (vLLM's keys): share encoder outputs between instances. The one
    connector is `shared_storage`: a directory every instance mounts (`shared_storage_path` in
    `ec_connector_extra_config`). Producers save what they encode; consumers load what is there
    instead of encoding it."""

    ec_connector: str = "shared_storage"
    ec_role: str = "ec_both"
    ec_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.ec_connector != "shared_storage":
            raise ValueError(f"ec_transfer_config.ec_connector must be 'shared_storage', got {self.ec_connector!r}")
        if self.ec_role not in _EC_ROLES:
            raise ValueError(f"ec_transfer_config.ec_role must be one of {', '.join(_EC_ROLES)}, got {self.ec_role!r}")
        extra = self.ec_connector_extra_config
        path = extra.get("shared_storage_path") if isinstance(extra, dict) else None
        if not isinstance(path, str) or not path:
            raise ValueError("ec_transfer_config.ec_connector_extra_config needs a shared_storage_path (a directory)")
        unknown = sorted(set(extra) - {"shared_storage_path"})
        if unknown:
            raise ValueError(f"ec_transfer_config.ec_connector_extra_config has unknown key {unknown[0]!r}")

    @property
    def storage_path(self) -> str:
        return str(self.ec_connector_extra_config["shared_storage_path"])

    @property
    def is_producer(self) -> bool:
        return self.ec_role in ("ec_producer", "ec_both")

    @property
    def is_consumer(self) -> bool:
        return self.ec_role in ("ec_consumer", "ec_both")

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> ECTransferConfig:
        """From `--ec-transfer-config`'s JSON object; `ValueError` naming an unknown key or a bad value."""
        return cls(**_json_options(text, "ec_transfer_config", {f.name for f in fields(cls)}))


@dataclass(frozen=True)
class LoRAModule:
    """One adapter the engine serves: `name` is what requests ask for (the `model` field), `path`
    its PEFT directory; `base_model_name` (vLLM's JSON form) is the model /v1/models lists as its
    parent (default: the served model)."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoRAModule:
        """vLLM's `--lora-modules` forms: `name=path`, or a JSON object with `name`, `path` and
        optionally `base_model_name`; `ValueError` naming the problem."""
        if text.lstrip().startswith("{"):
            try:
                spec = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--lora-modules: not valid JSON: {exc}") from None
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) \
                    or not isinstance(spec.get("path"), str):
                raise ValueError(f"--lora-modules: a JSON module needs string name and path, got {text!r}")
            unknown = set(spec) - {"name", "path", "base_model_name"}
            if unknown:
                raise ValueError(f"--lora-modules: unknown keys {sorted(unknown)}")
            base = spec.get("base_model_name")
            if base is not None and not isinstance(base, str):
                raise ValueError(f"--lora-modules: base_model_name must be a string, got {base!r}")
            return cls(spec["name"], spec["path"], base)
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path or a JSON object, got {text!r}")
        return cls(name, path)


def _json_flag(config: Any) -> Callable[[str | None], Any]:
    """A flag whose value is a JSON object for `config` (absent: its defaults)."""
    return lambda text: config.from_json(text or "{}")


def _ec_transfer_from_cli(text: str | None) -> ECTransferConfig | None:
    return ECTransferConfig.from_json(text) if text else None


def _lora_modules_from_cli(texts: list[str]) -> tuple[LoRAModule, ...]:
    return tuple(LoRAModule.parse(text) for text in texts)


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to open an engine. `model` is a local HF-format directory."""

    model: str
    dtype: str = flag(
        "weights and activations (auto: the checkpoint's torch_dtype; half: float16, float: float32, "
        "as in vLLM)",
        default="auto",
        choices=[*_DTYPES, *DTYPE_ALIASES],
        from_cli=_dtype_from_cli)
    kv_cache_dtype: str = flag(
        "the KV cache's dtype: auto (the model's, as in vLLM), bfloat16 or float16. A 16-bit cache "
        "under a float32 model (a GGUF file's default) holds twice the tokens in the same memory, and "
        "decode attention reads half the bytes; attention still computes in the model's dtype "
        "(llama.cpp holds its cache in float16). fp8 caches are not implemented",
        default="auto",
        metavar="{" + ",".join(KV_CACHE_DTYPES) + "}")
    tokenizer: str | None = flag(
        "tokenizer directory or Hugging Face hub id (default: the model's)",
        default=None)
    revision: str | None = flag(
        "the model's branch, tag or commit on the Hugging Face hub (default: main)",
        default=None)
    tokenizer_revision: str | None = flag(
        "the tokenizer's branch, tag or commit on the hub (default: the model's)",
        default=None)
    download_dir: str | None = flag(
        "where hub snapshots are kept (default: HF_HUB_CACHE, or $HF_HOME/hub)",
        default=None)
    max_model_len: int | None = flag(
        "context length (default: the model's max_position_embeddings)",
        default=None,
        type=int)
    max_num_seqs: int = flag(
        "requests in one batch at most",
        default=256,
        type=int)
    max_num_batched_tokens: int | None = flag(
        "tokens in one step at most (default: max(2048, max-num-seqs))",
        default=None,
        type=int)
    max_logprobs: int = flag(
        "the largest logprobs / prompt_logprobs accepted",
        default=20,
        type=int)
    max_prompts_per_request: int = flag(
        "prompts (or embeddings inputs) one request may carry",
        default=2048,
        type=int)
    # Memory for the KV cache, per rank. None: on CUDA what gpu_memory_utilization leaves (measured
    # at start-up, engine/worker/gpu_memory.py), elsewhere DEFAULT_KV_CACHE_BYTES.
    kv_cache_memory_bytes: int | None = flag(
        "memory for the KV cache, per rank (default: VLLM_CPU_KVCACHE_SPACE GiB if set, else 1 GiB)",
        default=None,
        type=int)
    block_size: int = flag(
        "tokens per KV cache block",
        default=16,
        type=int)
    num_kv_blocks: int | None = flag(  # overrides the budget (tests use it to force preemption)
        "KV cache blocks, whatever --kv-cache-memory-bytes allows (vLLM's name; the cache is on the "
        "--device)",
        default=None,
        names=("--num-gpu-blocks-override",),
        type=int)
    gpu_memory_utilization: float = flag(
        "share of each GPU the engine may use (default 0.9): the KV cache takes what the weights, "
        "activations and CUDA graphs leave, measured at start-up; CUDA only "
        "(--kv-cache-memory-bytes wins)",
        default=0.9,
        cli_default=None,
        type=float)
    device: str = flag(
        "torch device the model runs on",
        default="cpu")
    seed: int = flag(
        "seed of the sampler's generator for unseeded requests",
        default=0,
        type=int)
    enable_prefix_caching: bool = flag(
        "reuse the KV of shared prompt prefixes",
        default=True,
        action=BooleanOptionalAction)
    prefix_caching_hash_algo: str = flag(
        "block identity (xxhash: faster, not cryptographic: only if every prompt is trusted)",
        default="sha256",
        choices=HASH_ALGOS)
    enable_chunked_prefill: bool = flag(
        "split long prompts over several steps",
        default=True,
        action=BooleanOptionalAction)
    scheduling_policy: str = flag(
        "the waiting queue's order: arrival, or each request's `priority` (lower first; ties by "
        "arrival)",
        default="fcfs",
        choices=_POLICIES)
    # --cpu-threads-bind: the forward pass's CPUs and the event loop's (None: no binding, torch's
    # default thread count)
    cpu_layout: CpuLayout | None = flag(
        "CPUs of the forward pass: auto (the default, as vLLM-CPU's: all but the first, which the "
        "HTTP server keeps and, with --adaptive-cpu-threads, lends to steps that run faster on it; it "
        "survives a busy neighbour, docs/benchmarks.md), none (no binding, "
        "torch's default threads) or a list such as 1 or 0-2,5 (vLLM-CPU's VLLM_CPU_OMP_THREADS_BIND)",
        default=None,
        names=("--cpu-threads-bind",),
        cli_default="auto",
        from_cli=_cpu_layout_from_cli)
    # Let each step's intra-op thread count move within 1..the compute CPUs, to whichever steps
    # fastest now (engine/worker/thread_tuner.py): fewer when a neighbour takes a core. False: the
    # count stays where the layout (or torch's default) puts it. CPU only.
    adaptive_cpu_threads: bool = flag(
        "let each forward pass use between 1 thread and one per compute CPU (and, with "
        "--cpu-threads-bind auto, one on the server's CPU), whichever steps fastest now (fewer when "
        "another process takes a core); --no-adaptive-cpu-threads keeps one per compute CPU",
        default=True,
        action=BooleanOptionalAction)
    # vLLM's --async-scheduling: the core schedules step N+1 while step N runs (a decode's input is
    # then the token N is sampling, filled in by the worker), so scheduling and publishing a step's
    # outputs overlap the next step's forward pass. One worker only (no tensor or pipeline
    # parallelism, no EPLB). None: as vLLM 0.14+, on where it can be on a CUDA device, off on CPU
    # (see `schedules_async`).
    async_scheduling: bool | None = flag(
        "schedule each step while the one before it runs (vLLM's async scheduling; default: on "
        "with one worker on CUDA, off on CPU)",
        default=None,
        action=BooleanOptionalAction)
    # vLLM v0's --num-scheduler-steps (multi-step scheduling): while every running request decodes
    # and none waits, a step may run up to this many decodes back to back in the worker, so the
    # engine's hand-offs to the worker are paid once per burst. In process each step's tokens are
    # published while the next computes (engine/executor/streamed_burst.py), and the burst ends
    # early when a request finishes or a message waits; from a worker process tokens arrive in
    # bursts. One worker, without async scheduling. None: `scheduler_steps` decides
    # (CPU_BURST_STEPS where bursts stream token by token on CPU, else 1).
    num_scheduler_steps: int | None = flag(
        "run up to this many decode steps back to back while every running request decodes and "
        "none waits (vLLM v0's multi-step scheduling; in process each token still streams as it is "
        f"sampled, from a worker process in bursts; 1: off) (default: {CPU_BURST_STEPS} on CPU with "
        "the worker in the engine's process and no async scheduling, else 1)",
        default=None,
        type=int)
    # Decode steps run a torch.compile'd graph with a dynamic batch (engine.worker.decode_graphs);
    # True keeps every step on the eager model (vLLM's --enforce-eager). None: compile, unless
    # TRIO_LLM_ENFORCE_EAGER is set (see eager_by_default).
    enforce_eager: bool | None = flag(
        "run every step on the eager model (default: decode steps run one graph compiled at "
        "start-up, by AOTInductor for dense models and torch.compile for MoE ones, cached on disk)",
        default=None,
        action="store_true")
    # A first start compiles for minutes (decode_graphs.compile_estimate). True: the engine serves
    # at once, eagerly, while a child process compiles and saves the graphs; the worker adopts them
    # between two steps (engine/core/background_compile.py). Later starts load them either way. One
    # worker of a dense model on a CPU; elsewhere start-up compiles as with False.
    compile_in_background: bool = flag(
        "on a first start, serve at once on the eager model while a child process compiles the "
        "graphs, and switch to them when they are ready (`serve`'s default; "
        "--no-compile-in-background compiles before serving, as the library does)",
        default=False,
        cli_default=True,
        action=BooleanOptionalAction)
    compilation_config: CompilationConfig = flag(
        'compiled decode graphs, a JSON object: {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, '
        '64], "cache_dir": "~/.cache/trio-llm/torch_compile"} (the cache follows XDG_CACHE_HOME)',
        default_factory=CompilationConfig,
        names=("--compilation-config", "-cc",),
        cli_default=None,
        from_cli=_json_flag(CompilationConfig))
    structured_outputs_config: StructuredOutputsConfig = flag(
        'structured outputs, a JSON object: {"max_integer_digits": 18} (JSON schema integers '
        'without bounds get that many digits at most; null: unbounded)',
        default_factory=StructuredOutputsConfig,
        cli_default=None,
        from_cli=_json_flag(StructuredOutputsConfig))
    tensor_parallel_size: int = flag(
        "worker processes, one per rank",
        default=1,
        names=("--tensor-parallel-size", "-tp",),
        type=int)
    # Consecutive layers on each of N stages of worker processes (each stage tensor_parallel_size
    # ranks), N steps in flight at once so every stage has work (engine/models/parallel.py).
    pipeline_parallel_size: int = flag(
        "pipeline stages of worker processes, each holding consecutive layers (times "
        "--tensor-parallel-size ranks each); as many steps in flight as stages",
        default=1,
        names=("--pipeline-parallel-size", "-pp",),
        type=int)
    # Engines behind one API server, each with its own scheduler, KV cache and workers; requests
    # go to the least loaded, prefix-aware (engine/core/data_parallel.py). Engine processes only.
    data_parallel_size: int = flag(
        "engines behind this server, each with its own scheduler, KV cache and workers (the "
        "compute CPUs split between them); requests go to the least loaded, prefix-aware",
        default=1,
        names=("--data-parallel-size", "-dp",),
        type=int)
    # MoE models: split the experts over the tensor-parallel ranks instead of sharding each one
    enable_expert_parallel: bool = flag(
        "MoE models: split the experts over the tensor-parallel ranks instead of sharding each",
        default=False,
        action="store_true")
    enable_eplb: bool = flag(
        "MoE models: rebalance experts over the ranks by their measured load",
        default=False,
        action="store_true")
    eplb_config: EplbConfig = flag(
        'EPLB settings, a JSON object: {"window_size": 1000, "step_interval": 3000, '
        '"num_redundant_experts": 0, "use_async": true, "log_balancedness": false}',
        default_factory=EplbConfig,
        cli_default=None,
        from_cli=_json_flag(EplbConfig))
    # Images (vision-language models): per prompt at most (vLLM's --limit-mm-per-prompt), bytes of one
    # encoded image, pixels of one decoded image, and the hosts http(s) image URLs may name (none:
    # only data: URLs, so the server fetches nothing on a client's behalf).
    limit_images_per_prompt: int = flag(
        'images per prompt at most, as vLLM spells it: \'{"image": 4}\' (default 999)',
        default=999,
        names=("--limit-mm-per-prompt",),
        cli_default=None,
        type=json.loads,
        from_cli=images_per_prompt)
    allowed_media_domains: tuple[str, ...] = flag(
        "hosts http(s) image URLs may name (default: none; only data: URLs)",
        default=(),
        cli_default=[],
        nargs="*",
        from_cli=tuple)
    ec_transfer_config: ECTransferConfig | None = flag(
        'share encoder outputs between instances, a JSON object: {"ec_connector": "shared_storage", '
        '"ec_role": "ec_producer|ec_consumer|ec_both", "ec_connector_extra_config": '
        '{"shared_storage_path": "/path"}}',
        default=None,
        from_cli=_ec_transfer_from_cli)
    ec_defer_timeout: float = flag(
        "seconds a request may wait for its encoder outputs from the EC connector; then it fails",
        default=30.0,
        type=float)
    # "inproc" (a worker thread), "mp" (worker processes) or "ray" (workers as Ray actors, engine/executor/
    # ray_executor.py); default: mp when tensor_parallel_size > 1
    executor: str | None = flag(
        "where the model runs: mp (worker processes of this machine), ray (Ray actors, on the "
        "cluster at RAY_ADDRESS or a local one), uni or inproc (a thread of the engine); default: "
        "uni, or mp with tensor parallelism",
        default=None,
        names=("--distributed-executor-backend", "--executor",),
        choices=["mp", "ray", "uni", "inproc"],
        from_cli=_executor_from_cli)
    # Quantized linear layers, quantized at load (vLLM's --quantization): "int8" (weight-only), "w8a8"
    # (activations quantized per row too), "int4" (weight-only, groups of 32), "q8_0" (int8 with a
    # scale per block of 32, GGUF's Q8_0) or "q4_0" (4-bit steps with a scale per block of 32, GGUF's
    # Q4_0); None: as stored (a GGUF file's Q8_0/Q5_0 and Q4_0/Q4_1/Q4_K tensors keep their blocks as
    # q8_0 and q4_0/q4_1/q4_k, tensors of other block formats run as q8_0 unless this says otherwise).
    # engine/models/quantized_linear.py.
    quantization: str | None = flag(
        "quantized linear layers, quantized at load: int8 weight-only per output channel, w8a8 with "
        "activations quantized per row at run time too, int4 weight-only in groups of 32, q8_0: "
        "int8 with a scale per block of 32, or q4_0: 4-bit steps with a scale per block of 32 (default: "
        "as stored; a GGUF file's Q8_0, Q5_0, Q4_0, Q4_1 and Q4_K tensors keep their blocks, other block "
        "formats run as q8_0)",
        default=None,
        names=("--quantization", "-q",),
        metavar="{" + ",".join(QUANTIZATIONS) + "}")
    # How a batch of decodes multiplies q8_0 weights: auto (two int8 levels of each row through layers
    # whose tiles are laid out for it at load: every layer of at most 512 features, wider ones within
    # a memory budget; float32 rows elsewhere), float32
    # rows always, or rows rounded to int8 per block of 32 first, as llama.cpp multiplies a Q8_0
    # weight (AVX-512 VNNI only; engine/kernels/q8_0_rows.c; docs/decisions.md).
    q8_0_activations: str = flag(
        "how a batch of decodes multiplies q8_0 weights: auto (the layers meet the rows as two int8 levels, "
        "~16 bits a value, on tiles laid out at load, a second copy of the weights (wider than 512 features: "
        "within a quarter of the machine's memory), where the CPU has AVX-512 VNNI; float32 rows elsewhere), "
        "float32 (rows as they are, no copy) or int8 (each row rounded to int8 per "
        "block of 32 first, llama.cpp's Q8_0 x Q8_0 arithmetic: faster at many decodes, less faithful; "
        "AVX-512 VNNI only). "
        "Prompts take auto's tiles too, up to 1,024 tokens a step; past that, or without tiles, the dequantized "
        "weights' matmul",
        default="auto",
        choices=list(Q8_0_ACTIVATIONS))
    pooling_type: str | None = flag(
        "how embeddings pool hidden states (default: the model's config; decoders: last); "
        "--pooler-config's pooling_type says the same",
        default=None,
        choices=_POOLING_TYPES)
    pooler_config: PoolerOptions = flag(
        'vLLM\'s pooling options as JSON: {"task": "embed"|"classify", "pooling_type": '
        '"MEAN"|"CLS"|"LAST", "use_activation": bool, "enable_chunked_processing": bool, '
        '"max_embed_len": int}',
        default_factory=PoolerOptions,
        cli_default=None,
        from_cli=_json_flag(PoolerOptions))
    # vLLM's --runner: "generate" serves generation only, "pooling" pooling only, "auto" what the
    # model can (a decoder both, an encoder pooling).
    runner: str = flag(
        "generate: serve generation only; pooling: serve embeddings, pooling, score and rerank "
        "only; auto: what the model can",
        default="auto",
        choices=_RUNNERS)
    enable_prompt_embeds: bool = flag(
        "accept prompt_embeds (base64 torch.save tensors) in completions",
        default=False,
        action="store_true")
    renderer_workers: int | None = flag(  # see renderer_threads
        "threads that tokenize long prompts and decode prompt embeddings (default: CPUs - 1, <= 4)",
        default=None,
        type=int)
    generation_config: str = flag(
        "sampling defaults: auto (the model's generation_config.json), vllm (none), or a directory",
        default="auto")
    chat_template: str | None = flag(
        "a Jinja chat template, or a file holding one (default: the tokenizer's)",
        default=None)
    # vLLM's: refused (trio-llm runs no code from model directories); the option exists to say so
    # vLLM's: refused (the option exists to say why); trio-llm runs no code from model directories
    trust_remote_code: bool = flag(
        "refused: trio-llm runs no code from model directories",
        default=False,
        action="store_true")
    # LoRA adapters (engine/lora): vLLM's --enable-lora, --lora-modules (name -> PEFT directory),
    # --max-loras (adapters in one batch), --max-cpu-loras (held in memory; default max_loras,
    # least recently used evicted and read again when used), --max-lora-rank.
    enable_lora: bool = flag(
        "serve LoRA adapters (--lora-modules)",
        default=False,
        action="store_true")
    lora_modules: tuple[LoRAModule, ...] = flag(
        'LoRA adapters (PEFT directories) as name=path, or JSON {"name": ..., "path": ..., '
        '"base_model_name": ...}; a request names one in its model field',
        cli_default=[],
        nargs="+",
        default=(),
        metavar="NAME=PATH",
        from_cli=_lora_modules_from_cli)
    max_loras: int = flag(
        "LoRA adapters in one batch",
        default=1,
        type=int)
    max_cpu_loras: int | None = flag(
        "LoRA adapters held in memory (default --max-loras; least recently used are evicted)",
        default=None,
        type=int)
    max_lora_rank: int = flag(
        "the largest LoRA rank served",
        default=16,
        type=int)
    # Adapters loaded while serving (`AsyncEngine.add_lora`; the server's /v1/load_lora_adapter,
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING) may change any projection up to max_lora_rank: the
    # slots are laid out for all of them. Off, they fit the configured adapters (fewer operations
    # a step) and a later adapter must fit them too. With no configured adapter they fit any.
    allow_runtime_lora_updating: bool = flag(
        "serve /v1/load_lora_adapter and /v1/unload_lora_adapter, with slots for any adapter up to "
        "--max-lora-rank (also VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
        default=False,
        action="store_true")
    # Layers per stage (vLLM's VLLM_PP_LAYER_PARTITION, "16,8"); None: an even split. The last
    # stage also runs the LM head: on a model whose head is as large as several layers, give it fewer.
    pipeline_layer_partition: tuple[int, ...] | None = None
    max_prompt_embeds_bytes: int | None = None  # decoded payload limit; default: a float32 tensor filling the context
    served_model_name: str | None = None
    max_image_bytes: int = 20 << 20
    max_image_pixels: int = 4096 * 4096
    # Seconds between wake-ups of the event-loop lag probe (`AsyncEngine.stats()`, the observer's
    # `on_loop_lag`); None runs no probe. The server sets it from its own settings.
    loop_lag_interval: float | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must name a model directory")
        if self.trust_remote_code:
            raise ValueError(TRUST_REMOTE_CODE_REFUSED)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.scheduling_policy not in _POLICIES:
            raise ValueError(f"scheduling_policy must be one of {_POLICIES}, got {self.scheduling_policy!r}")
        if self.pooling_type is not None and self.pooling_type not in _POOLING_TYPES:
            raise ValueError(f"pooling_type must be mean, cls or last, got {self.pooling_type!r}")
        if self.pooling_type is not None and self.pooler_config.pooling_type is None:
            object.__setattr__(self, "pooler_config", replace(self.pooler_config, pooling_type=self.pooling_type))
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.q8_0_activations not in Q8_0_ACTIVATIONS:
            raise ValueError(f"q8_0_activations must be one of {', '.join(Q8_0_ACTIVATIONS)}, got "
                             f"{self.q8_0_activations!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (or unset), got "
                             f"{self.quantization!r}")
        if self.quantization is not None and self.enable_eplb:
            raise ValueError("--enable-eplb moves float expert weights between ranks; it cannot run with "
                             "--quantization (the experts are quantized)")
        if self.model.endswith(".gguf") and self.tokenizer is None:
            raise ValueError("a GGUF model needs a tokenizer: pass --tokenizer with the original model's HF "
                             "directory (tokenizer.json)")
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be auto, generate or pooling, got {self.runner!r}")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, got "
                             f"{self.prefix_caching_hash_algo!r}")
        if self.executor is not None and self.executor not in _EXECUTORS:
            raise ValueError(f"executor must be one of {_EXECUTORS}, got {self.executor!r}")
        if self.executor == "inproc" and self.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 runs an engine process per rank: executor 'inproc' (uni) keeps "
                             "one process; use 'mp' or 'ray', or leave it unset")
        if self.executor == "inproc" and self.world_size > 1:
            raise ValueError("tensor_parallel_size or pipeline_parallel_size > 1 needs worker processes "
                             "(executor='mp' or 'ray')")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        positive = ["block_size", "max_num_seqs", "tensor_parallel_size", "data_parallel_size",
                    "pipeline_parallel_size",
                    "max_prompts_per_request", "max_image_bytes", "max_image_pixels"]
        optional_positive = ["max_model_len", "num_kv_blocks", "kv_cache_memory_bytes", "max_num_batched_tokens",
                             "max_prompt_embeds_bytes", "renderer_workers", "num_scheduler_steps"]
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in optional_positive:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.loop_lag_interval is not None and not self.loop_lag_interval > 0:
            raise ValueError(f"loop_lag_interval must be positive, got {self.loop_lag_interval}")
        if self.async_scheduling and not self._one_worker:
            raise ValueError("async_scheduling runs with one worker: not with tensor_parallel_size or "
                             "pipeline_parallel_size > 1, nor with enable_eplb")
        if (self.num_scheduler_steps or 1) > 1 and (self.async_scheduling or not self._one_worker):
            raise ValueError("num_scheduler_steps > 1 runs with one worker and without async_scheduling: not "
                             "with tensor_parallel_size or pipeline_parallel_size > 1, nor with enable_eplb")
        if self.eplb_config.num_redundant_experts and not self.enable_eplb:
            raise ValueError("eplb_config.num_redundant_experts needs enable_eplb (redundant experts are placed "
                             "by the load balancer)")
        if not self.ec_defer_timeout > 0:
            raise ValueError(f"ec_defer_timeout must be positive, got {self.ec_defer_timeout}")
        if self.limit_images_per_prompt < 0:
            raise ValueError(f"limit_images_per_prompt must be non-negative, got {self.limit_images_per_prompt}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be non-negative, got {self.max_logprobs}")
        self._check_lora()

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if (self.lora_modules or self.allow_runtime_lora_updating) and not self.enable_lora:
            what = "lora_modules" if self.lora_modules else "allow_runtime_lora_updating"
            raise ValueError(f"{what} needs enable_lora (--enable-lora)")
        names = [m.name for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names must be distinct, got {names}")

    @property
    def lora_cpu_capacity(self) -> int:
        """Adapters held in memory at once (--max-cpu-loras, default --max-loras)."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @property
    def lora_slots_fit_any(self) -> bool:
        """Whether the LoRA slots are laid out for any adapter (every projection, max_lora_rank)."""
        return self.allow_runtime_lora_updating or not self.lora_modules

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model

    @property
    def tunes_cpu_threads(self) -> bool:
        """Whether each step's thread count is measured (`adaptive_cpu_threads`): on a CPU, with one
        rank (tensor-parallel ranks step together, and one rank's choice would stall the others)."""
        return self.adaptive_cpu_threads and self.device.split(":")[0] == "cpu" and self.tensor_parallel_size == 1

    @property
    def _one_worker(self) -> bool:
        return self.world_size == 1 and not self.enable_eplb

    @property
    def schedules_async(self) -> bool:
        """Whether steps are scheduled one ahead (`async_scheduling`; by default on a CUDA device
        with one worker: on CPU the step's own Python and the loop's share the GIL, and measured
        on the small models it does not pay there, docs/benchmarks.md; off with decode bursts,
        `num_scheduler_steps`)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return self.device.startswith("cuda") and self._one_worker and self.num_scheduler_steps in (None, 1)

    def scheduler_steps(self, streams_bursts: bool) -> int:
        """The decodes a step may run back to back (`num_scheduler_steps`). Unset: CPU_BURST_STEPS
        on CPU when the executor streams a burst's tokens as they are sampled (`streams_bursts`:
        the worker in the engine's process), with one worker and no async scheduling; else 1.
        There the loop's per-step work (schedule, wake the worker thread, take its output) costs
        as much as a small model's decode, and a burst pays it once (docs/decisions.md, "Decode
        bursts by default on CPU"); elsewhere tokens would arrive in bursts, or the step is long."""
        if self.num_scheduler_steps is not None:
            return self.num_scheduler_steps
        bursts = streams_bursts and self.device == "cpu" and self._one_worker and not self.schedules_async
        return CPU_BURST_STEPS if bursts else 1

    @property
    def measures_kv_cache(self) -> bool:
        """Whether the KV cache is sized by a profile run (gpu_memory_utilization): on CUDA, unless
        kv_cache_memory_bytes is given."""
        return self.kv_cache_memory_bytes is None and self.device.startswith("cuda")

    @property
    def eager(self) -> bool:
        """Whether every step runs the eager model (no compiled decode graphs)."""
        return eager_by_default() if self.enforce_eager is None else self.enforce_eager

    @property
    def decode_batch_sizes(self) -> tuple[int, ...]:
        """The batch sizes the decode graph is warmed up at; the largest bounds it (see CompilationConfig)."""
        sizes = self.compilation_config.cudagraph_capture_sizes
        largest = self.compilation_config.max_cudagraph_capture_size
        if sizes is not None:
            return sizes if largest is None else tuple(s for s in sizes if s <= largest) or sizes[:1]
        if self.device.startswith("cuda"):
            return vllm_capture_sizes(self.max_num_seqs, largest)
        return tuple(sorted({b for b in (1, 2, 4, 8, 16, 32, 64) if b < self.max_num_seqs}
                            | {min(self.max_num_seqs, 64)}))

    @property
    def executor_kind(self) -> str:
        return self.executor or ("mp" if self.world_size > 1 else "inproc")

    @property
    def world_size(self) -> int:
        """Worker processes of one engine: tensor-parallel ranks times pipeline stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def renderer_threads(self) -> int:
        """By default one fewer than the CPUs this process may use (at most 4, at least 1).

        Decoding is CPU-bound; with every core busy decoding, the event loop waits
        for a core when it wakes. Measured on 2 CPUs (docs/benchmarks.md,
        `trio-llm bench loop-lag`): 1 thread keeps the loop's p99 lag at ~1 ms,
        2 threads let it reach ~4 ms.
        """
        if self.renderer_workers is not None:
            return self.renderer_workers
        return max(1, min(4, usable_cpus() - 1))

    @property
    def token_budget(self) -> int:
        return self.max_num_batched_tokens or max(2048, self.max_num_seqs)

    @classmethod
    def option_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
