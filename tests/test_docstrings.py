"""Every public async API of engine/ and web/ says in its docstring what cancellation does."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import engine
import web


def _public_async_callables():
    for package in (engine, web):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            module = importlib.import_module(info.name)
            for name, value in vars(module).items():
                if name.startswith("_") or getattr(value, "__module__", None) != module.__name__:
                    continue
                if inspect.iscoroutinefunction(value) or inspect.isasyncgenfunction(value):
                    yield f"{module.__name__}.{name}", value
                elif inspect.isclass(value):
                    for attr, member in vars(value).items():
                        public = not attr.startswith("_") or attr in ("__aenter__", "__aexit__")
                        if public and (inspect.iscoroutinefunction(member) or inspect.isasyncgenfunction(member)):
                            # getattr on the class: inspect.getdoc then finds an overridden base docstring
                            yield f"{module.__name__}.{name}.{attr}", getattr(value, attr)


def test_every_public_async_api_documents_cancellation():
    apis = dict(_public_async_callables())
    assert len(apis) > 40, sorted(apis)  # the walk found the engine's and the server's APIs
    silent = [name for name, api in apis.items() if "cancel" not in (inspect.getdoc(api) or "").lower()]
    assert not silent, "\n".join(sorted(silent))
