"""LoRA adapters (engine/lora) against transformers + peft on the same base checkpoint.

Adapters are made with peft in the test, their factors random (`init_lora_weights=False`: peft's
default B = 0 would make every adapter the base model). Greedy tokens must equal
`PeftModel.from_pretrained`'s for each adapter alone and mixed in one batch with the base model
and the other adapters; bad adapters are refused in one line naming the problem.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import replace

import httpx
import openai
import pytest
import torch
import trio
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file

from engine import LLM, EngineConfig, ModelLoadError, SamplingParams, open_engine
from engine.config import CompilationConfig, LoRAModule
from engine.errors import InvalidRequestError
from engine.lora.adapter import LoRAError, read_adapter
from engine.lora_request import LoRARequest
from engine.sched.block_manager import KVBlockManager
from engine.sched.request import Request, RequestStatus
from engine.sched.scheduler import Scheduler, SchedulerConfig
from tests.helpers import final_output, greedy
from tests.model_helpers import save_hf_checkpoint, transformers_greedy
from tests.server_fixtures import running_server
from tests.test_moe_eplb import hf_moe
from tests.test_reference_transformers import COMMON, FAMILIES, VOCAB

ADAPTERS = {  # name -> peft options (targets over q/k/v/o and gate/up/down, ranks, rsLoRA)
    "attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"]),
    "all": dict(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj"]),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    config_cls, model_cls, extra = FAMILIES["llama"]
    return save_hf_checkpoint(tmp_path_factory, "lora-base", config_cls, model_cls, {**COMMON, **extra}, seed=7)


def make_adapter(tmp_path_factory, hf_model, name: str, seed: int, **options):
    """A peft adapter of `hf_model` with random factors (large enough to change greedy tokens),
    saved as peft saves it; returns its directory."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(init_lora_weights=False, **options))
    with torch.no_grad():
        for param_name, param in peft_model.named_parameters():
            if "lora_" in param_name:
                param.mul_(4.0)
    path = tmp_path_factory.mktemp(f"adapter-{name}")
    peft_model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, base):
    _, hf_model = base
    return {name: make_adapter(tmp_path_factory, hf_model, name, seed=i, **options)
            for i, (name, options) in enumerate(ADAPTERS.items())}


def peft_greedy(hf_model, adapter_dir, prompts, max_tokens):
    model = PeftModel.from_pretrained(copy.deepcopy(hf_model), str(adapter_dir)).eval()
    return transformers_greedy(model, prompts, max_tokens)


def lora_config(base_path, adapters, **options) -> EngineConfig:
    return EngineConfig(model=str(base_path), dtype="float32", num_kv_blocks=64, enable_lora=True,
                        lora_modules=tuple(LoRAModule(name, str(path)) for name, path in adapters.items()),
                        max_loras=len(adapters), **options)


async def greedy_by_adapter(engine, prompts: dict, max_tokens: int) -> dict:
    """Greedy tokens of every prompt at once, each on the adapter it is keyed by (None: the base)."""
    got = {}

    async def run(name):
        lora = None if name is None else LoRARequest(name)
        output = await final_output(engine, prompts[name], greedy(max_tokens, ignore_eos=True), lora_request=lora)
        got[name] = output.outputs[0].token_ids

    async with trio.open_nursery() as nursery:
        for name in prompts:
            nursery.start_soon(run, name)
    return got


async def test_each_adapter_alone_and_all_mixed_with_the_base_give_peft_greedy_tokens(base, adapters):
    base_path, hf_model = base
    rng = random.Random(1)
    prompts = [rng.choices(range(3, VOCAB), k=n) for n in (5, 13, 21, 34)]
    expected = {name: peft_greedy(hf_model, path, prompts, 12) for name, path in adapters.items()}
    expected[None] = transformers_greedy(hf_model, prompts, 12)
    assert len({str(v) for v in expected.values()}) == len(expected)  # each adapter changes the tokens
    jobs = [(name, i) for name in expected for i in range(len(prompts))]
    random.Random(2).shuffle(jobs)  # adapters interleaved in every batch
    got: dict[tuple[str | None, int], list[int]] = {}
    async with open_engine(lora_config(base_path, adapters)) as engine:
        async def run(name, i):
            lora = None if name is None else LoRARequest(name, 1)
            output = await final_output(engine, prompts[i], greedy(12, ignore_eos=True), lora_request=lora)
            got[name, i] = output.outputs[0].token_ids

        async with trio.open_nursery() as nursery:
            for name, i in jobs:
                nursery.start_soon(run, name, i)
    for name, tokens in expected.items():
        assert [got[name, i] for i in range(len(prompts))] == tokens, name


