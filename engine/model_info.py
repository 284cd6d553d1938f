"""What the engine knows about its model once loaded: plain data, importable without torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolerConfig:
    pooling: str = "last"
    normalize: bool = True  # embeddings are L2-normalized unless a request says otherwise
    activation: bool = True  # classification logits become probabilities unless a request says otherwise
    matryoshka_dimensions: tuple[int, ...] | None = None  # None: `dimensions` is refused
    # A late-interaction (ColBERT) model: its outputs are per-token vectors, scored by MaxSim;
    # it has no single-vector embedding.
    late_interaction: bool = False

    def supports_dimensions(self, dimensions: int) -> bool:
        return bool(self.matryoshka_dimensions) and dimensions <= max(self.matryoshka_dimensions or (0,))


@dataclass(frozen=True)
class ModelInfo:
    """The model's facts, as the worker reports them when it loads the model; the engine
    fills in the two sizes it derives from them (`num_kv_blocks`, `max_model_len`) when it
    sizes the KV cache (`AsyncEngine.info` is that completed copy)."""

    vocab_size: int
    hidden_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    kv_bytes_per_block: int
    kind: str = "decoder"  # "decoder" (generation, or pooling as an embedder) or "encoder" (pooling only)
    architecture: str = ""
    pooler: PoolerConfig = PoolerConfig()
    num_labels: int = 0  # classification heads (cross-encoders)
    labels: tuple[str, ...] = ()  # their names (config.json's id2label), by index
    # Mixture-of-experts models (all 0 for dense ones): layers with experts, experts per layer as
    # the router sees them (logical) and as slots hold them (physical: logical + redundant), and
    # the ranks the slots are split over (1 without expert parallelism).
    num_moe_layers: int = 0
    num_logical_experts: int = 0
    num_physical_experts: int = 0
    num_expert_ranks: int = 1
    # Each KV cache group's attention window (None: full attention; engine/kv_groups.py). In a
    # sliding group the blocks behind the window are released while a request runs.
    kv_group_windows: tuple[int | None, ...] = (None,)
    # Vision-language models (LLaVA): the image placeholder token and the rows each image fills.
    image_token_id: int | None = None
    image_rows: int = 0
    quantization: str | None = None  # the linear layers' weight-only quantization ("int8"), if any
    # How q8_0 layers multiply a batch of decodes (--q8-0-activations): "int8"; "auto" where two int8
    # levels apply here (AVX-512 VNNI, a layer with tiles or of at most 512 features); else "float32".
    # None: no q8_0 layers.
    q8_0_activations: str | None = None
    weight_bytes: int = 0  # this rank's weights as held (quantized layers as int8 rows and scales)
    kv_cache_dtype: str = ""  # the KV cache's dtype (--kv-cache-dtype), where it has one
    # Set by the engine, not the worker:
    num_kv_blocks: int = 0
    max_model_len: int = 0
