"""trio-llm's engine: a trio-native LLM inference engine with vLLM v1's architecture.

    from engine import open_engine, EngineConfig, SamplingParams

    async with open_engine(EngineConfig(model="path/to/model")) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=32)):
            print(out.outputs[0].text)

Names are imported lazily so that the plain-Python layers (the scheduler,
`engine.sched`) load without torch.
"""

from importlib import import_module

_EXPORTS = {
    "open_engine": "engine.api.open",
    "AsyncEngine": "engine.api.async_engine",
    "LLM": "engine.api.llm",
    "EngineConfig": "engine.config",
    "SamplingParams": "engine.sampling_params",
    "RequestOutputKind": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "Logprob": "engine.outputs",
    "PoolingRequestOutput": "engine.outputs",
    "PoolingParams": "engine.pooling_params",
    "InvalidRequestError": "engine.errors",
    "EngineDeadError": "engine.errors",
    "RequestFailedError": "engine.errors",
    "ModelLoadError": "engine.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
