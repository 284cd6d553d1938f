"""Images end to end: greedy text equal to transformers' LLaVA, the prompt length its processor
gives, the encoder cache, and hostile images answered 400 over HTTP while the server serves on."""

from __future__ import annotations

import openai
import pytest
import torch
import trio
from transformers import LlavaProcessor, PreTrainedTokenizerFast

from engine import EngineConfig, SamplingParams, open_engine
from tests.multimodal_helpers import ROWS, data_url, image_message, make_tiny_llava, png_bytes, random_image
from tests.server_fixtures import running_server


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return make_tiny_llava(tmp_path_factory.mktemp("models") / "tiny-llava")


def reference(llava, prompt_ids: list[int], images, max_tokens: int = 12) -> list[int]:
    path, model, processor = llava
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt_ids]), pixel_values=pixels, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=max_tokens)
    return out[0, len(prompt_ids):].tolist()


async def test_greedy_text_with_images_equals_transformers(llava):
    path = llava[0]
    one, two = random_image(seed=1), random_image(60, 35, seed=2)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    async with open_engine(EngineConfig(model=str(path), num_kv_blocks=64, max_num_batched_tokens=40)) as engine:
        results = {}

        async def run(name, messages):
            outputs = [o async for o in engine.chat(messages, greedy)]
            results[name] = outputs[-1]

        async with trio.open_nursery() as nursery:  # batched together, with chunked prefill (40 tokens a step)
            nursery.start_soon(run, "one", image_message(data_url(png_bytes(one))))
            nursery.start_soon(run, "two", image_message(data_url(png_bytes(one)), data_url(png_bytes(two)),
                                                         text="compare"))
            nursery.start_soon(run, "text", [{"role": "user", "content": "no image here"}])
        encoded = await engine.core.executor.collective_rpc("encoder_runs")
    for name, images in (("one", [one]), ("two", [one, two])):
        output = results[name]
        assert output.outputs[0].token_ids == reference(llava, output.prompt_token_ids, images), name
    assert encoded == [2]  # the image both requests share was encoded once


def test_prompt_length_is_the_processors_expanded_length(llava):
    path, _, image_processor = llava
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=6,
                               vision_feature_select_strategy="default", image_token="<image>",
                               num_additional_image_tokens=1)
    text = "<|im_start|>user\n<image>\nwhat is this<|im_end|>\n<|im_start|>assistant\n"
    expected = processor(text=text, images=[random_image()], return_tensors="pt")["input_ids"].shape[1]

    async def ours():
        async with open_engine(EngineConfig(model=str(path), num_kv_blocks=64)) as engine:
            prompt = await engine.chat_prompt(image_message(data_url(png_bytes(random_image()))))
            assert prompt["prompt"] == text
            rendered = await engine.renderer.render_one(prompt)
            return len(rendered.token_ids)

    assert trio.run(ours) == expected == len(tokenizer(text)["input_ids"]) - 1 + ROWS


def truncated_png() -> bytes:
    return png_bytes(random_image(64, 64))[:300]


def bomb_png() -> bytes:
    from PIL import Image
    return png_bytes(Image.new("L", (9000, 9000)))


@pytest.mark.parametrize("url, message", [
    (data_url(b"this is not an image"), "not a PNG, JPEG or WebP"),
    (data_url(truncated_png()), "could not be decoded"),
    (data_url(bomb_png()), "more than the limit"),
    (data_url(png_bytes(random_image(300, 300))), "larger than the limit"),
    ("file:///etc/passwd", "data: or http(s)"),
    ("http://169.254.169.254/latest/meta-data", "not in --allowed-media-domains"),
    ("data:image/png;base64,@@@", "not valid base64"),
])
async def test_hostile_images_get_400_and_the_server_serves_on(llava, url, message):
    config = EngineConfig(model=str(llava[0]), num_kv_blocks=64, max_image_bytes=100_000,
                          max_image_pixels=2000 * 2000, limit_images_per_prompt=2)
    async with running_server(config) as server:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        async with client:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model=server.state.model_name, messages=image_message(url),
                                                     max_tokens=4)
            assert message in str(caught.value)
            too_many = image_message(*[data_url(png_bytes(random_image(seed=i))) for i in range(3)])
            with pytest.raises(openai.BadRequestError, match="limit is 2"):
                await client.chat.completions.create(model=server.state.model_name, messages=too_many, max_tokens=4)
            ok = await client.chat.completions.create(
                model=server.state.model_name, max_tokens=4,
                messages=image_message(data_url(png_bytes(random_image()))))
            assert ok.usage.prompt_tokens > ROWS and ok.choices[0].finish_reason == "length"


async def test_a_text_model_refuses_images(tiny_model_dir):
    async with running_server(EngineConfig(model=tiny_model_dir, num_kv_blocks=64)) as server:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        async with client:
            with pytest.raises(openai.BadRequestError, match="does not take images"):
                await client.chat.completions.create(model=server.state.model_name, max_tokens=4,
                                                     messages=image_message(data_url(png_bytes(random_image()))))
