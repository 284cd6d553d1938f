"""Hub ids: `trio-llm serve Qwen/Qwen2.5-0.5B-Instruct`, as `vllm serve` takes it.

A name that is a local path is used as it is. Anything else that is a valid Hugging Face repo id is
resolved with `huggingface_hub.snapshot_download`, as vLLM does: from the hub cache if the revision
is there, else downloaded into it (with huggingface_hub's progress bars). Only what serving reads
is fetched: configs, tokenizer files, chat templates and the safetensors weights; not the
`original/` or `consolidated` copies some repositories also carry.

The environment is read when a name is resolved, not when this module is imported, so a test or a
user that sets it late is heard: `HF_HUB_OFFLINE=1` (the cache only), `HF_HUB_CACHE` / `HF_HOME`
(where the cache is; `--download-dir` wins), `HF_ENDPOINT` and `HF_TOKEN`.

Resolving may download gigabytes: call it in a worker thread (`resolve_model_files` does).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from engine.config import EngineConfig
from engine.errors import ModelLoadError

ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
IGNORE_PATTERNS = ["original/*", "consolidated*.safetensors", "*/*"]  # top-level files only, as vLLM loads
_TRUE = {"1", "ON", "YES", "TRUE"}


def is_hub_id(name: str) -> bool:
    """Whether `name` is not a local path and could be a repo id ("org/name" or "name")."""
    if Path(name).expanduser().exists() or name.endswith(".gguf"):
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils._validators import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_cache_dir(download_dir: str | None = None) -> Path:
    """Where snapshots are kept: `--download-dir`, else HF_HUB_CACHE, else $HF_HOME/hub."""
    if download_dir:
        return Path(download_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE


def resolve(name: str, *, revision: str | None = None, download_dir: str | None = None,
            what: str = "model") -> str:
    """The local directory holding `name`: `name` itself unless it is a hub id, else its snapshot
    (downloaded if the cache lacks it). Blocks: run it in a worker thread. Failures are one
    `ModelLoadError` line naming the id and the cache."""
    if not is_hub_id(name):
        return name
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = hub_cache_dir(download_dir)
    at = f"{name}" + (f" at revision {revision}" if revision else "")
    try:
        return snapshot_download(name, revision=revision, cache_dir=cache, local_files_only=offline(),
                                 endpoint=os.environ.get("HF_ENDPOINT") or None, token=os.environ.get("HF_TOKEN"),
                                 allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS)
    except GatedRepoError:
        raise ModelLoadError(f"{what} {at} is gated on the Hugging Face hub: accept its terms and set HF_TOKEN") \
            from None
    except RepositoryNotFoundError:
        raise ModelLoadError(f"{what} {name!r} is neither a local directory nor a repository on the Hugging Face "
                             "hub (a private one needs HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"{what} {name} has no revision {revision!r} on the Hugging Face hub") from None
    except LocalEntryNotFoundError:
        if offline():
            raise ModelLoadError(f"{what} {at} is not in the Hugging Face cache {cache}, and HF_HUB_OFFLINE=1 "
                                 "forbids downloading it") from None
        raise ModelLoadError(f"{what} {at} is not in the Hugging Face cache {cache}, and the hub could not be "
                             "reached to download it") from None
    except (HfHubHTTPError, OSError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"{what} {at} could not be downloaded into {cache}: {first_line}") from None


def resolve_model_files(config: EngineConfig) -> EngineConfig:
    """`config` with its model and tokenizer as local directories (hub ids resolved, see
    `resolve`), and the hub id kept as the served model name, as vLLM reports it. A config
    naming local paths comes back unchanged. Blocks: run it in a worker thread."""
    model = resolve(config.model, revision=config.revision, download_dir=config.download_dir)
    tokenizer = config.tokenizer
    if tokenizer is not None:
        tokenizer = resolve(tokenizer, revision=config.tokenizer_revision, download_dir=config.download_dir,
                            what="tokenizer")
    elif model != config.model and config.tokenizer_revision not in (None, config.revision):
        tokenizer = resolve(config.model, revision=config.tokenizer_revision, download_dir=config.download_dir,
                            what="tokenizer")
    if model == config.model and tokenizer == config.tokenizer:
        return config
    return replace(config, model=model, tokenizer=tokenizer,
                   served_model_name=config.served_model_name or config.model)