async def test_the_compiled_graphs_run_the_adapters_of_a_mixed_batch(base, adapters):
    """The decode and step graphs are exported with the delta as an opaque op: a batch mixing two
    adapters and the base model runs on them, every step, with peft's and transformers' tokens."""
    base_path, hf_model = base
    prompts = {"attn": [5, 9, 14, 200, 31, 8, 8], "mlp": [7, 7, 8, 100], None: [3, 4, 5, 6, 7]}
    pair = {"attn": adapters["attn"], "mlp": adapters["mlp"]}
    config = replace(lora_config(base_path, pair), enforce_eager=False,
                     compilation_config=CompilationConfig(cudagraph_capture_sizes=(2, 4)))
    async with open_engine(config) as engine:
        eager_calls = []
        model = engine.core.executor.worker.runner.model
        original = model.forward
        model.forward = lambda *args, **kwargs: eager_calls.append(1) or original(*args, **kwargs)
        got = await greedy_by_adapter(engine, prompts, 8)
        runner = engine.core.executor.worker.runner
        compiled = (runner.decode_graphs.steps_run, runner.step_graph.steps_run)
    for name in pair:
        assert got[name] == peft_greedy(hf_model, pair[name], [prompts[name]], 8)[0], name
    assert got[None] == transformers_greedy(hf_model, [prompts[None]], 8)[0]
    assert eager_calls == [] and compiled[0] >= 7 and compiled[1] >= 1


async def test_with_tensor_parallelism_each_rank_runs_its_share_of_the_adapters(base, adapters, tmp_path):
    """TP=2 (worker processes): B sharded with the column-parallel outputs, A with the row-parallel
    inputs (whose partial deltas are reduced with the base output); peft's tokens, mixed batch.
    An adapter loaded while serving reaches every rank; a bad one is refused by its type."""
    base_path, hf_model = base
    prompts = {"attn": [5, 9, 14, 200, 31], "all": [7, 7, 8, 100], None: [3, 4, 5, 6]}
    pair = {"attn": adapters["attn"], "all": adapters["all"]}
    async with open_engine(replace(lora_config(base_path, pair), tensor_parallel_size=2)) as engine:
        got = await greedy_by_adapter(engine, prompts, 6)
        # loaded while serving, by every worker process (the slots, laid out for "all", fit it)
        await engine.add_lora(LoRARequest("mlp", 0, str(adapters["mlp"])))
        with pytest.raises(LoRAError, match="'big': rank 64 is above --max-lora-rank 16"):
            await engine.add_lora(LoRARequest("big", 0, str(hostile("rank", adapters["mlp"], tmp_path))))
        late = await greedy_by_adapter(engine, {"mlp": prompts["all"]}, 6)
    assert late["mlp"] == peft_greedy(hf_model, adapters["mlp"], [prompts["all"]], 6)[0]
    for name in pair:
        assert got[name] == peft_greedy(hf_model, pair[name], [prompts[name]], 6)[0], name
    assert got[None] == transformers_greedy(hf_model, [prompts[None]], 6)[0]


def test_the_blocking_llm_takes_one_lora_request_per_prompt(base, adapters):
    base_path, hf_model = base
    prompts = [[5, 9, 14, 200, 31], [7, 7, 8]]
    llm = LLM(str(base_path), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2,
              lora_modules=(LoRAModule("attn", str(adapters["attn"])),))
    outputs = llm.generate(prompts, greedy(8, ignore_eos=True), use_tqdm=False,
                           lora_request=[LoRARequest("attn", 1, str(adapters["attn"])), None])
    assert outputs[0].outputs[0].token_ids == peft_greedy(hf_model, adapters["attn"], prompts[:1], 8)[0]
    assert outputs[1].outputs[0].token_ids == transformers_greedy(hf_model, prompts[1:], 8)[0]


