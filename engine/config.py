"""Engine configuration: frozen, validated at construction with clear `ValueError`s.

Values only known once the model is loaded (number of KV blocks, context
length, EOS ids) live in `RuntimeInfo`, not here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_POLICIES = ("fcfs", "priority")
_EXECUTORS = ("inproc",)


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to open an engine. `model` is a local HF-format directory."""

    model: str
    tokenizer: str | None = None  # defaults to `model`
    dtype: str = "auto"  # auto: the checkpoint's torch_dtype
    device: str = "cpu"
    seed: int = 0
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30  # memory budget for the KV cache
    num_kv_blocks: int | None = None  # overrides the budget (tests use it to force preemption)
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # defaults to max(2048, max_num_seqs)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    max_logprobs: int = 20
    executor: str = "inproc"
    renderer_workers: int = 4  # threads for tokenization of long prompts and other pre/post-processing
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must name a model directory")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.scheduling_policy not in _POLICIES:
            raise ValueError(f"scheduling_policy must be one of {_POLICIES}, got {self.scheduling_policy!r}")
        if self.executor not in _EXECUTORS:
            raise ValueError(f"executor must be one of {_EXECUTORS}, got {self.executor!r}")
        positive = ["block_size", "kv_cache_memory_bytes", "max_num_seqs", "renderer_workers"]
        optional_positive = ["max_model_len", "num_kv_blocks", "max_num_batched_tokens"]
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in optional_positive:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be non-negative, got {self.max_logprobs}")

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model

    @property
    def token_budget(self) -> int:
        return self.max_num_batched_tokens or max(2048, self.max_num_seqs)

    @classmethod
    def option_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


@dataclass(frozen=True)
class RuntimeInfo:
    """What the engine learned when it loaded the model."""

    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    hidden_size: int
    eos_token_ids: tuple[int, ...]
    dtype: str
