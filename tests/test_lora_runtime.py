"""LoRA adapters loaded and unloaded while the engine serves: `AsyncEngine.add_lora` /
`remove_lora`, an LLM's `LoRARequest` with a new path (vLLM's library behaviour), and the server's
`/v1/load_lora_adapter` / `/v1/unload_lora_adapter` under load. Tokens are checked against
transformers + peft on the same base checkpoint (tests/test_lora.py's fixtures)."""

from __future__ import annotations

import random
from dataclasses import replace

import httpx
import openai
import pytest
import trio
import trio.testing

from engine import LLM, EngineConfig, open_engine
from engine.errors import InvalidRequestError, LoRAError
from engine.lora_request import LoRARequest
from tests.helpers import final_output, greedy
from tests.model_helpers import transformers_greedy
from tests.server_fixtures import running_server
from tests.test_lora import adapters, base, hostile, lora_config, peft_greedy  # noqa: F401 -- fixtures
from tests.test_reference_transformers import VOCAB
from web.http.settings import ServerSettings


def runtime_config(base_path, max_loras: int) -> EngineConfig:
    """No adapter configured; any may be loaded while serving."""
    return EngineConfig(model=str(base_path), dtype="float32", num_kv_blocks=64, enable_lora=True,
                        max_loras=max_loras, allow_runtime_lora_updating=True)


def test_an_llm_loads_an_adapter_a_request_brings_by_path(base, adapters):  # noqa: F811
    """vLLM's offline use: `enable_lora` and no configured adapter; each LoRARequest names its
    directory and is loaded on first use (slots laid out for any adapter up to max_lora_rank)."""
    base_path, hf_model = base
    prompts = [[5, 9, 14, 200, 31], [7, 7, 8], [3, 4, 5, 6]]
    llm = LLM(str(base_path), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2)
    loras = [LoRARequest("attn", 1, str(adapters["attn"])), LoRARequest("all", 2, str(adapters["all"])), None]
    outputs = llm.generate(prompts, greedy(6, ignore_eos=True), use_tqdm=False, lora_request=loras)
    assert outputs[0].outputs[0].token_ids == peft_greedy(hf_model, adapters["attn"], prompts[:1], 6)[0]
    assert outputs[1].outputs[0].token_ids == peft_greedy(hf_model, adapters["all"], prompts[1:2], 6)[0]
    assert outputs[2].outputs[0].token_ids == transformers_greedy(hf_model, prompts[2:], 6)[0]


async def test_unloading_waits_for_the_adapters_requests_and_refuses_new_ones(base, adapters):  # noqa: F811
    """remove_lora while a request runs on the adapter: new requests for it are refused at once,
    the running one ends with all of peft's tokens (its weights stay), then the workers drop it."""
    base_path, hf_model = base
    prompt = [5, 9, 14, 200, 31]
    async with open_engine(runtime_config(base_path, max_loras=1)) as engine:
        await engine.add_lora(LoRARequest("mlp", 0, str(adapters["mlp"])))
        serving = engine.core.executor.worker.lora
        removed = trio.Event()

        async def remove() -> None:
            await engine.remove_lora("mlp")
            removed.set()

        tokens = []
        async with trio.open_nursery() as nursery:
            async for output in engine.generate(prompt, greedy(12, ignore_eos=True), lora_request=LoRARequest("mlp")):
                if not tokens:
                    nursery.start_soon(remove)
                    await trio.testing.wait_all_tasks_blocked()
                    assert "mlp" not in engine.loras and "mlp" in serving.paths and not removed.is_set()
                    with pytest.raises(InvalidRequestError, match="`mlp` does not exist"):
                        await final_output(engine, prompt, greedy(2), lora_request=LoRARequest("mlp"))
                tokens = output.outputs[0].token_ids
        assert removed.is_set() and "mlp" not in serving.paths and "mlp" not in serving.held
        # the name may be loaded again, from another directory
        await engine.add_lora(LoRARequest("mlp", 0, str(adapters["attn"])))
        again = await final_output(engine, prompt, greedy(6, ignore_eos=True), lora_request=LoRARequest("mlp"))
    assert tokens == peft_greedy(hf_model, adapters["mlp"], [prompt], 12)[0]
    assert again.outputs[0].token_ids == peft_greedy(hf_model, adapters["attn"], [prompt], 6)[0]


