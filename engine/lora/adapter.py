"""LoRA adapters as PEFT saves them: `adapter_config.json` beside `adapter_model.safetensors`
(or `adapter_model.bin`, read with `weights_only=True`, so a pickle cannot run code).

`read_adapter` reads and checks one against what the engine supports; `LoRAAdapter.check_against`
checks it against the base model's shapes. Both raise `LoRAError` with one line naming the
problem; neither touches a running engine. Blocking file I/O: run them off the event loop.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from engine.errors import LoRAError

__all__ = ["LoRAAdapter", "LoRAError", "LoRAFactors", "read_adapter"]

# PEFT's module names (Llama, Qwen2, Qwen3 and their kin): the attention and MLP projections.
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
REFUSED_TARGETS = {"embed_tokens": "embeddings", "lm_head": "the LM head"}
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<factor>[AB])(?:\.default)?\.weight$")


@dataclass
class LoRAFactors:
    """One target module's low-rank pair: delta(x) = (x @ a.T) @ b.T, the scaling folded into b."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]


@dataclass
class LoRAAdapter:
    name: str
    rank: int
    # HF module path (e.g. "model.layers.3.self_attn.q_proj") -> its factors
    modules: dict[str, LoRAFactors] = field(default_factory=dict)

    def check_against(self, expected_shapes: dict[str, tuple[int, int]]) -> None:
        """`expected_shapes`: HF module path -> (in_features, out_features) of the base model's
        projection. Every module the adapter changes must be one of them, with those shapes."""
        for module, factors in self.modules.items():
            if module not in expected_shapes:
                raise LoRAError(f"LoRA adapter {self.name!r}: the base model has no module {module!r}")
            fan_in, fan_out = expected_shapes[module]
            if tuple(factors.a.shape) != (self.rank, fan_in) or tuple(factors.b.shape) != (fan_out, self.rank):
                raise LoRAError(f"LoRA adapter {self.name!r}: {module} has lora_A {tuple(factors.a.shape)} and "
                                f"lora_B {tuple(factors.b.shape)}; the base model needs ({self.rank}, {fan_in}) "
                                f"and ({fan_out}, {self.rank})")


def read_adapter(name: str, path: str | Path, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """The adapter saved by PEFT in directory `path`, its factors in `dtype`."""
    directory = Path(path)
    config = _read_config(name, directory)
    rank = _checked_config(name, config, max_rank)
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAError(f"LoRA adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_weights(name, directory).items():
        match = _KEY.match(key)
        if match is None:
            raise LoRAError(f"LoRA adapter {name!r}: unexpected tensor {key!r} (only lora_A / lora_B weights are "
                            "supported)")
        pairs.setdefault(match["module"], {})[match["factor"]] = tensor
    adapter = LoRAAdapter(name, rank)
    for module, factors in pairs.items():
        if set(factors) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {name!r}: {module} has lora_{''.join(factors)} but not both A and B")
        target = module.rsplit(".", 1)[-1]
        _check_target(name, target)
        a, b = factors["A"], factors["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAError(f"LoRA adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B "
                            f"{tuple(b.shape)}, not rank {rank}")
        adapter.modules[module] = LoRAFactors(a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous())
    if not adapter.modules:
        raise LoRAError(f"LoRA adapter {name!r}: {directory} holds no lora_A / lora_B weights")
    return adapter


def _read_config(name: str, directory: Path) -> dict[str, Any]:
    path = directory / "adapter_config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise LoRAError(f"LoRA adapter {name!r}: no adapter_config.json in {directory}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"LoRA adapter {name!r}: {path} is not a JSON object")
    return config


def _checked_config(name: str, config: dict[str, Any], max_rank: int) -> int:
    """The rank, once every setting the engine does not serve has been refused."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {peft_type!r} is not supported (only LORA)")
    rank = config.get("r")
    if type(rank) is not int or rank < 1:
        raise LoRAError(f"LoRA adapter {name!r}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAError(f"LoRA adapter {name!r}: rank {rank} is above --max-lora-rank {max_rank}")
    refusals = {
        "modules_to_save": "modules_to_save (fully trained modules) is not supported",
        "use_dora": "DoRA (use_dora) is not supported",
        "rank_pattern": "per-module ranks (rank_pattern) are not supported",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
        "layers_to_transform": "layers_to_transform is not supported",
    }
    for key, why in refusals.items():
        if config.get(key):
            raise LoRAError(f"LoRA adapter {name!r}: {why}")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {name!r}: bias={config['bias']!r} is not supported (only 'none')")
    targets = config.get("target_modules") or []
    for target in [targets] if isinstance(targets, str) else targets:
        if isinstance(target, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", target):
            _check_target(name, target)
    return rank


def _check_target(name: str, target: str) -> None:
    if target in REFUSED_TARGETS:
        raise LoRAError(f"LoRA adapter {name!r}: LoRA on {REFUSED_TARGETS[target]} ({target}) is not supported")
    if target not in SUPPORTED_TARGETS:
        raise LoRAError(f"LoRA adapter {name!r}: target module {target!r} is not supported "
                        f"(supported: {', '.join(SUPPORTED_TARGETS)})")


def _read_weights(name: str, directory: Path) -> dict[str, torch.Tensor]:
    safetensors, pickled = directory / "adapter_model.safetensors", directory / "adapter_model.bin"
    try:
        if safetensors.exists():
            return load_file(str(safetensors))
        if pickled.exists():
            weights = torch.load(pickled, map_location="cpu", weights_only=True)
            if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
                raise LoRAError(f"LoRA adapter {name!r}: {pickled} is not a dict of tensors")
            return weights
    except LoRAError:
        raise
    except Exception as exc:  # noqa: BLE001 -- safetensors, torch.load and the OS each raise their own
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LoRAError(f"LoRA adapter {name!r}: cannot read its weights: {first_line}") from None
    raise LoRAError(f"LoRA adapter {name!r}: no adapter_model.safetensors or adapter_model.bin in {directory}")
