"""Serving LoRA adapters (PEFT format) from one base model."""

from engine.lora.adapter import LoRAError
from engine.lora_request import LoRARequest

__all__ = ["LoRAError", "LoRARequest"]
