"""A tiny LLaVA made by transformers (with our tokenizer plus an <image> token and a CLIP
processor config), and images as data URLs."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tokenizers import Tokenizer
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

from engine.models.tiny import write_tokenizer

IMAGE_SIZE = 30
ROWS = (IMAGE_SIZE // 6) ** 2  # patches of 6x6, the class token dropped


def make_tiny_llava(path: Path) -> tuple[Path, LlavaForConditionalGeneration, CLIPImageProcessorPil]:
    path.mkdir(parents=True, exist_ok=True)
    write_tokenizer(path, 512)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.add_special_tokens(["<image>"])
    tokenizer.save(str(path / "tokenizer.json"))
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=6, projection_dim=32)
    text = LlamaConfig(vocab_size=520, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tokenizer.token_to_id("<image>"))
    model = LlavaForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                      crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor.save_pretrained(path)
    return path, model, processor


def random_image(height: int = 40, width: int = 50, seed: int = 0) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_message(*images: str, text: str = "what is this") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
