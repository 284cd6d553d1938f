"""How a model turns hidden states into pooled outputs, and the pooling itself.

The pooling config comes from sentence-transformers files when present
(`modules.json`, `1_Pooling/config.json`, a `Normalize` module); otherwise
BERT checkpoints pool the CLS token and decoders the last token, normalized.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.config import PoolerOptions
from engine.errors import ModelLoadError
from engine.model_info import PoolerConfig
from engine.models.hf_config import read_json_file
from engine.pooling_params import PoolingParams

POOLING_TYPES = ("mean", "cls", "last")


def read_pooler_config(model_dir: str | Path, raw_config: dict[str, Any], default_pooling: str,
                       options: PoolerOptions | None = None) -> PoolerConfig:
    """The model's pooling, with what `options` (--pooler-config) sets in its place: the pooling
    type, and `use_activation` as the default normalization (embed) and activation (classify)."""
    config = _read_pooler_config(Path(model_dir), raw_config, default_pooling)
    options = options or PoolerOptions()
    if options.pooling_type is not None:
        config = replace(config, pooling=options.pooling_type)
    if options.use_activation is not None:
        config = replace(config, normalize=options.use_activation, activation=options.use_activation)
    return config


def _read_pooler_config(model_dir: Path, raw_config: dict[str, Any], default_pooling: str) -> PoolerConfig:
    matryoshka = raw_config.get("matryoshka_dimensions")
    dims = tuple(int(d) for d in matryoshka) if matryoshka else None
    modules_path = model_dir / "modules.json"
    if not modules_path.is_file():
        return PoolerConfig(default_pooling, True, matryoshka_dimensions=dims)
    try:
        modules = read_json_file(modules_path)
        pooling_dir = next((m.get("path", "") for m in modules if m.get("type", "").endswith(".Pooling")), None)
        normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
        pooling = default_pooling
        if pooling_dir is not None:
            cfg = read_json_file(model_dir / pooling_dir / "config.json", missing="modules.json names it")
            pooling = _pooling_mode(cfg)
    except (AttributeError, TypeError) as exc:  # JSON of the wrong shape
        raise ModelLoadError(f"{model_dir}: unreadable sentence-transformers pooling config: {exc}") from exc
    return PoolerConfig(pooling, normalize, matryoshka_dimensions=dims)


def _pooling_mode(cfg: dict[str, Any]) -> str:
    if cfg.get("pooling_mode_mean_tokens"):
        return "mean"
    if cfg.get("pooling_mode_cls_token"):
        return "cls"
    if cfg.get("pooling_mode_lasttoken"):
        return "last"
    raise ModelLoadError(f"unsupported pooling mode in 1_Pooling/config.json: {cfg}")


def pool(hidden: torch.Tensor, pooling: str) -> torch.Tensor:
    """hidden: one sequence's states [T, H] -> [H]."""
    if pooling == "mean":
        return hidden.float().mean(dim=0)
    if pooling == "cls":
        return hidden[0].float()
    return hidden[-1].float()


def pool_batch(hidden: torch.Tensor, lengths: torch.Tensor, pooling: str) -> torch.Tensor:
    """A padded batch's states [B, L, H] with real lengths [B] -> [B, H], as `pool` per row."""
    if pooling == "cls":
        return hidden[:, 0].float()
    if pooling == "last":
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1].float()
    mask = (torch.arange(hidden.shape[1], device=hidden.device)[None, :] < lengths[:, None]).unsqueeze(-1)
    return (hidden.float() * mask).sum(dim=1) / lengths[:, None].float()


def finish(vectors: torch.Tensor, params: PoolingParams, config: PoolerConfig) -> torch.Tensor:
    """Truncate to `dimensions` (Matryoshka) and normalize as asked: [..., H] float32."""
    vectors = vectors.float()
    if params.dimensions is not None:
        vectors = vectors[..., :params.dimensions]
    normalize = config.normalize if params.normalize is None else params.normalize
    return F.normalize(vectors, dim=-1) if normalize else vectors
