"""`LoRARequest`: which LoRA adapter a request runs with, and `LoRARegistry`: the adapters an
engine serves by name (plain data: no torch)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Protocol

from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for one request, vLLM's names and order: `LoRARequest(name, id, path)`. The
    engine knows its adapters by name: those configured (`lora_modules`), and those loaded since
    (`AsyncEngine.add_lora`, or the first request that names a new adapter with its path)."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
    base_model_name: str | None = None


def check_names_given(lora_request: LoRARequest) -> None:
    """`InvalidRequestError` (vLLM's wording) unless the request names both the adapter and its path."""
    if not lora_request.lora_name or not lora_request.lora_path:
        raise InvalidRequestError("Both 'lora_name' and 'lora_path' must be provided.")


class _Module(Protocol):  # engine.config.LoRAModule
    @property
    def name(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def base_model_name(self) -> str | None: ...


class LoRARegistry:
    """The adapters an engine serves, by name (what a request's `model` names), in the order
    they were added; ids are vLLM's `lora_int_id`s, given from 1 when a request brings none.
    A name being unloaded is no longer served, and cannot be loaded again until it is gone."""

    def __init__(self, configured: Iterable[LoRARequest] = ()) -> None:
        self._served: dict[str, LoRARequest] = {}
        self.unloading: set[str] = set()
        self._last_id = 0
        for request in configured:
            self.add(request)

    def __contains__(self, name: object) -> bool:
        return name in self._served

    def __iter__(self) -> Iterator[LoRARequest]:
        return iter(list(self._served.values()))

    def names(self) -> list[str]:
        return list(self._served)

    def get(self, name: str) -> LoRARequest | None:
        return self._served.get(name)

    def add(self, request: LoRARequest) -> LoRARequest:
        """Serve `request` (replacing one of its name); returns it with its id."""
        if request.lora_int_id <= 0:
            request = replace(request, lora_int_id=self._last_id + 1)
        self._last_id = max(self._last_id, request.lora_int_id)
        self._served[request.lora_name] = request
        return request

    def start_unloading(self, name: str) -> LoRARequest:
        """Stop serving `name` (KeyError if it is not served); it stays reserved until `unloaded`."""
        request = self._served.pop(name)
        self.unloading.add(name)
        return request

    def unloaded(self, name: str) -> None:
        self.unloading.discard(name)


def configured_adapters(modules: Iterable[_Module]) -> LoRARegistry:
    """The registry an engine starts with: its `lora_modules`, ids 1, 2, ... in their order."""
    return LoRARegistry(LoRARequest(m.name, 0, m.path, m.base_model_name) for m in modules)
