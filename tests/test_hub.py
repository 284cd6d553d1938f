"""Hub ids (engine/hub.py): `serve ORG/NAME` resolved as vLLM resolves it, a local directory first,
then huggingface_hub's cache, then a download; here from a fake hub on 127.0.0.1 (tests/fake_hub.py),
and offline from the cache that download laid out. Nothing reaches the network."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from bench.http import request
from engine import open_engine
from engine.errors import ModelLoadError
from engine.hub import resolve, resolve_model_files
from engine.sampling_params import SamplingParams
from tests.conftest import engine_config
from tests.fake_hub import COMMIT, fake_hub
from tests.helpers import final_output
from tests.server_fixtures import running_server

REPO = "trio-llm-tests/tiny"
SNAPSHOT = Path("models--trio-llm-tests--tiny") / "snapshots" / COMMIT


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache that huggingface_hub finds through HF_HUB_CACHE; online, no token."""
    cache = tmp_path / "hub-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    for name in ("HF_HUB_OFFLINE", "HF_TOKEN", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    return cache


@pytest.fixture
def repo_dir(tiny_model_dir, tmp_path) -> Path:
    """The tiny model as a repository holds it, with the copies serving never reads."""
    repo = tmp_path / "repo"
    shutil.copytree(tiny_model_dir, repo)
    (repo / "original").mkdir()
    (repo / "original" / "params.json").write_text("{}")
    (repo / "consolidated.safetensors").write_bytes(b"a second copy of the weights")
    (repo / "README.md").write_text("# tiny")
    return repo


async def test_a_hub_id_is_downloaded_once_served_under_its_id_and_then_found_offline(
        repo_dir, hub_cache, monkeypatch):
    with fake_hub({REPO: repo_dir}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        async with running_server(engine_config(REPO, enforce_eager=True)) as server:
            models = (await request(server.url, "GET", "/v1/models")).json()["data"]
            assert [m["id"] for m in models] == [REPO]  # the hub id, as vLLM reports it
            body = {"model": REPO, "prompt": "hello", "max_tokens": 3, "ignore_eos": True}
            answer = await request(server.url, "POST", "/v1/completions", body)
            assert answer.status == 200 and answer.json()["usage"]["completion_tokens"] == 3
        downloaded = sorted(r.split(f"/resolve/{COMMIT}/")[1] for r in hub.requests
                            if r.startswith("GET") and "/resolve/" in r)
    served = sorted(name for name in os.listdir(repo_dir) if name.endswith((".json", ".safetensors"))
                    and not name.startswith("consolidated"))
    assert downloaded == served  # each once; no README, no original/, no consolidated copy
    assert (hub_cache / "models--trio-llm-tests--tiny" / "refs" / "main").read_text() == COMMIT
    snapshot = hub_cache / SNAPSHOT
    assert (snapshot / "config.json").is_file() and not (snapshot / "original").exists()

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # and the hub is gone
    assert resolve(REPO) == str(snapshot)
    with pytest.raises(ModelLoadError) as missing:
        resolve("trio-llm-tests/never-downloaded")
    said = str(missing.value)
    assert "\n" not in said and str(hub_cache) in said and "HF_HUB_OFFLINE=1" in said, said
    with pytest.raises(ModelLoadError, match="not in the Hugging Face cache"):  # and the engine says it so
        async with open_engine(engine_config("trio-llm-tests/never-downloaded", enforce_eager=True)):
            pass


def test_a_local_directory_wins_over_the_hub_and_the_download_dir_over_the_environment(
        repo_dir, hub_cache, tmp_path, monkeypatch):
    with fake_hub({REPO: repo_dir}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.chdir(tmp_path)
        shutil.copytree(repo_dir, tmp_path / REPO)
        assert resolve(REPO) == REPO and hub.requests == []  # a directory of that name is the model
        shutil.rmtree(tmp_path / "trio-llm-tests")
        elsewhere = tmp_path / "download-dir"
        config = resolve_model_files(engine_config(REPO, download_dir=str(elsewhere)))
        assert config.model == str(elsewhere / SNAPSHOT) and not hub_cache.exists()
        assert config.served_model_name == REPO and config.tokenizer is None
        # the tokenizer may come from the hub too, at its own revision
        tokenizer = resolve_model_files(engine_config(str(repo_dir), tokenizer=REPO, tokenizer_revision=COMMIT))
        assert (tokenizer.model, tokenizer.tokenizer) == (str(repo_dir), str(hub_cache / SNAPSHOT))


def test_a_hub_id_that_cannot_be_had_is_one_line_naming_why(repo_dir, hub_cache, monkeypatch):
    with fake_hub({REPO: repo_dir}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        cases = [(dict(name="trio-llm-tests/absent"), "neither a local directory nor a repository"),
                 (dict(name=REPO, revision="v9"), "has no revision 'v9'")]
        for kwargs, said in cases:
            with pytest.raises(ModelLoadError) as failed:
                resolve(**kwargs)
            assert said in str(failed.value) and "\n" not in str(failed.value)
    # the hub unreachable and nothing cached: it says so rather than hang or trace back
    with pytest.raises(ModelLoadError, match="could not be reached|could not be downloaded"):
        resolve(REPO)
    assert resolve("/no/such/directory") == "/no/such/directory"  # a path is left for the loader to refuse


async def test_an_engine_on_a_hub_id_generates_what_it_does_on_the_directory(repo_dir, tiny_model_dir, hub_cache,
                                                                             monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    async with open_engine(engine_config(tiny_model_dir, enforce_eager=True)) as engine:
        want = (await final_output(engine, [5, 6, 7], params)).outputs[0].token_ids
    with fake_hub({REPO: repo_dir}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        async with open_engine(engine_config(REPO, enforce_eager=True)) as engine:
            assert engine.config.model == str(hub_cache / SNAPSHOT)
            assert (await final_output(engine, [5, 6, 7], params)).outputs[0].token_ids == want
