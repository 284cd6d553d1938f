"""`--generation-config`: a model's generation_config.json gives the sampling defaults, as in vLLM."""

from __future__ import annotations

import json
import shutil

import pytest

from engine import ModelLoadError, RequestOutputKind, open_engine
from engine.models.hf_config import read_generation_defaults
from tests.conftest import engine_config
from web.openai.protocol import CompletionRequest


@pytest.fixture(scope="module")
def tuned_model(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("tuned") / "model"
    shutil.copytree(tiny_model_dir, path)
    generation = json.loads((path / "generation_config.json").read_text())
    generation.update({"temperature": 0.3, "top_p": 0.8, "do_sample": True, "top_k": True})
    (path / "generation_config.json").write_text(json.dumps(generation))
    return str(path)


def test_the_models_sampling_keys_become_defaults(tuned_model, tiny_model_dir, tmp_path):
    assert read_generation_defaults("auto", tuned_model) == {"temperature": 0.3, "top_p": 0.8}  # not bools
    assert read_generation_defaults("vllm", tuned_model) == {}
    assert read_generation_defaults(tuned_model, tiny_model_dir) == {"temperature": 0.3, "top_p": 0.8}
    with pytest.raises(ModelLoadError, match="no generation_config.json there"):
        read_generation_defaults(str(tmp_path), tiny_model_dir)


def test_a_requests_own_values_win_over_the_defaults():
    defaults = {"temperature": 0.3, "top_p": 0.8}
    unset = CompletionRequest(prompt="x").sampling_params(4, None, RequestOutputKind.FINAL_ONLY, defaults=defaults)
    assert (unset.temperature, unset.top_p) == (0.3, 0.8)
    explicit = CompletionRequest(prompt="x", temperature=0.0).sampling_params(4, None, RequestOutputKind.FINAL_ONLY,
                                                                                defaults=defaults)
    assert (explicit.temperature, explicit.top_p) == (0.0, 0.8)


async def test_the_engine_reads_them_when_it_opens(tuned_model):
    async with open_engine(engine_config(tuned_model)) as engine:
        assert engine.sampling_defaults == {"temperature": 0.3, "top_p": 0.8}
    async with open_engine(engine_config(tuned_model, generation_config="vllm")) as engine:
        assert engine.sampling_defaults == {}
