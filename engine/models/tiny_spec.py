"""What a tiny checkpoint is made of (`engine.models.tiny` writes it, `engine.models.tiny_weights`
fills its weights): plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
                 "llava": "LlavaForConditionalGeneration"}


@dataclass(frozen=True)
class TinyModelSpec:
    arch: str = "llama"
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 768
    vocab: int = 4096
    max_positions: int = 2048
    dtype: str = "float32"
    seed: int = 0
    experts: int = 8  # MoE architectures: experts per layer, each token routed to top_k of them
    top_k: int = 2
    rope_theta: float = 10000.0
    sliding_window: int | None = None  # mistral, gemma3, gpt_oss: each token attends to this many positions
    head_dim: int | None = None  # default hidden // heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {self.arch!r}")
        if (self.head_dim is None and self.hidden % self.heads) or self.heads % self.kv_heads:
            raise ValueError("hidden must divide by heads (or give head_dim), and heads by kv_heads")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError("top_k must be between 1 and experts")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
