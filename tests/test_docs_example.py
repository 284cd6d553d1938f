"""The example in docs/testing.md runs as written (with a real model directory)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import trio.testing

DOC = Path(__file__).resolve().parent.parent / "docs" / "testing.md"


@pytest.fixture
def autojump_clock():
    return trio.testing.MockClock(autojump_threshold=0)


async def test_the_virtual_time_example_in_docs_testing_md_passes(tiny_model_dir, autojump_clock):
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), flags=re.S).group(1)
    namespace: dict = {}
    exec(compile(code.replace("path/to/model", tiny_model_dir), str(DOC), "exec"), namespace)
    await namespace["test_my_timeout_aborts_slow_generations"](autojump_clock)