async def test_an_unknown_adapter_is_refused_naming_it_and_the_engine_serves_on(base, adapters):
    base_path, hf_model = base
    async with open_engine(lora_config(base_path, {"attn": adapters["attn"]})) as engine:
        with pytest.raises(InvalidRequestError, match="`nope` does not exist.*it serves attn"):
            await final_output(engine, [5, 6, 7], greedy(4), lora_request=LoRARequest("nope", 9))
        output = await final_output(engine, [5, 6, 7], greedy(4, ignore_eos=True))
    assert output.outputs[0].token_ids == transformers_greedy(hf_model, [[5, 6, 7]], 4)[0]


async def test_adapters_never_share_prefix_cache_blocks(base, adapters):
    """The same 40-token prompt for the base and an adapter: the adapter's keys and values differ,
    so its blocks are its own (a shared block would give the base model's tokens)."""
    base_path, hf_model = base
    prompt = random.Random(3).choices(range(3, VOCAB), k=40)
    async with open_engine(lora_config(base_path, {"all": adapters["all"]})) as engine:
        plain = await final_output(engine, prompt, greedy(6, ignore_eos=True))
        adapted = await final_output(engine, prompt, greedy(6, ignore_eos=True), lora_request=LoRARequest("all", 1))
        again = await final_output(engine, prompt, greedy(6, ignore_eos=True), lora_request=LoRARequest("all", 1))
    assert plain.outputs[0].token_ids == transformers_greedy(hf_model, [prompt], 6)[0]
    assert adapted.outputs[0].token_ids == peft_greedy(hf_model, adapters["all"], [prompt], 6)[0]
    assert adapted.num_cached_tokens == 0 and again.num_cached_tokens == 32  # its own blocks, reused
    assert again.outputs[0].token_ids == adapted.outputs[0].token_ids


async def test_adapters_beyond_max_cpu_loras_are_evicted_and_read_again_when_used(base, adapters):
    """One adapter in memory at a time: every switch reads the other again from its directory,
    and each request still gets its adapter's tokens."""
    base_path, hf_model = base
    pair = {"attn": adapters["attn"], "mlp": adapters["mlp"]}
    config = replace(lora_config(base_path, pair), max_loras=1, max_cpu_loras=1)
    prompt = [11, 12, 13, 14]
    got = []
    async with open_engine(config) as engine:
        lora = engine.core.executor.worker.lora
        assert (lora.reads, list(lora.held)) == (2, ["mlp"])  # both checked at start-up, the last kept
        for name in ("attn", "mlp", "attn"):
            output = await final_output(engine, prompt, greedy(5, ignore_eos=True), lora_request=LoRARequest(name))
            got.append(output.outputs[0].token_ids)
        assert lora.reads == 5 and list(lora.held) == ["attn"]
    assert got == [peft_greedy(hf_model, pair[name], [prompt], 5)[0] for name in ("attn", "mlp", "attn")]


def test_the_scheduler_runs_at_most_max_loras_adapters_at_once():
    """With --max-loras 1, a request for a second adapter waits while the first adapter's request
    runs; the base model's requests and the same adapter's are not held back."""
    kv = KVBlockManager(num_blocks=32, block_size=4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                                          max_loras=1), kv)
    for rid, lora in (("a1", "a"), ("b1", "b"), ("base", None), ("a2", "a")):
        scheduler.add_request(Request(rid, [1, 2, 3], greedy(4), max_tokens=4, lora_name=lora))
    first = {s.request_id for s in scheduler.schedule().scheduled}
    assert first == {"a1", "base", "a2"}
    assert scheduler.num_waiting == scheduler.num_deferred == 1  # held back by the adapter limit, not by room
    assert scheduler.lora_adapters(scheduler.running) == ("a",)  # what /metrics reports
    assert scheduler.lora_adapters(scheduler.waiting) == ("b",)
    scheduler.finish_requests(["a1", "a2"], RequestStatus.FINISHED_ABORTED)
    assert "b1" in {s.request_id for s in scheduler.schedule().scheduled}


# ---- bad adapters: one line each, nothing else happens ----------------------------------------
def _copy_adapter(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_config(path, **changes):
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))


class Evil:
    def __reduce__(self):
        return (exec, ("raise SystemExit('the pickle ran')",))


