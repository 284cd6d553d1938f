"""The blocking `LLM` facade and the `trio-llm` command line."""

from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams
from engine.models.tiny import TinyModelSpec, make_model
from web.cli import main


def test_llm_generate_returns_one_output_per_prompt_in_order(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_kv_blocks=64)
    prompts = ["first prompt", "a second, longer prompt than the first", [5, 6, 7]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outputs] == ["first prompt", "a second, longer prompt than the first", None]
    assert all(len(o.outputs[0].token_ids) == 6 and o.finished for o in outputs)
    again = llm.generate("first prompt", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert again[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids  # same worker, second trio.run


def test_llm_chat_and_unknown_options(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_kv_blocks=64)
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out) == 1 and "<|im_start|>user\nhi<|im_end|>" in out[0].prompt
    with pytest.raises(TypeError, match="unknown engine options"):
        LLM(tiny_model_dir, gpu_memory_utilisation=0.9)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_make_model_writes_a_loadable_deterministic_checkpoint(tmp_path, arch, capsys):
    args = ["make-model", str(tmp_path / arch), "--arch", arch, "--layers", "1", "--hidden", "32",
            "--heads", "2", "--kv-heads", "1", "--intermediate", "64", "--vocab", "300"]
    assert main(args) == 0
    config = json.loads((tmp_path / arch / "config.json").read_text())
    assert config["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                        "qwen3": "Qwen3ForCausalLM"}[arch]]
    again = make_model(tmp_path / "again", TinyModelSpec(arch=arch, layers=1, hidden=32, heads=2, kv_heads=1,
                                                         intermediate=64, vocab=300))
    assert (again / "model.safetensors").read_bytes() == (tmp_path / arch / "model.safetensors").read_bytes()
    assert main(["generate", "--model", str(tmp_path / arch), "--max-tokens", "4", "hello"]) == 0
    assert "'hello' ->" in capsys.readouterr().out


def test_generate_without_a_model_creates_the_default_in_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["generate", "--max-tokens", "3", "--kv-cache-memory-bytes", str(1 << 26)]) == 0
    assert (tmp_path / "trio-llm" / "default-model-v1" / "model.safetensors").is_file()
    assert "->" in capsys.readouterr().out
