"""`LoRARequest`: which LoRA adapter a request runs with (plain data: no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for one request, vLLM's names and order: `LoRARequest(name, id, path)`. The
    engine knows its adapters by name (`--lora-modules` / `lora_modules`)."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
    base_model_name: str | None = None
