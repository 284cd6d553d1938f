"""`trio-llm make-model --arch llava`: a tiny random LLaVA in the llava-hf layout.

The text model is the tiny Llama `make-model` writes (under `language_model.`), the vision
tower a small CLIP (56x56 images in 14x14 patches: 16 rows per image) under
`vision_tower.vision_model.`, then the two-layer projector. The tokenizer gains an `<image>`
token; `preprocessor_config.json` holds the CLIP processor's settings.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

VISION: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
          "image_size": 56, "patch_size": 14, "num_channels": 3, "layer_norm_eps": 1e-5, "hidden_act": "quick_gelu",
          "model_type": "clip_vision_model", "projection_dim": 64}


def add_image_token(model_dir: Path) -> int:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.add_special_tokens(["<image>"])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    image_id = tokenizer.token_to_id("<image>")
    assert image_id is not None
    return int(image_id)


def llava_config(text_config: dict[str, Any], image_token_id: int) -> dict[str, Any]:
    text = {k: v for k, v in text_config.items() if k != "architectures"}
    return {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "text_config": text,
            "vision_config": VISION, "image_token_index": image_token_id, "vision_feature_layer": -2,
            "vision_feature_select_strategy": "default", "projector_hidden_act": "gelu",
            "multimodal_projector_bias": True, "tie_word_embeddings": text.get("tie_word_embeddings", False),
            "dtype": text.get("torch_dtype", "float32")}


def vision_weights(text_hidden: int, normal: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
    h, inter, p = int(VISION["hidden_size"]), int(VISION["intermediate_size"]), int(VISION["patch_size"])
    rows = (int(VISION["image_size"]) // p) ** 2 + 1
    prefix = "vision_tower.vision_model."

    def ones() -> torch.Tensor:
        return torch.ones(h)

    def zeros() -> torch.Tensor:
        return torch.zeros(h)

    weights = {prefix + "embeddings.patch_embedding.weight": normal(h, 3, p, p),
               prefix + "embeddings.class_embedding": normal(h),
               prefix + "embeddings.position_embedding.weight": normal(rows, h),
               prefix + "pre_layrnorm.weight": ones(), prefix + "pre_layrnorm.bias": zeros(),
               prefix + "post_layernorm.weight": ones(), prefix + "post_layernorm.bias": zeros(),
               "multi_modal_projector.linear_1.weight": normal(text_hidden, h),
               "multi_modal_projector.linear_1.bias": normal(text_hidden),
               "multi_modal_projector.linear_2.weight": normal(text_hidden, text_hidden),
               "multi_modal_projector.linear_2.bias": normal(text_hidden)}
    for i in range(VISION["num_hidden_layers"]):
        layer = f"{prefix}encoder.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            weights[f"{layer}self_attn.{name}.weight"] = normal(h, h)
            weights[f"{layer}self_attn.{name}.bias"] = normal(h)
        weights.update({layer + "layer_norm1.weight": ones(), layer + "layer_norm1.bias": zeros(),
                        layer + "layer_norm2.weight": ones(), layer + "layer_norm2.bias": zeros(),
                        layer + "mlp.fc1.weight": normal(inter, h), layer + "mlp.fc1.bias": normal(inter),
                        layer + "mlp.fc2.weight": normal(h, inter), layer + "mlp.fc2.bias": normal(h)})
    return weights


def preprocessor_config() -> dict[str, Any]:
    size = VISION["image_size"]
    return {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": size},
            "crop_size": {"height": size, "width": size}, "do_resize": True, "do_center_crop": True,
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
            "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
            "resample": 3}


def write_llava_parts(staging: Path, text_config: dict[str, Any], text_weights: dict[str, torch.Tensor],
                      normal: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
    """config.json and preprocessor_config.json; returns every tensor of the checkpoint."""
    image_id = add_image_token(staging)
    text_config = replace_vocab(text_config, image_id + 1)
    (staging / "config.json").write_text(json.dumps(llava_config(text_config, image_id), indent=2))
    (staging / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=2))
    weights = {}
    for name, tensor in text_weights.items():
        if name == "model.embed_tokens.weight" and tensor.shape[0] <= image_id:  # room for the image token
            tensor = torch.cat([tensor, normal(image_id + 1 - tensor.shape[0], tensor.shape[1]).to(tensor.dtype)])
        weights["language_model." + name] = tensor
    weights.update(vision_weights(text_config["hidden_size"], normal))
    return weights


def replace_vocab(config: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    return {**config, "vocab_size": max(vocab_size, config["vocab_size"])}

