"""`trio-llm make-model`: a tiny random-weight checkpoint in HF format, with a
byte-level BPE tokenizer trained locally on the corpus shipped in the package.

Deterministic: the same arguments give the same files. This is the embedded
default model, created on first use in the user cache directory.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.models.tiny_spec import ARCHITECTURES as ARCHITECTURES
from engine.models.tiny_spec import TinyModelSpec as TinyModelSpec
from engine.paths import cache_root

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Named shapes (`make-model --shape NAME`): a real model's sizes with random weights, for
# benchmarks at the sizes people serve. The tokenizer is still the small local one; the embedding
# and LM head have the model's full vocabulary.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {"arch": "qwen2", "layers": 24, "hidden": 896, "heads": 14, "kv_heads": 2, "intermediate": 4864,
                     "vocab": 151936, "max_positions": 32768, "rope_theta": 1000000.0},
    "gemma3-270m": {"arch": "gemma3", "layers": 18, "hidden": 640, "heads": 4, "kv_heads": 1, "head_dim": 256,
                    "intermediate": 2048, "vocab": 262144, "max_positions": 32768, "rope_theta": 1000000.0,
                    "sliding_window": 512},
    "gpt-oss-20b": {"arch": "gpt_oss", "layers": 24, "hidden": 2880, "heads": 64, "kv_heads": 8, "head_dim": 64,
                    "intermediate": 2880, "vocab": 201088, "experts": 32, "top_k": 4, "max_positions": 131072,
                    "rope_theta": 150000.0, "sliding_window": 128},
    "llama3-8b": {"arch": "llama", "layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "intermediate": 14336,
                  "vocab": 128256, "max_positions": 8192, "rope_theta": 500000.0},
}


def shaped_spec(shape: str | None, **given: Any) -> TinyModelSpec:
    """A spec of the named shape (none: the tiny default), with the `given` fields that are not None
    over it. ValueError naming the shapes for an unknown one."""
    if shape is not None and shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(sorted(SHAPES))}")
    fields = {**(SHAPES[shape] if shape else {}), **{k: v for k, v in given.items() if v is not None}}
    return TinyModelSpec(**fields)


def train_tokenizer(vocab_size: int) -> Tokenizer:
    corpus = resources.files("engine").joinpath("data/corpus.txt").read_text()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus.split("\n\n"), trainer)
    return tokenizer


def write_tokenizer(model_dir: str | Path, vocab_size: int) -> int:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json; returns the vocab size."""
    model_dir = Path(model_dir)
    tokenizer = train_tokenizer(vocab_size)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    eos_id = tokenizer.token_to_id("<|im_end|>")
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 1 << 20,
    }, indent=2))
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [eos_id, tokenizer.token_to_id("<|endoftext|>")]}, indent=2))
    return tokenizer.get_vocab_size()


def _config(spec: TinyModelSpec, vocab_size: int, eos_id: int) -> dict[str, Any]:
    config = {
        "architectures": [ARCHITECTURES[spec.arch]],
        "model_type": spec.arch,
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "torch_dtype": spec.dtype,
        "eos_token_id": eos_id,
    }
    if spec.arch == "mistral":
        config.update(sliding_window=spec.sliding_window)
    if spec.arch == "gemma3":  # five sliding layers to each global one, as Gemma 3's checkpoints
        del config["hidden_act"]
        config.update(model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh",
                      query_pre_attn_scalar=spec.head_size, sliding_window=spec.sliding_window or 512,
                      layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                   for i in range(spec.layers)], rope_local_base_freq=10000.0)
    if spec.arch == "mixtral":
        config.update(num_local_experts=spec.experts, num_experts_per_tok=spec.top_k)
    if spec.arch == "gpt_oss":  # sliding and full layers alternating, biases, sinks; its own LM head; YaRN x32
        yarn = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": max(1, spec.max_positions // 32)}
        config.update(num_local_experts=spec.experts, num_experts_per_tok=spec.top_k, attention_bias=True,
                      sliding_window=spec.sliding_window or 128, tie_word_embeddings=False, swiglu_limit=7.0,
                      layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.layers)],
                      rope_scaling=yarn)
    if spec.arch == "qwen3_moe":
        config.update(num_experts=spec.experts, num_experts_per_tok=spec.top_k, norm_topk_prob=True,
                      moe_intermediate_size=spec.intermediate, decoder_sparse_step=1, mlp_only_layers=[])
    return config


DEFAULT_SPEC = TinyModelSpec()  # the embedded default model's


def make_model(model_dir: str | Path, spec: TinyModelSpec = DEFAULT_SPEC, overwrite: bool = True) -> Path:
    """Write the checkpoint into `model_dir` atomically (built in a sibling temp dir, then renamed).

    With `overwrite=False`, a complete checkpoint that appeared meanwhile (another
    process creating the same default model) is kept and ours is discarded."""
    # torch only here: the CLI imports this module to parse its arguments, before serve's
    # engine process starts (web/cli.py).
    import torch
    from safetensors.torch import save_file

    from engine.models.tiny_llava import write_llava_parts
    from engine.models.tiny_weights import random_weights

    model_dir = Path(model_dir)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".making-", dir=model_dir.parent))
    try:
        # The tokenizer learns what the shipped corpus allows (12,869 tokens at most); the embedding
        # and LM head still get `spec.vocab` rows, as checkpoints padded past their tokenizer do.
        vocab_size = max(spec.vocab, write_tokenizer(staging, spec.vocab))
        eos_id = Tokenizer.from_file(str(staging / "tokenizer.json")).token_to_id("<|im_end|>")
        assert eos_id is not None, "the tokenizer trainer always adds <|im_end|>"
        if spec.arch == "llava":  # a tiny Llama as its text model, plus a vision tower
            text = replace(spec, arch="llama")
            gen = torch.Generator().manual_seed(spec.seed + 1)
            weights = write_llava_parts(staging, _config(text, vocab_size, eos_id), random_weights(text, vocab_size),
                                        lambda *shape: torch.randn(*shape, generator=gen) * 0.05)
        else:
            (staging / "config.json").write_text(json.dumps(_config(spec, vocab_size, eos_id), indent=2))
            weights = random_weights(spec, vocab_size)
        save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(staging, 0o755)
        if model_dir.exists() and overwrite:
            shutil.rmtree(model_dir)
        try:
            os.replace(staging, model_dir)
        except OSError:
            if overwrite or not (model_dir / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return model_dir


def default_model_dir() -> Path:
    return cache_root() / "default-model-v1"


def ensure_default_model() -> Path:
    """The embedded default model, created on first use. Blocking: run it off the event loop."""
    path = default_model_dir()
    if not (path / "model.safetensors").is_file():
        logger.info("creating the embedded default model in %s (first use: a random-weight checkpoint and its "
                    "tokenizer, a few seconds)", path)
        make_model(path, overwrite=False)
    return path