def hostile(kind, good, tmp_path):
    bad = _copy_adapter(good, tmp_path / kind)
    weights = bad / "adapter_model.safetensors"
    if kind == "rank":
        _edit_config(bad, r=64)
    elif kind == "shape":
        tensors = load_file(str(weights))
        key = next(k for k in tensors if k.endswith("q_proj.lora_B.weight"))
        tensors[key] = torch.zeros(tensors[key].shape[0] + 1, tensors[key].shape[1])
        save_file(tensors, str(weights))
    elif kind == "pickle":
        weights.unlink()
        torch.save({"x": Evil()}, bad / "adapter_model.bin")
    elif kind == "missing":
        weights.unlink()
    elif kind == "truncated":
        weights.write_bytes(weights.read_bytes()[:100])
    elif kind == "lm_head":
        _edit_config(bad, target_modules=["q_proj", "lm_head"])
    elif kind == "modules_to_save":
        _edit_config(bad, modules_to_save=["lm_head"])
    elif kind == "no_config":
        (bad / "adapter_config.json").unlink()
    return bad


@pytest.mark.parametrize(("kind", "message"), [
    ("rank", "rank 64 is above --max-lora-rank 16"),
    ("pickle", "cannot read its weights"),
    ("missing", "no adapter_model.safetensors or adapter_model.bin"),
    ("truncated", "cannot read its weights"),
    ("lm_head", r"LoRA on the LM head \(lm_head\) is not supported"),
    ("modules_to_save", "modules_to_save .* is not supported"),
    ("no_config", "no adapter_config.json"),
])
def test_a_hostile_adapter_is_refused_in_one_line(adapters, tmp_path, kind, message):
    bad = hostile(kind, adapters["attn"], tmp_path)
    with pytest.raises(LoRAError, match=message) as caught:
        read_adapter("bad", bad, max_rank=16, dtype=torch.float32)
    assert "\n" not in str(caught.value) and "'bad'" in str(caught.value)


async def test_a_bad_adapter_fails_start_up_naming_it_and_the_shapes(base, adapters, tmp_path):
    base_path, _ = base
    bad = hostile("shape", adapters["attn"], tmp_path)
    with pytest.raises(ModelLoadError, match=r"LoRA adapter 'bad': model\.layers\.0\.self_attn\.q_proj has lora_A"):
        async with open_engine(lora_config(base_path, {"good": adapters["mlp"], "bad": bad})):
            pass


@pytest.mark.parametrize(("text", "expected"), [
    ("sql=/adapters/sql", LoRAModule("sql", "/adapters/sql")),
    ('{"name": "sql", "path": "/a/sql", "base_model_name": "llama"}', LoRAModule("sql", "/a/sql", "llama")),
])
def test_lora_modules_take_vllms_two_forms(text, expected):
    assert LoRAModule.parse(text) == expected


@pytest.mark.parametrize(("options", "message"), [
    ({"lora_modules": (LoRAModule("a", "/a"),)}, "lora_modules needs enable_lora"),
    ({"enable_lora": True, "max_loras": 4, "max_cpu_loras": 2}, r"max_cpu_loras \(2\) must be at least max_loras"),
    ({"enable_lora": True, "max_lora_rank": 0}, "max_lora_rank must be at least 1"),
    ({"enable_lora": True, "lora_modules": (LoRAModule("a", "/a"), LoRAModule("a", "/b"))}, "must be distinct"),
])
def test_bad_lora_options_are_refused_naming_the_problem(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **options)


async def test_the_server_lists_adapters_under_their_base_and_serves_them_by_model_name(base, adapters):
    """The real openai client: /v1/models lists each adapter with its parent, a completion for an
    adapter's name runs it (peft's tokens; the response names the adapter), and a name nobody
    serves is a 404 while the server goes on serving. Loading adapters at run time is off."""
    base_path, hf_model = base
    prompt = [5, 9, 14, 200, 31]
    config = replace(lora_config(base_path, adapters), lora_modules=(
        LoRAModule("attn", str(adapters["attn"])), LoRAModule("mlp", str(adapters["mlp"]), "custom-base")))
    async with running_server(config) as server:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        async with client:
            models = {m.id: m for m in (await client.models.list()).data}
            base_name = server.state.model_name
            assert set(models) == {base_name, "attn", "mlp"}
            assert (models["attn"].parent, models["mlp"].parent, models[base_name].parent) == \
                (base_name, "custom-base", None)
            answer = await client.completions.create(model="attn", prompt=prompt, max_tokens=6, temperature=0,
                                                     extra_body={"ignore_eos": True, "return_token_ids": True})
            with pytest.raises(openai.NotFoundError, match="`sql` does not exist"):
                await client.completions.create(model="sql", prompt=prompt, max_tokens=2)
            plain = await client.completions.create(model=base_name, prompt=prompt, max_tokens=6, temperature=0,
                                                    extra_body={"ignore_eos": True, "return_token_ids": True})
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(server.url + "/metrics")).text
            # run-time loading is off unless allowed (tests/test_lora_runtime.py has it on)
            load = await http.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/"})
    assert load.status_code == 404 and "--allow-runtime-lora-updating" in load.json()["error"]["message"]
    assert 'vllm:lora_requests_info{max_lora="3",running_lora_adapters="",waiting_lora_adapters=""}' in metrics
    assert answer.model == "attn" and plain.model == base_name
    assert answer.choices[0].token_ids == peft_greedy(hf_model, adapters["attn"], [prompt], 6)[0]
    assert plain.choices[0].token_ids == transformers_greedy(hf_model, [prompt], 6)[0]


