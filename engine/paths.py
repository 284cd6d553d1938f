"""Where trio-llm keeps what it makes on disk: one cache root for all of it.

`$XDG_CACHE_HOME/trio-llm` (by default `~/.cache/trio-llm`): the embedded default model
(`default-model-v1/`), the compiled decode graphs and inductor's caches (`torch_compile/`, unless
`--compilation-config '{"cache_dir": ...}'` or TORCHINDUCTOR_CACHE_DIR says otherwise), and the
benchmarks' models. Read when asked, so a test or a user that sets XDG_CACHE_HOME moves all of it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trio-llm"


def default_compile_cache() -> Path:
    return cache_root() / "torch_compile"
