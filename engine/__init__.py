"""trio-llm's engine: a trio-native LLM inference engine with vLLM v1's architecture.

    from engine import open_engine, EngineConfig, SamplingParams

    async with open_engine(EngineConfig(model="path/to/model")) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=32)):
            print(out.outputs[0].text)

The public names are those of `engine.api` (its `__init__` holds the one table), handed on here
on first use, so that the plain-Python layers (the scheduler, `engine.sched`) load without torch.
"""

from importlib import import_module
from typing import Any


def __getattr__(name: str) -> Any:
    api = import_module("engine.api")  # by name: the package root sits below the layers it re-exports
    if name == "__all__" or name in api.__all__:
        return getattr(api, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(import_module("engine.api").__all__)
