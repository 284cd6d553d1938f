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
    with pytest.raises(ValueError, match="trust_remote_code: trio-llm runs no code from model directories"):
        LLM(tiny_model_dir, trust_remote_code=True)  # vLLM's option, refused with the reason


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


def test_make_model_gives_every_vocab_row_even_past_what_the_tokenizer_learns(tmp_path):
    """`--vocab 32000` makes a 32,000-row embedding and LM head (the benchmark's checkpoint) though
    the tokenizer learns fewer tokens from the corpus, as padded checkpoints have; a token past the
    tokenizer is generated and decodes to nothing."""
    from safetensors import safe_open
    from tokenizers import Tokenizer

    path = make_model(tmp_path / "padded", TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64,
                                                         vocab=20000))
    learned = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    assert learned < 20000 and json.loads((path / "config.json").read_text())["vocab_size"] == 20000
    with safe_open(str(path / "model.safetensors"), "pt") as weights:
        assert weights.get_slice("model.embed_tokens.weight").get_shape() == [20000, 32]
    llm = LLM(str(path), num_kv_blocks=16)
    params = SamplingParams(max_tokens=3, ignore_eos=True, allowed_token_ids=[learned + 100])
    (output,) = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert output.outputs[0].token_ids == [learned + 100] * 3 and output.outputs[0].text == ""


def test_generate_without_a_model_creates_the_default_in_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["generate", "--max-tokens", "3", "--kv-cache-memory-bytes", str(1 << 26)]) == 0
    assert (tmp_path / "trio-llm" / "default-model-v1" / "model.safetensors").is_file()
    assert "->" in capsys.readouterr().out
