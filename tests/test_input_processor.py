"""The input processor, without an event loop: checks against the model, and the request it builds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.config import EngineConfig
from engine.core.engine_core import scheduler_requests
from engine.errors import InvalidRequestError
from engine.model_info import ModelInfo
from engine.pooling_params import PoolingParams
from engine.render.input_processor import InputProcessor
from engine.render.renderer import EngineInput
from engine.render.tokenizer import Tokenizer
from engine.sampling_params import SamplingParams
from tests.conftest import engine_config


@pytest.fixture(scope="module")
def processor(tiny_model_dir) -> InputProcessor:
    info = ModelInfo(vocab_size=512, hidden_size=8, max_position_embeddings=64, eos_token_ids=(2,), dtype="float32",
                     kv_bytes_per_block=1024, max_model_len=64, architecture="LlamaForCausalLM")
    config: EngineConfig = engine_config(tiny_model_dir, max_model_len=64)
    return InputProcessor(config, info, Tokenizer(config.tokenizer_path))


def test_a_generation_request_is_resolved_for_the_core(processor):
    params = SamplingParams(n=3, bad_words=("hello",), seed=7, max_tokens=None)
    request = processor.generation_request("r", EngineInput("hi", [5, 6, 7]), params, priority=0, arrival_time=1.5)
    assert request.prompt_token_ids == (5, 6, 7) and request.arrival_time == 1.5
    assert request.max_tokens == 64 - 3  # what the context leaves, max_tokens unset
    assert request.sampling_params.eos_token_ids == (2,)  # the model's EOS
    assert request.sampling_params.bad_words_token_ids == processor.bad_word_ids(("hello",))
    children = scheduler_requests(request)
    assert [c.request_id for c in children] == ["r-0", "r-1", "r-2"]
    assert len({c.sampling_params.seed for c in children}) == 3  # distinct seeds per sample


def test_checks_against_the_model_name_the_field(processor):
    too_long = EngineInput(None, list(range(64)))
    with pytest.raises(InvalidRequestError, match="maximum context length is 64") as info:
        processor.generation_request("r", too_long, SamplingParams(), priority=0, arrival_time=0.0)
    assert info.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as info:
        processor.prepared(EngineInput(None, [1, 2]), SamplingParams(stop_token_ids=(600,)))
    assert info.value.param == "stop_token_ids"
    with pytest.raises(InvalidRequestError, match="Priority scheduling is not enabled"):
        processor.check_priority(3)


def test_a_pooling_request_runs_its_prompt_only(processor):
    request = processor.pooling_request("p", EngineInput("hi", [5, 6]), PoolingParams(), priority=0, arrival_time=0.0)
    (child,) = scheduler_requests(request)
    assert child.request_id == "p" and child.max_tokens == 1 and child.pooling_params == PoolingParams()


def test_a_pooling_model_cannot_generate_in_one_wording(processor):
    encoder = InputProcessor(processor.config, replace(processor.info, kind="encoder", architecture="BertModel"),
                             processor.tokenizer)
    with pytest.raises(InvalidRequestError, match=r"this model \(BertModel\) is a pooling model and cannot generate"):
        encoder.check_can_generate()
    processor.check_can_generate()  # a decoder can
