"""An HF checkpoint written as a GGUF file (llama.cpp's layout), for the tests and the llama.cpp
side of `trio-llm bench quantized`: the architecture's metadata, a byte-level BPE tokenizer as
llama.cpp's "gpt2" model (padded with unused tokens to the embedding's rows), and the tensors
under llama.cpp's names, Llama's Q and K rows permuted as its converter permutes them, 2-D
weights in the GGML type asked for (F32, F16, Q8_0, Q4_0, ...) and the norms and biases in F32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

ARCH_OF = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in _TOP:
        return _TOP[hf_name]
    parts = hf_name.split(".")  # model.layers.N.<module>.<param>
    return f"blk.{parts[2]}.{_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"


def permute_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's permutation of a Llama Q or K projection."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def export_gguf(model_dir: str | Path, out_path: str | Path, qtype: str = "F32") -> Path:
    """Write `model_dir` (an HF decoder directory) to `out_path` with 2-D weights as `qtype`."""
    import gguf

    from engine.models.hf_config import read_config_json
    from engine.models.loader import iterate_weights, safetensors_files

    model_dir, out_path = Path(model_dir), Path(out_path)
    cfg = read_config_json(model_dir)
    arch = ARCH_OF[cfg["architectures"][0]]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    writer = gguf.GGUFWriter(str(out_path), arch)
    writer.add_context_length(cfg.get("max_position_embeddings", 2048))
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if head_dim != cfg["hidden_size"] // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(_file_type(qtype))
    _add_tokenizer(writer, model_dir, cfg["vocab_size"])
    for name, tensor in iterate_weights(safetensors_files(model_dir)):
        data = tensor.float()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = permute_rotary(data, heads if "q_proj" in name else kv_heads)
        _add_tensor(writer, gguf_name(name), data.numpy(), qtype if data.dim() == 2 else "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _file_type(qtype: str) -> int:
    import gguf
    return int({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[qtype])


def _add_tensor(writer: Any, name: str, data: np.ndarray, qtype: str) -> None:
    import gguf
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    elif qtype == "F16":
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), kind),
                          raw_dtype=kind)


def _add_tokenizer(writer: Any, model_dir: Path, vocab_rows: int) -> None:
    """The HF byte-level BPE tokenizer as llama.cpp's gpt2 model."""
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(spec["model"]["vocab"])
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    vocab.update(special)
    tokens = [f"[PAD{i}]" for i in range(vocab_rows)]
    types = [5] * vocab_rows  # unused
    for text, index in vocab.items():
        if index < vocab_rows:
            tokens[index], types[index] = text, 3 if text in special else 1
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    config = json.loads((model_dir / "tokenizer_config.json").read_text()) \
        if (model_dir / "tokenizer_config.json").is_file() else {}
    eos = config.get("eos_token")
    if isinstance(eos, str) and eos in vocab:
        writer.add_eos_token_id(vocab[eos])
    writer.add_add_bos_token(False)