def test_vllms_lora_flags_reach_the_engine_config():
    from web.cli import _parser
    from web.options import engine_config

    args = _parser().parse_args(["serve", "m", "--enable-lora", "--lora-modules", "sql=/a/sql",
                                 '{"name": "chat", "path": "/a/chat", "base_model_name": "m"}',
                                 "--max-loras", "2", "--max-cpu-loras", "4", "--max-lora-rank", "64"])
    config = engine_config("m", args)
    assert config.enable_lora
    assert config.lora_modules == (LoRAModule("sql", "/a/sql"), LoRAModule("chat", "/a/chat", "m"))
    assert (config.max_loras, config.lora_cpu_capacity, config.max_lora_rank) == (2, 4, 64)
    assert engine_config("m", _parser().parse_args(["serve", "m"])).enable_lora is False


async def test_an_moe_models_attention_takes_adapters_eager_and_compiled(tmp_path_factory):
    """Mixtral: adapters on the attention projections (its experts take none: refused in one line);
    its decode graph goes through torch.compile, where the delta is the opaque op."""
    path, hf_model = hf_moe(tmp_path_factory, "mixtral")
    adapter = make_adapter(tmp_path_factory, hf_model, "moe-attn", seed=5, r=8, lora_alpha=16,
                           target_modules=["q_proj", "v_proj", "o_proj"])
    prompt = [5, 9, 14, 200, 31]
    expected = peft_greedy(hf_model, adapter, [prompt], 6)[0]
    assert expected != transformers_greedy(hf_model, [prompt], 6)[0]
    for eager in (True, False):
        config = replace(lora_config(path, {"attn": adapter}), enforce_eager=eager,
                         compilation_config=CompilationConfig(cudagraph_capture_sizes=(2,)))
        async with open_engine(config) as engine:
            output = await final_output(engine, prompt, greedy(6, ignore_eos=True), lora_request=LoRARequest("attn"))
        assert output.outputs[0].token_ids == expected, eager


async def prompt_logprobs(engine, prompt: list[int], adapter: str | None) -> torch.Tensor:
    """The logprob of each prompt token after the first, as the engine scores it with `adapter`."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    output = await final_output(engine, prompt, params, lora_request=LoRARequest(adapter) if adapter else None)
    return torch.tensor([entry[token].logprob for token, entry in zip(prompt[1:], output.prompt_logprobs[1:],
                                                                      strict=True)])


async def test_adapters_run_on_a_quantized_base(base, adapters):
    """The adapters' delta is added to the int8 layers' output as to the float layers': with each
    adapter, int8 scores a prompt as the float model does, up to int8's rounding, which is far
    smaller than what the adapter itself changes."""
    base_path, _ = base
    prompt = [5, 9, 200, 31, 77, 100, 3, 8, 41, 42, 43, 44]
    scores = {}
    for quantization in (None, "int8"):
        async with open_engine(lora_config(base_path, adapters, quantization=quantization)) as engine:
            for name in [None, *adapters]:
                scores[quantization, name] = await prompt_logprobs(engine, prompt, name)
    for name in adapters:
        rounding = (scores["int8", name] - scores[None, name]).abs().max()
        adapted = (scores["int8", name] - scores["int8", None]).abs().max()
        assert rounding < 0.25 * adapted, (name, float(rounding), float(adapted))