async def test_an_adapter_replaced_in_place_serves_its_new_weights(base, adapters):  # noqa: F811
    base_path, hf_model = base
    prompt = [11, 12, 13, 14]
    async with open_engine(lora_config(base_path, {"tuned": adapters["attn"]}, allow_runtime_lora_updating=True)) \
            as engine:
        before = await final_output(engine, prompt, greedy(5, ignore_eos=True), lora_request=LoRARequest("tuned"))
        with pytest.raises(InvalidRequestError, match="has already been loaded.*load_inplace"):
            await engine.add_lora(LoRARequest("tuned", 0, str(adapters["all"])))
        await engine.add_lora(LoRARequest("tuned", 0, str(adapters["all"])), replace=True)
        after = await final_output(engine, prompt, greedy(5, ignore_eos=True), lora_request=LoRARequest("tuned"))
    assert before.outputs[0].token_ids == peft_greedy(hf_model, adapters["attn"], [prompt], 5)[0]
    assert after.outputs[0].token_ids == peft_greedy(hf_model, adapters["all"], [prompt], 5)[0]


async def test_without_runtime_updating_a_new_adapter_must_fit_the_slots(base, adapters):  # noqa: F811
    """Slots fitted to "attn" (q/k/v/o at rank 8): an adapter on the MLP is refused naming the
    module and the way out; one on a subset of attn's modules at a lower rank is served."""
    base_path, hf_model = base
    async with open_engine(lora_config(base_path, {"attn": adapters["attn"]})) as engine:
        with pytest.raises(LoRAError, match=r"'mlp': it changes model\.layers\.0\.mlp\.gate_proj, which no "
                                            r"adapter served at start-up changes; .*--allow-runtime-lora-updating"):
            await engine.add_lora(LoRARequest("mlp", 0, str(adapters["mlp"])))
        assert engine.loras.names() == ["attn"]
        output = await final_output(engine, [3, 4, 5], greedy(4, ignore_eos=True), lora_request=LoRARequest("attn"))
    assert output.outputs[0].token_ids == peft_greedy(hf_model, adapters["attn"], [[3, 4, 5]], 4)[0]


async def test_the_server_loads_and_unloads_adapters_while_it_streams(base, adapters):  # noqa: F811
    """The real openai client streams from the base model while an adapter is loaded over HTTP,
    served by name (listed under its base), then unloaded while one of its own streams runs: that
    stream keeps every peft token, and afterwards the name is a 404."""
    base_path, hf_model = base
    rng = random.Random(5)
    base_prompts = [rng.choices(range(3, VOCAB), k=9) for _ in range(2)]
    prompt = [5, 9, 14, 200, 31]
    config = runtime_config(base_path, max_loras=2)
    base_tokens: list[list[int]] = []
    async with running_server(config) as server:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        base_name = server.state.model_name

        async def stream(model: str, prompt: list[int], max_tokens: int, first: trio.Event | None = None
                         ) -> list[int]:
            tokens: list[int] = []
            chunks = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                     temperature=0, stream=True,
                                                     extra_body={"ignore_eos": True, "return_token_ids": True})
            async for chunk in chunks:
                tokens += chunk.choices[0].token_ids or []
                if first is not None:
                    first.set()
            return tokens

        async def base_stream(p: list[int], started: trio.Event) -> None:
            base_tokens.append(await stream(base_name, p, 24, started))

        async with client, httpx.AsyncClient(base_url=server.url) as http, trio.open_nursery() as nursery:
            for p in base_prompts:
                started = trio.Event()
                nursery.start_soon(base_stream, p, started)
                await started.wait()  # the base model is streaming when the adapter loads
            loaded = await http.post("/v1/load_lora_adapter", json={"lora_name": "mlp",
                                                                    "lora_path": str(adapters["mlp"])})
            assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'mlp' added successfully.")
            models = {m.id: m.parent for m in (await client.models.list()).data}
            assert models == {base_name: None, "mlp": base_name}
            first = trio.Event()
            adapter_tokens: list[list[int]] = []

            async def adapter_stream() -> None:
                adapter_tokens.append(await stream("mlp", prompt, 16, first))

            nursery.start_soon(adapter_stream)
            await first.wait()
            unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"})
            assert (unloaded.status_code, unloaded.text) == \
                (200, "Success: LoRA adapter 'mlp' removed successfully.")
            with pytest.raises(openai.NotFoundError, match="`mlp` does not exist"):
                await client.completions.create(model="mlp", prompt=prompt, max_tokens=2)
            assert [m.id for m in (await client.models.list()).data] == [base_name]
    assert adapter_tokens == [peft_greedy(hf_model, adapters["mlp"], [prompt], 16)[0]]
    assert sorted(base_tokens) == sorted(transformers_greedy(hf_model, base_prompts, 24))


