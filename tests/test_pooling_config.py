"""vLLM's pooling options: --pooler-config (task, pooling type, activation, chunked processing,
max_embed_len), --runner, and the wording of a task the model does not serve."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import open_engine
from engine.config import PoolerOptions
from engine.errors import InvalidRequestError
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from tests.conftest import engine_config


def test_the_pooler_config_takes_vllms_keys_and_refuses_others():
    options = PoolerOptions.from_json('{"seq_pooling_type": "MEAN", "use_activation": false, '
                                      '"enable_chunked_processing": true, "max_embed_len": 4096}')
    assert (options.pooling_type, options.use_activation, options.enable_chunked_processing,
            options.max_embed_len) == ("mean", False, True, 4096)
    for text, words in (('{"pooling_type": "MAX"}', "MEAN, CLS or LAST"), ('{"task": "reward"}', "task"),
                        ('{"step_tag_id": 3}', "unknown key 'step_tag_id'"), ('{"max_embed_len": 0}', "positive")):
        with pytest.raises(ValueError, match=words):
            PoolerOptions.from_json(text)


async def test_chunked_processing_pools_long_inputs_as_the_weighted_mean_of_their_chunks(tiny_model_dir):
    long_prompt = [(7 * i) % 500 + 3 for i in range(150)]
    chunked = engine_config(tiny_model_dir, max_model_len=64, pooling_type="mean",
                            pooler_config=PoolerOptions(enable_chunked_processing=True, max_embed_len=200))
    async with open_engine(chunked) as engine:
        (whole,) = await engine.encode([long_prompt])
        pieces = [long_prompt[i:i + 64] for i in range(0, 150, 64)]
        raw = await engine.encode(pieces, PoolingParams(normalize=False))
        with pytest.raises(InvalidRequestError, match="max_embed_len"):
            await engine.encode([long_prompt * 2])
    expected = sum(len(p) * r.data for p, r in zip(pieces, raw, strict=True)) / len(long_prompt)
    assert whole.prompt_token_ids == long_prompt
    assert torch.allclose(whole.data, F.normalize(expected, dim=-1), atol=1e-5)
    async with open_engine(engine_config(tiny_model_dir, max_model_len=64)) as plain:
        with pytest.raises(InvalidRequestError, match="maximum context length"):
            await plain.encode([long_prompt])


async def test_the_runner_decides_what_a_decoder_serves(tiny_model_dir):
    async with open_engine(engine_config(tiny_model_dir, runner="pooling")) as pooling_only:
        (vector,) = await pooling_only.encode([[5, 6, 7]])
        assert vector.data.shape == (pooling_only.info.hidden_size,)
        with pytest.raises(InvalidRequestError, match="--runner pooling"):
            async for _ in pooling_only.generate([5, 6, 7], SamplingParams(max_tokens=2)):
                pass
    async with open_engine(engine_config(tiny_model_dir, runner="generate")) as generate_only:
        with pytest.raises(InvalidRequestError, match=r"^Unsupported task: 'embed' Supported tasks: \[\]"):
            await generate_only.encode([[5, 6, 7]])
    async with open_engine(engine_config(tiny_model_dir)) as both:
        with pytest.raises(InvalidRequestError, match=r"^Unsupported task: 'classify' Supported tasks: "
                                                      r"\['embed', 'token_embed'\]"):
            await both.encode([[5, 6, 7]], PoolingParams(task="classify"))
        with pytest.raises(InvalidRequestError, match="Unsupported task: 'plugin'"):
            await both.encode([[5, 6, 7]], PoolingParams(task="plugin"))


async def test_a_pooler_config_task_the_model_cannot_serve_stops_start_up(tiny_model_dir):
    with pytest.raises(ValueError, match="can serve embed, token_embed"):
        async with open_engine(engine_config(tiny_model_dir, pooler_config=PoolerOptions(task="classify"))):
            pass
