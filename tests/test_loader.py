"""Loading HF directories: sharded weights, dtypes, and clear errors for broken checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import EngineConfig, ModelLoadError, open_engine
from engine.models.loader import load_decoder
from tests.conftest import engine_config
from tests.helpers import final_output, greedy


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    path = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, path)
    return path


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_sharded_checkpoint_loads_the_same_weights(tiny_model_dir, model_copy):
    weights = load_file(str(model_copy / "model.safetensors"))
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for filename, keys in halves.items():
        save_file({k: weights[k] for k in keys}, str(model_copy / filename))
    index = {"weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    (model_copy / "model.safetensors").unlink()
    sharded = load_decoder(model_copy)
    single = load_decoder(tiny_model_dir)
    for (name, a), (_, b) in zip(sharded.state_dict().items(), single.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
async def test_half_precision_dtypes_generate(tiny_model_dir, dtype):
    async with open_engine(engine_config(tiny_model_dir, dtype=dtype)) as engine:
        assert engine.info.dtype == dtype
        out = await final_output(engine, "half precision", greedy(8, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 8


@pytest.mark.parametrize("breakage, message", [
    (lambda p: _edit_config(p, architectures=["GPT2LMHeadModel"]),
     r"unsupported architecture \['GPT2LMHeadModel'\]; trio-llm serves .*Gemma3ForCausalLM.*MistralForCausalLM"),
    (lambda p: (p / "config.json").unlink(), "config.json is missing"),
    (lambda p: (p / "model.safetensors").unlink(), "no model.safetensors"),
    (lambda p: (p / "tokenizer.json").unlink(), "tokenizer.json is missing"),
    (lambda p: _edit_config(p, hidden_size=96), "has shape"),
    (lambda p: _edit_config(p, num_hidden_layers=3), "lacks"),
    (lambda p: _edit_config(p, hidden_act="gelu"), "unsupported hidden_act"),
])
async def test_broken_checkpoints_fail_with_a_clear_error(model_copy, breakage, message):
    breakage(model_copy)
    with pytest.raises(ModelLoadError, match=message):
        async with open_engine(EngineConfig(model=str(model_copy), num_kv_blocks=8)):
            pass  # pragma: no cover - never reached


async def test_missing_directory_and_oversized_context_are_named(tiny_model_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        async with open_engine(EngineConfig(model=str(tmp_path / "nowhere"))):
            pass
    with pytest.raises(ModelLoadError, match="max_position_embeddings"):
        async with open_engine(EngineConfig(model=tiny_model_dir, max_model_len=100_000)):
            pass
    with pytest.raises(ValueError, match="without chunked prefill"):
        async with open_engine(EngineConfig(model=tiny_model_dir, enable_chunked_prefill=False,
                                            max_num_batched_tokens=64, max_model_len=512)):
            pass


@pytest.mark.parametrize("option, value", [("dtype", "int8"), ("block_size", 0), ("scheduling_policy", "lifo"),
                                           ("max_num_seqs", 0)])
def test_bad_engine_options_are_refused(option, value):
    with pytest.raises(ValueError, match=option):
        EngineConfig(model="somewhere", **{option: value})


def test_auto_dtype_is_the_checkpoints_but_bfloat16_for_float32_on_cuda():
    """vLLM's `auto` on a GPU: a float32 checkpoint runs in bfloat16 (16-bit tensor cores and half
    the bytes to read); the CPU keeps the checkpoint's dtype. An explicit dtype always wins."""
    from engine.models.loader import resolve_dtype

    assert resolve_dtype("auto", "float32", "cpu") is torch.float32
    assert resolve_dtype("auto", "float32", "cuda") is torch.bfloat16
    assert resolve_dtype("auto", "torch.float32", "cuda:1") is torch.bfloat16
    assert resolve_dtype("auto", "float16", "cuda") is torch.float16  # a 16-bit checkpoint keeps its dtype
    assert resolve_dtype("float32", "float32", "cuda") is torch.float32
    assert resolve_dtype("auto", "bfloat16", "cpu") is torch.bfloat16
