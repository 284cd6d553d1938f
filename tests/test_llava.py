"""LLaVA: image preprocessing equal to transformers' CLIP processor, image decoding limits, and
the vision tower + projector + decoder against transformers' LlavaForConditionalGeneration."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

from engine.errors import InvalidRequestError
from engine.models.loader import load_llava
from engine.render.image import ImageProcessorConfig, decode_image, mm_hash, preprocess
from tests.model_helpers import decoder_logits


def random_image(height: int, width: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = (np.random.RandomState(seed).rand(height, width, channels) * 255).astype("uint8")
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)


def encoded(image: Image.Image, fmt: str = "PNG", **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


@pytest.mark.parametrize("size, crop, height, width, mode", [
    (30, 30, 40, 50, "RGB"), (224, 224, 300, 200, "RGB"), (30, 24, 17, 90, "RGB"),
    (336, 336, 512, 512, "RGBA"), (64, 64, 80, 70, "L"), (48, 32, 20, 20, "RGB"),
])
def test_preprocessing_gives_transformers_pixel_values_exactly(size, crop, height, width, mode):
    processor = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": crop, "width": crop})
    image = random_image(height, width, mode)
    expected = processor(images=image, return_tensors="pt")["pixel_values"][0]
    ours = preprocess(image, ImageProcessorConfig.from_hf(processor.to_dict()))
    assert torch.equal(ours, expected)


def test_mm_hash_names_the_pixels_not_the_encoding():
    image = random_image(32, 32)
    cfg = ImageProcessorConfig()
    as_png = decode_image(encoded(image, "PNG"), 10_000)
    as_webp = decode_image(encoded(image, "WEBP", lossless=True), 10_000)
    assert mm_hash(as_png, cfg) == mm_hash(as_webp, cfg)
    assert mm_hash(as_png, cfg) != mm_hash(random_image(32, 32, seed=1), cfg)
    assert mm_hash(as_png, cfg) != mm_hash(as_png, ImageProcessorConfig(shortest_edge=30))


@pytest.mark.parametrize("data, message", [
    (b"not an image at all", "not a PNG, JPEG or WebP"),
    (encoded(random_image(64, 64))[:200], "could not be decoded"),
    (encoded(random_image(300, 300)), "more than the limit"),
    (encoded(random_image(16, 16), "GIF"), "not a PNG, JPEG or WebP"),
])
def test_bad_images_are_refused_with_a_reason(data, message):
    with pytest.raises(InvalidRequestError, match=message):
        decode_image(data, max_pixels=200 * 200)


def test_a_decompression_bomb_is_refused_from_its_header():
    bomb = encoded(Image.new("L", (20_000, 20_000)))  # 400 M pixels in a few hundred KB
    assert len(bomb) < 1_000_000
    with pytest.raises(InvalidRequestError, match="more than the limit"):
        decode_image(bomb, max_pixels=4096 * 4096)


@pytest.fixture(scope="module")
def hf_llava(tmp_path_factory):
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                              image_size=30, patch_size=6, projection_dim=32)
    text = LlamaConfig(vocab_size=520, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text,
                                                      image_token_index=519)).eval()
    path = tmp_path_factory.mktemp("llava")
    model.save_pretrained(path)
    return path, model


def test_vision_and_decoder_logits_equal_transformers(hf_llava):
    path, hf_model = hf_llava
    decoder, vision, cfg = load_llava(path, "float32")
    assert vision.rows_per_image == 25 and cfg.image_token_index == 519
    pixels = torch.randn(2, 3, 30, 30)
    ids = [1, 2, 3] + [519] * 25 + [5, 6] + [519] * 25 + [7]
    with torch.no_grad():
        expected = hf_model(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0]
        rows = vision.encode(pixels)
        hidden = decoder.embed(torch.tensor(ids))
        hidden[3:28], hidden[30:55] = rows[0], rows[1]
    logits = decoder_logits(decoder, hidden)
    assert torch.allclose(logits, expected, atol=1e-5, rtol=1e-5)
