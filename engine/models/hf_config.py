"""Reading an HF `config.json` into the few numbers our decoder needs.

Accepts both the transformers 4 spelling (`rope_theta`, `rope_scaling`,
`torch_dtype`) and the transformers 5 one (`rope_parameters`, `dtype`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError
from engine.models.registry import served_names

DECODER_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


@dataclass(frozen=True)
class MoeConfig:
    """The mixture-of-experts part of a decoder config: which layers route, and how."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    renormalize: bool  # rescale the top-k routing weights to sum to 1
    sparse_layers: tuple[int, ...]  # layers whose MLP is the expert block (the rest are dense)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-on expert behind a sigmoid gate
    router_bias: bool = False  # gpt-oss: the router's linear has a bias
    expert_bias: bool = False  # gpt-oss: each expert's gate/up and down projections have biases
    # The experts' gate: "silu" (SwiGLU), or "swigluoai" (gpt-oss: clamped at `swiglu_limit`,
    # x * sigmoid(alpha * x) on the gate, (up + 1) on the up projection; vLLM's name)
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # DeepSeek-V3: the router scores experts by a sigmoid, picks `topk_group` of `n_group` groups of
    # experts by their best two scores plus a correction bias, then the top k within them, weighted
    # by the uncorrected scores (renormalised where `renormalize`) times `routed_scaling_factor`
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gated: bool = True  # Qwen2-MoE's shared expert has a sigmoid gate; DeepSeek's do not


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek's multi-head latent attention: queries through a low-rank projection (or none), keys
    and values from one latent of `kv_lora_rank` per token (what the KV cache holds, beside the
    rotated `qk_rope_head_dim` part of the key shared by every head)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the checkpoint lays each rotated pair out interleaved

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _moe(raw: dict[str, Any], family: str, num_layers: int) -> MoeConfig | None:
    if family == "mixtral":
        return MoeConfig(int(raw["num_local_experts"]), int(raw["num_experts_per_tok"]),
                         int(raw["intermediate_size"]), True, tuple(range(num_layers)))
    if family not in ("qwen2_moe", "qwen3_moe"):
        return None
    dense = set(raw.get("mlp_only_layers") or [])
    step = int(raw.get("decoder_sparse_step", 1))
    # Qwen's checkpoints say num_experts; transformers 5 writes num_local_experts.
    num_experts = int(raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"])
    sparse = tuple(i for i in range(num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0)
    return MoeConfig(num_experts, int(raw["num_experts_per_tok"]), int(raw["moe_intermediate_size"]),
                     bool(raw.get("norm_topk_prob", False)), sparse,
                     int(raw.get("shared_expert_intermediate_size") or 0))


@dataclass(frozen=True)
class DecoderConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    moe: MoeConfig | None = None
    # Each token attends to itself and the `sliding_window - 1` before it (Mistral); None: to all
    sliding_window: int | None = None
    # The layers that do, when not all of them (Gemma 3 alternates sliding and full layers)
    sliding_layers: tuple[int, ...] | None = None
    local_rope_theta: float | None = None  # the sliding layers' rope base, when it is their own (Gemma 3)
    attention_scale: float | None = None  # default head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar ** -0.5)
    hidden_act: str = "silu"  # the MLP's gate: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    norm_weight_offset: bool = False  # Gemma: RMSNorms scale by (1 + w), computed in float32
    sandwich_norms: bool = False  # Gemma: the attention's and the MLP's outputs normalised before the residual
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    rotary_dim: int | None = None  # the leading dims of each head that rope rotates (Phi: partial_rotary_factor)
    fused_checkpoint: bool = False  # the checkpoint holds qkv_proj and gate_up_proj fused, as ours (Phi-3)
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in each softmax's denominator
    mla: MlaConfig | None = None  # DeepSeek-V3's latent attention (head_dim is then its rotated part)

    def window_of(self, layer: int) -> int | None:
        """Layer `layer`'s attention window (None: full attention)."""
        if self.sliding_layers is not None and layer not in self.sliding_layers:
            return None
        return self.sliding_window


def require_model_dir(model_dir: str | Path) -> Path:
    if not Path(model_dir).is_dir():
        raise ModelLoadError(f"model directory {str(model_dir)!r} does not exist")
    return Path(model_dir)


def read_json_file(path: Path, *, missing: str | None = None) -> Any:
    """A model directory's JSON file. A missing file is `{}`, or a `ModelLoadError` saying
    `missing` when it is required; an unreadable or invalid one is a `ModelLoadError`."""
    if not path.is_file():
        if missing is not None:
            raise ModelLoadError(f"{path} is missing: {missing}")
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    """The model's config.json, or for a GGUF file the config its metadata amounts to."""
    if str(model_dir).endswith(".gguf"):
        from engine.models.gguf_file import gguf_config
        return gguf_config(model_dir)
    path = require_model_dir(model_dir) / "config.json"
    config: dict[str, Any] = read_json_file(path, missing="a model directory needs an HF config.json")
    return config


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in DECODER_ARCHITECTURES:
            return str(arch)
    by_type = {v: k for k, v in DECODER_ARCHITECTURES.items()}
    if not archs and raw.get("model_type") in by_type:
        return by_type[raw["model_type"]]
    named = archs or [raw.get("model_type")]
    raise ModelLoadError(f"unsupported architecture {named}; trio-llm serves {', '.join(served_names())} "
                         "(docs/models.md)")


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = raw.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = raw.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling:
        scaling = dict(scaling)
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "su":  # Phi-3's first name for LongRoPE
            kind = "longrope"
        if kind in ("longrope", "yarn"):  # the window trained on may come from the top level too
            scaling["rope_type"] = kind
            scaling.setdefault("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
            scaling.setdefault("max_position_embeddings", raw.get("max_position_embeddings"))
        if kind not in ("default", "llama3", "linear", "longrope", "yarn"):
            raise ModelLoadError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3, longrope, "
                                 "yarn")
        if kind == "default":
            scaling = None
    return theta, scaling


def _rotary_dim(raw: dict[str, Any], head_dim: int) -> int | None:
    """The rotated part of each head when it is not all of it (`partial_rotary_factor`)."""
    params = raw.get("rope_parameters") or {}
    factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    return None if factor == 1.0 else int(head_dim * factor)


def _common(raw: dict[str, Any], arch: str, family: str) -> dict[str, Any]:
    """The fields every decoder's config.json gives the same way."""
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    return dict(
        architecture=arch, family=family, vocab_size=int(raw["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]), num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        bos_token_id=raw.get("bos_token_id"), eos_token_ids=_eos_ids(raw.get("eos_token_id")))


def _gemma3(raw: dict[str, Any], arch: str) -> DecoderConfig:
    """Gemma 3's text model (transformers' Gemma3TextModel), as transformers 4.50+ and 5 save it."""
    for name in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if raw.get(name):
            raise ModelLoadError(f"{name}: not implemented for {arch}")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelLoadError(f"unsupported hidden_activation {act!r} for {arch}; expected 'gelu_pytorch_tanh'")
    num_layers = int(raw["num_hidden_layers"])
    pattern = int(raw.get("sliding_window_pattern", 6))
    types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"layer_types {types!r}: expected sliding_attention or full_attention per layer")
    params = raw.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or raw.get("rope_scaling") or {})
    local = dict(params.get("sliding_attention") or {})
    theta = float(full.get("rope_theta", raw.get("rope_theta", 1_000_000.0)))
    local_theta = float(local.get("rope_theta", raw.get("rope_local_base_freq", 10_000.0)))
    if local.get("rope_type", "default") != "default":
        raise ModelLoadError(f"unsupported rope scaling {local['rope_type']!r} on the sliding layers")
    scaling = full if full.get("rope_type", full.get("type", "default")) != "default" else None
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) not in ("linear", "llama3"):
        raise ModelLoadError(f"unsupported rope scaling {scaling.get('rope_type')!r}; supported: default, linear, "
                             "llama3")
    window = raw.get("sliding_window")
    if type(window) is not int or window < 1:
        raise ModelLoadError(f"sliding_window must be a positive integer, got {window!r}")
    bias = bool(raw.get("attention_bias", False))
    return DecoderConfig(
        **_common(raw, arch, "gemma3"), rope_theta=theta, rope_scaling=scaling, qkv_bias=bias, o_bias=bias,
        mlp_bias=False, qk_norm=True, sliding_window=window,
        sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"), local_rope_theta=local_theta,
        attention_scale=float(raw.get("query_pre_attn_scalar", 256)) ** -0.5, hidden_act=act,
        norm_weight_offset=True, sandwich_norms=True, embed_scale=float(raw["hidden_size"]) ** 0.5,
        final_logit_softcapping=raw.get("final_logit_softcapping"))


# The rope scaling transformers gives a gpt-oss config.json that names none (GptOssConfig's default)
GPT_OSS_DEFAULT_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 4096}


def _gpt_oss(raw: dict[str, Any], arch: str) -> DecoderConfig:
    """OpenAI's gpt-oss (transformers' GptOssForCausalLM): sliding and full layers alternating,
    attention sinks, biases on q/k/v/o, YaRN, and MoE in every layer with a biased router (softmax
    over its top-k logits) and clamped SwiGLU experts with biases, stored in float or MXFP4."""
    quantization = (raw.get("quantization_config") or {}).get("quant_method")
    if quantization not in (None, "mxfp4"):  # MXFP4 experts are dequantized at load (engine/models/mxfp4.py)
        raise ModelLoadError(f"quantization_config {quantization!r}: not implemented for {arch}; supported: mxfp4, "
                             "or the experts in bfloat16 or float32")
    num_layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                       for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"layer_types {types!r}: expected sliding_attention or full_attention per layer")
    window = raw.get("sliding_window")
    if type(window) is not int or window < 1:
        raise ModelLoadError(f"sliding_window must be a positive integer, got {window!r}")
    theta, scaling = _rope(raw)
    if scaling is None and not raw.get("rope_scaling") and "rope_type" not in (raw.get("rope_parameters") or {}):
        scaling = dict(GPT_OSS_DEFAULT_YARN)  # transformers' GptOssConfig default, which a config without one gets
    moe = MoeConfig(int(raw["num_local_experts"]), int(raw["num_experts_per_tok"]), int(raw["intermediate_size"]),
                    True, tuple(range(num_layers)), router_bias=True, expert_bias=True, activation="swigluoai",
                    swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
                    swiglu_limit=float(raw.get("swiglu_limit", 7.0)))
    bias = bool(raw.get("attention_bias", True))
    return DecoderConfig(
        **_common(raw, arch, "gpt_oss"), rope_theta=theta, rope_scaling=scaling, qkv_bias=bias, o_bias=bias,
        mlp_bias=False, qk_norm=False, moe=moe, sliding_window=window,
        sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"), attention_sinks=True)


def yarn_mscale(factor: float, weight: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times (1 without stretching)."""
    return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0


def _deepseek_v3(raw: dict[str, Any], arch: str) -> DecoderConfig:
    """DeepSeek-V3 (and the models on its architecture: DeepSeek-R1, Kimi K2): multi-head latent
    attention, YaRN with its attention scale, the first layers dense and the rest MoE with shared
    experts and grouped top-k routing by sigmoid scores and a correction bias."""
    for name, wanted in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if raw.get(name, wanted) != wanted:
            raise ModelLoadError(f"{name} {raw[name]!r}: not implemented for {arch}; expected {wanted!r}")
    if raw.get("quantization_config"):
        raise ModelLoadError(f"quantization_config {raw['quantization_config'].get('quant_method')!r}: not "
                             f"implemented for {arch}; load a bfloat16 checkpoint")
    num_layers = int(raw["num_hidden_layers"])
    mla = MlaConfig(raw.get("q_lora_rank"), int(raw["kv_lora_rank"]), int(raw["qk_nope_head_dim"]),
                    int(raw["qk_rope_head_dim"]), int(raw["v_head_dim"]), bool(raw.get("rope_interleave", True)))
    theta, scaling = _rope(raw)
    scale = mla.qk_head_dim ** -0.5
    if scaling is not None and scaling.get("mscale_all_dim"):  # the softmax scale grows with YaRN's mscale, squared
        scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    first_dense = int(raw.get("first_k_dense_replace", 0))
    moe = MoeConfig(int(raw["n_routed_experts"]), int(raw["num_experts_per_tok"]), int(raw["moe_intermediate_size"]),
                    bool(raw.get("norm_topk_prob", True)), tuple(range(first_dense, num_layers)),
                    int(raw["moe_intermediate_size"]) * int(raw.get("n_shared_experts") or 0),
                    scoring="sigmoid", n_group=int(raw.get("n_group") or 1), topk_group=int(raw.get("topk_group") or 1),
                    routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)), shared_expert_gated=False)
    bias = bool(raw.get("attention_bias", False))
    common = {**_common(raw, arch, "deepseek_v3"), "head_dim": mla.qk_rope_head_dim,
              "num_kv_heads": int(raw["num_attention_heads"])}
    return DecoderConfig(**common, rope_theta=theta, rope_scaling=scaling, qkv_bias=bias, o_bias=bias,
                         mlp_bias=False, qk_norm=False, moe=moe, attention_scale=scale, mla=mla)


def _sliding_window(raw: dict[str, Any], family: str) -> int | None:
    """Mistral's window, on every layer as transformers applies it. Qwen2 configs carry a
    `sliding_window` that transformers ignores unless `use_sliding_window` is set: refused then
    (its `max_window_layers` split is not implemented), never silently dropped."""
    if family in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        if raw.get("use_sliding_window"):
            raise ModelLoadError(f"use_sliding_window: sliding-window attention on {family} models is not "
                                 "implemented")
        return None
    window = raw.get("sliding_window")
    if window is None:
        return None
    if family not in ("mistral", "phi3"):
        raise ModelLoadError(f"sliding_window: sliding-window attention on {family} models is not implemented")
    if type(window) is not int or window < 1:
        raise ModelLoadError(f"sliding_window must be a positive integer, got {window!r}")
    return window


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def parse_decoder_config(raw: dict[str, Any]) -> DecoderConfig:
    arch = _architecture(raw)
    family = DECODER_ARCHITECTURES[arch]
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        if family == "gemma3":
            return _gemma3(raw, arch)
        if family == "gpt_oss":
            return _gpt_oss(raw, arch)
        if family == "deepseek_v3":
            return _deepseek_v3(raw, arch)
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"unsupported hidden_act {act!r} for {arch}; expected 'silu'")
        theta, scaling = _rope(raw)
        attention_bias = bool(raw.get("attention_bias", False))
        num_layers = int(raw["num_hidden_layers"])
        qkv_bias = bool(raw.get("qkv_bias", True)) if family in ("qwen2", "qwen2_moe") else attention_bias
        return DecoderConfig(
            architecture=arch,
            family=family,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=False if family in ("qwen2", "qwen2_moe") else attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw.get("eos_token_id")),
            moe=_moe(raw, family, num_layers),
            sliding_window=_sliding_window(raw, family),
            rotary_dim=_rotary_dim(raw, int(raw.get("head_dim") or hidden // heads)),
            fused_checkpoint=family == "phi3",
        )
    except KeyError as exc:
        raise ModelLoadError(f"config.json for {arch} lacks the field {exc.args[0]!r}") from exc


@dataclass(frozen=True)
class LlavaConfig:
    """`LlavaForConditionalGeneration`: a decoder (`text_config`) that reads images through a
    vision tower (`vision_config`, parsed by `engine.models.vision`) and a projector."""

    text: DecoderConfig
    vision: dict[str, Any]
    image_token_index: int
    feature_layer: int
    select_strategy: str
    projector_act: str
    projector_bias: bool


def is_llava_config(raw: dict[str, Any]) -> bool:
    return "LlavaForConditionalGeneration" in (raw.get("architectures") or []) or raw.get("model_type") == "llava"


def parse_llava_config(raw: dict[str, Any]) -> LlavaConfig:
    text_raw = dict(raw.get("text_config") or {})
    by_type = {v: k for k, v in DECODER_ARCHITECTURES.items()}
    text_type = text_raw.get("model_type", "llama")
    if text_type not in by_type:
        raise ModelLoadError(f"unsupported LLaVA text model {text_type!r}; supported: {sorted(by_type)}")
    text_raw["architectures"] = [by_type[text_type]]
    text_raw.setdefault("dtype", raw.get("dtype") or raw.get("torch_dtype") or "float32")
    feature_layer = raw.get("vision_feature_layer", -2)
    if not isinstance(feature_layer, int):
        raise ModelLoadError(f"vision_feature_layer {feature_layer!r}: only a single layer is supported")
    if "vision_config" not in raw or "image_token_index" not in raw and "image_token_id" not in raw:
        raise ModelLoadError("a LLaVA config.json needs vision_config and image_token_index")
    return LlavaConfig(parse_decoder_config(text_raw), dict(raw["vision_config"]),
                       int(raw.get("image_token_index", raw.get("image_token_id", -1))), feature_layer,
                       str(raw.get("vision_feature_select_strategy", "default")),
                       str(raw.get("projector_hidden_act", "gelu")), bool(raw.get("multimodal_projector_bias", True)))


# generation_config.json keys that become default sampling parameters (vLLM's `--generation-config auto`).
_GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                        "repetition_penalty": "repetition_penalty"}


def read_generation_defaults(setting: str, model_dir: str | Path) -> dict[str, Any]:
    """Sampling defaults from `generation_config.json`: the model's own (`auto`), none (`vllm`), or
    the one in the directory `setting` names. Only the keys vLLM takes; a request's own values win."""
    if setting == "vllm":
        return {}
    directory = Path(model_dir) if setting == "auto" else Path(setting)
    if setting != "auto" and not (directory / "generation_config.json").is_file():
        raise ModelLoadError(f"--generation-config {setting}: no generation_config.json there")
    raw = read_json_file(directory / "generation_config.json")
    return {ours: raw[theirs] for theirs, ours in _GENERATION_DEFAULTS.items()
            if isinstance(raw.get(theirs), (int, float)) and not isinstance(raw.get(theirs), bool)}
