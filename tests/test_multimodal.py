"""Images end to end: greedy text equal to transformers' LLaVA, the prompt length its processor
gives, the encoder cache, and hostile images answered 400 over HTTP while the server serves on."""

from __future__ import annotations

from functools import partial

import openai
import pytest
import torch
import trio
from transformers import LlavaProcessor, PreTrainedTokenizerFast

from engine import EngineConfig, SamplingParams, open_engine
from engine import testing as probes
from engine.errors import InvalidRequestError
from tests.model_helpers import decoder_logits
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
    # 64 tokens a step: the encoder cache (a step's tokens in rows) holds both 25-row images, so the
    # shared one is encoded once whichever request the scheduler sees first (with 40 rows, one image
    # evicted the other and the count depended on the order the renders finished in).
    async with open_engine(EngineConfig(model=str(path), num_kv_blocks=64, max_num_batched_tokens=64)) as engine:
        results = {}

        async def run(name, messages):
            outputs = [o async for o in engine.chat(messages, greedy)]
            results[name] = outputs[-1]

        async with trio.open_nursery() as nursery:  # batched together, with chunked prefill
            nursery.start_soon(run, "one", image_message(data_url(png_bytes(one))))
            nursery.start_soon(run, "two", image_message(data_url(png_bytes(one)), data_url(png_bytes(two)),
                                                         text="compare"))
            nursery.start_soon(run, "text", [{"role": "user", "content": "no image here"}])
        encoded = await engine.core.executor.collective_rpc(probes.encoder_runs)
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
], ids=["not-an-image", "truncated", "bomb", "too-large", "file-url", "metadata-url", "bad-base64"])
# (Short ids: pytest puts the test's id in PYTEST_CURRENT_TEST, and a whole PNG there made the
# environment of the engine process too large to start.)
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


async def test_library_prompts_take_pil_images_and_arrays(llava):
    import numpy as np

    image = random_image(seed=3)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    async with open_engine(EngineConfig(model=str(llava[0]), num_kv_blocks=64)) as engine:
        prompt = "<image>\ndescribe"
        outs = {}
        for name, source in (("pil", image), ("array", np.asarray(image))):
            outputs = [o async for o in engine.generate({"prompt": prompt, "multi_modal_data": {"image": source}},
                                                        greedy)]
            outs[name] = outputs[-1]
    assert outs["pil"].outputs[0].token_ids == outs["array"].outputs[0].token_ids
    assert outs["pil"].outputs[0].token_ids == reference(llava, outs["pil"].prompt_token_ids, [image], 6)


async def test_http_image_urls_are_fetched_only_from_allowed_hosts(llava):
    body = png_bytes(random_image(seed=4))

    async def serve_png(stream):
        request = await stream.receive_some(65536)
        if b"/moved" in request.split(b"\r\n")[0]:  # a redirect towards a host nobody allowed
            await stream.send_all(b"HTTP/1.1 302 Found\r\nLocation: http://169.254.169.254/x\r\n"
                                  b"Content-Length: 0\r\nConnection: close\r\n\r\n")
        else:
            await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: "
                                  + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, serve_png, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        url = f"http://127.0.0.1:{port}/cat.png"
        greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        config = EngineConfig(model=str(llava[0]), num_kv_blocks=64, allowed_media_domains=("127.0.0.1",))
        async with open_engine(config) as engine:
            fetched = [o async for o in engine.chat(image_message(url), greedy)][-1]
            inline = [o async for o in engine.chat(image_message(data_url(body)), greedy)][-1]
            moved = await engine.chat_prompt(image_message(f"http://127.0.0.1:{port}/moved"))
            with pytest.raises(InvalidRequestError, match="redirects"):
                await engine.renderer.render_one(moved)
        assert fetched.outputs[0].token_ids == inline.outputs[0].token_ids
        nursery.cancel_scope.cancel()


def test_make_model_writes_a_llava_transformers_reads_the_same(tmp_path):
    from transformers import LlavaForConditionalGeneration

    from engine.models.loader import load_llava
    from engine.models.tiny import TinyModelSpec, make_model
    from engine.render.image import ImageProcessorConfig, preprocess

    path = make_model(tmp_path / "llava", TinyModelSpec(arch="llava", layers=2, hidden=64, intermediate=128,
                                                        vocab=512))
    hf_model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    decoder, vision, cfg = load_llava(path, "float32")
    pixels = preprocess(random_image(seed=5), ImageProcessorConfig.from_model_dir(path)).unsqueeze(0)
    ids = [5, 6] + [cfg.image_token_index] * vision.rows_per_image + [7, 8]
    with torch.no_grad():
        expected = hf_model(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0]
        hidden = decoder.embed(torch.tensor(ids))
        hidden[2:2 + vision.rows_per_image] = vision.encode(pixels)[0]
    logits = decoder_logits(decoder, hidden)
    assert torch.allclose(logits, expected, atol=1e-5, rtol=1e-5)


def test_prometheus_names_for_images_and_the_connector():
    from engine.core.stats import EngineStats
    from web.http.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.bind(lambda: EngineStats(0, 0, 0.0, 0, 0, 0, None, None, (True,), mm_encoder_runs=3, encoder_cache_hits=2,
                                     encoder_cache_evictions=1, encoder_cache_usage=0.5, ec_connector_loads=4,
                                     ec_deferrals=7))
    text = metrics.render().decode()
    for line in ('trio_llm_mm_encoder_runs_total{model_name="m"} 3.0',
                 'trio_llm_ec_connector_loads_total{model_name="m"} 4.0',
                 'trio_llm_ec_deferrals_total{model_name="m"} 7.0',
                 'trio_llm_encoder_cache_hits_total{model_name="m"} 2.0',
                 'trio_llm_encoder_cache_evictions_total{model_name="m"} 1.0',
                 'trio_llm_encoder_cache_usage_ratio{model_name="m"} 0.5'):
        assert line in text, line