async def test_bad_runtime_loads_are_clear_errors_and_the_server_serves_on(base, adapters, tmp_path):  # noqa: F811
    base_path, hf_model = base
    good = adapters["attn"]
    config = replace(lora_config(base_path, {"attn": good}), allow_runtime_lora_updating=True)
    cases = [  # body -> status, what the message says
        ({"lora_name": "x", "lora_path": str(hostile("rank", good, tmp_path))}, 400, "rank 64 is above"),
        ({"lora_name": "x", "lora_path": str(hostile("shape", good, tmp_path))}, 400, "q_proj has lora_A"),
        ({"lora_name": "x", "lora_path": str(hostile("pickle", good, tmp_path))}, 400, "cannot read its weights"),
        ({"lora_name": "x", "lora_path": str(hostile("truncated", good, tmp_path))}, 400, "cannot read its weights"),
        ({"lora_name": "x", "lora_path": str(tmp_path / "nowhere")}, 404, "No adapter found for"),
        ({"lora_name": "attn", "lora_path": str(good)}, 400, "'attn' has already been loaded"),
        ({"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
        ({"lora_name": str(base_path), "lora_path": str(good)}, 400, "conflicts with a served base model"),
        ({"lora_name": 5, "lora_path": str(good)}, 400, "lora_name"),
    ]
    async with running_server(config, ServerSettings(api_key="key")) as server:
        headers = {"Authorization": "Bearer key"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers) as http:
            anonymous = await http.post("/v1/load_lora_adapter", headers={"Authorization": ""},
                                        json={"lora_name": "x", "lora_path": str(good)})
            assert anonymous.status_code == 401
            for body, status, message in cases:
                answer = await http.post("/v1/load_lora_adapter", json=body)
                assert answer.status_code == status and message in answer.json()["error"]["message"], body
            missing = await http.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
            assert (missing.status_code, missing.json()["error"]["message"]) == \
                (404, "The lora adapter 'x' cannot be found.")
            served = await http.post("/v1/completions", json={"model": "attn", "prompt": [3, 4, 5], "max_tokens": 4,
                                                               "temperature": 0, "ignore_eos": True,
                                                               "return_token_ids": True})
            assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]][1:] == ["attn"]
    assert served.json()["choices"][0]["token_ids"] == peft_greedy(hf_model, good, [[3, 4, 5]], 4)[0]


def test_runtime_updating_comes_from_the_flag_or_vllms_variable(monkeypatch):
    from web.cli import _parser
    from web.options import engine_config

    def config(*flags: str):
        return engine_config("m", _parser().parse_args(["serve", "m", *flags]))

    assert config("--enable-lora", "--allow-runtime-lora-updating").allow_runtime_lora_updating
    assert not config("--enable-lora").allow_runtime_lora_updating
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert config("--enable-lora").allow_runtime_lora_updating
    assert not config().allow_runtime_lora_updating  # vLLM's machine-wide variable needs --enable-lora
    with pytest.raises(ValueError, match="allow_runtime_lora_updating needs enable_lora"):
        config("--allow-runtime-lora-updating")
