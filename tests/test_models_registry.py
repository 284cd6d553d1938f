"""docs/models.md is generated from the registry (engine/models/registry.py), and the registry lists
exactly what the loaders take; the new families run under tensor parallelism as transformers does."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import EngineConfig, open_engine
from engine.errors import ModelLoadError
from engine.models.bert import ENCODER_ARCHITECTURES
from engine.models.hf_config import DECODER_ARCHITECTURES
from engine.models.loader import load_decoder
from engine.models.registry import models_table, served_names
from engine.models.tiny import make_model
from engine.models.tiny_spec import TinyModelSpec
from tests.helpers import greedy_together
from tests.model_helpers import paged_logits, save_hf_checkpoint, transformers_greedy
from tests.test_reference_transformers import COMMON, FAMILIES, VOCAB

DOCS = Path(__file__).resolve().parent.parent / "docs" / "models.md"


def test_the_models_page_is_generated_from_the_registry_which_lists_what_the_loaders_take():
    assert DOCS.read_text() == models_table(), "regenerate: python -m engine.models.registry > docs/models.md"
    assert set(served_names()) == {*DECODER_ARCHITECTURES, *ENCODER_ARCHITECTURES, "LlavaForConditionalGeneration"}


@pytest.mark.parametrize("family", ["gemma3", "phi3"])  # mistral shards as llama does
async def test_tensor_parallel_2_gives_transformers_greedy_tokens(family, tmp_path_factory):
    config_cls, model_cls, extra = FAMILIES[family]
    path, hf_model = save_hf_checkpoint(tmp_path_factory, f"{family}-tp", config_cls, model_cls, {**COMMON, **extra})
    rng = random.Random(4)
    prompts = [rng.choices(range(3, VOCAB), k=n) for n in (6, 30)]  # the second past the window
    expected = transformers_greedy(hf_model, prompts, 12)
    config = EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2,
                          enforce_eager=True)
    assert await greedy_together(config, prompts, 12) == expected


async def test_quantization_on_a_model_that_does_not_quantize_is_refused_not_ignored(minilm_dir):
    with pytest.raises(ModelLoadError, match="--quantization int8: not implemented for encoder"):
        async with open_engine(EngineConfig(model=minilm_dir, quantization="int8")):
            pass  # pragma: no cover - never reached


@pytest.mark.parametrize("arch", ["mistral", "gemma3", "gpt_oss"])
def test_make_models_new_architectures_are_what_transformers_loads(tmp_path, arch):
    """`make-model --arch mistral|gemma3|gpt_oss` (the benchmarks' checkpoints): transformers reads the
    same architecture from them, and our logits equal its, past the window."""
    spec = TinyModelSpec(arch=arch, layers=7, hidden=64, heads=4, kv_heads=1, head_dim=32, intermediate=128,
                         vocab=512, sliding_window=8, experts=4)
    path = make_model(tmp_path / arch, spec)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(hf_model).__name__ == {"mistral": "MistralForCausalLM", "gemma3": "Gemma3ForCausalLM",
                                       "gpt_oss": "GptOssForCausalLM"}[arch]
    ids = random.Random(0).choices(range(512), k=30)
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0]
    ours = paged_logits(load_decoder(path, "float32"), ids, [(0, 30)], list(range(64)))
    assert torch.allclose(ours, expected, atol=1e-4, rtol=1e-4), (ours - expected).abs().max()
