"""Llama / Qwen2 / Qwen3 decoder-only transformers, and their mixture-of-experts kin (Mixtral,
Qwen2-MoE, Qwen3-MoE), over the paged KV cache.

One module covers the families; they differ in where attention has biases
(Qwen2: q/k/v), in Qwen3's per-head RMSNorm of q and k, and in whether (and
in which layers) the MLP is an expert block (`engine.models.moe`). q/k/v and
gate/up projections are fused into one matmul each, filled at load time from
the checkpoint's separate tensors; so is each expert's gate/up pair.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any

import torch
from torch import nn

from engine.kv_groups import KVLayout
from engine.models.attention import (
    AttentionMetadata,
    DecodeMetadata,
    GraphedAttention,
    paged_attention,
    step_attention,
    write_kv,
)
from engine.models.hf_config import DecoderConfig
from engine.models.layers import DenseMLP, Linear, RMSNorm, RowParallelLinear, VocabParallelEmbedding
from engine.models.mla import MlaAttention
from engine.models.moe import ExpertLayout, FusedExperts, SparseMoeBlock
from engine.models.parallel import PipelineStage, TensorParallel
from engine.models.rope import RotaryEmbedding
from engine.models.weights import (
    CheckpointTensor,
    FileBlocks,
    T,
    as_float,
    as_floats,
    checked_copy,
    copied_blocks,
    load_named_weights,
    split_fused,
    split_stacked_experts,
)

KVCache = tuple[torch.Tensor, torch.Tensor]


class DecoderLayer(nn.Module):
    """One transformer block; under tensor parallelism it holds this rank's heads and
    intermediate features. Its MLP is dense, or an expert block in the MoE model's sparse layers."""

    def __init__(self, cfg: DecoderConfig, index: int, tp: TensorParallel, experts: ExpertLayout | None,
                 **factory: Any) -> None:
        super().__init__()
        self.index = index
        self.num_heads = tp.split(cfg.num_heads, "num_attention_heads")
        self.num_kv_heads = tp.split(cfg.num_kv_heads, "num_key_value_heads")
        self.head_dim = cfg.head_dim
        self.tp = tp
        self.self_attn: MlaAttention | None = None
        if cfg.mla is not None:  # DeepSeek's latent attention: its own projections, one latent "head" cached
            self.self_attn = MlaAttention(cfg, cfg.mla, tp, **factory)
            self.num_kv_heads = 1
        else:
            q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
            self.split = (q_size, kv_size, kv_size)
            self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias, **factory)
            self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, bias=cfg.o_bias, tp=tp, **factory)
        self.mlp: DenseMLP | SparseMoeBlock
        moe = cfg.moe
        if moe is not None and experts is not None and index in moe.sparse_layers:
            self.mlp = SparseMoeBlock(cfg.hidden_size, moe, experts, tp, **factory)
        else:
            intermediate = tp.split(cfg.intermediate_size, "intermediate_size")
            self.mlp = DenseMLP(cfg.hidden_size, intermediate, cfg.mlp_bias, tp, act=cfg.hidden_act, **factory)
        def norm(size: int) -> RMSNorm:
            return RMSNorm(size, cfg.rms_norm_eps, cfg.norm_weight_offset, **factory)

        self.input_layernorm = norm(cfg.hidden_size)
        # Llama's name for the norm before the MLP; Gemma's for the one after attention, which has
        # its own norms around the MLP (`sandwich_norms`)
        self.post_attention_layernorm = norm(cfg.hidden_size)
        self.sandwich_norms = cfg.sandwich_norms
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = norm(cfg.hidden_size)
            self.post_feedforward_layernorm = norm(cfg.hidden_size)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = norm(cfg.head_dim)
            self.k_norm = norm(cfg.head_dim)
        self.scale = cfg.attention_scale or cfg.head_dim ** -0.5
        self.sliding_window = cfg.window_of(index)
        # Its KV cache group (engine/kv_groups.py) and its cache pair on this rank: set by the model.
        self.kv_group = 0
        self.kv_index = index
        # gpt-oss: each head's learned logit in its softmax's denominator (attention.sink_attention)
        self.sinks = nn.Parameter(torch.empty(self.num_heads, **factory), requires_grad=False) \
            if cfg.attention_sinks else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                kv_cache: KVCache, meta: AttentionMetadata | DecodeMetadata | GraphedAttention) -> torch.Tensor:
        if self.sandwich_norms:
            x = x + self.post_attention_layernorm(self._attention(self.input_layernorm(x), positions, rope, kv_cache,
                                                                  meta))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        attention = self._attention if self.self_attn is None else self.self_attn
        x = x + attention(self.input_layernorm(x), positions, rope, kv_cache, meta)
        h = self.mlp(self.post_attention_layernorm(x))
        if isinstance(self.mlp, SparseMoeBlock):  # partial sums of this rank's experts
            h = self.tp.all_reduce(h)
        return x + h

    def _attention(self, h: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                   kv_cache: KVCache, meta: AttentionMetadata | DecodeMetadata | GraphedAttention) -> torch.Tensor:
        T = h.shape[0]
        q, k, v = self.qkv_proj(h).split(self.split, dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.rotate(positions, q, k)
        if isinstance(meta, GraphedAttention):  # a compiled step graph: attention is opaque to it
            out = step_attention(q, k, v, self.kv_index, self.kv_group, self.scale, self.sliding_window or 0,
                                 self.sinks)
            return self.o_proj(out.reshape(T, -1))
        meta = meta.of_group(self.kv_group)
        write_kv(kv_cache[0], kv_cache[1], meta.slot_mapping, k, v)
        if isinstance(meta, DecodeMetadata):  # a compiled decode graph or a captured CUDA graph
            out = meta.attend(q, kv_cache[0], kv_cache[1], self.scale, self.sliding_window, self.sinks)
        else:
            out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window,
                                  self.sinks)
        return self.o_proj(out.reshape(T, -1))


class DecoderForCausalLM(nn.Module):
    def __init__(self, cfg: DecoderConfig, dtype: torch.dtype, device: torch.device | str,
                 tp: TensorParallel = TensorParallel(), experts: ExpertLayout | None = None,
                 stage: PipelineStage = PipelineStage()) -> None:
        """`experts`: how this rank holds an MoE model's expert slots (default: every logical
        expert once, tensor-sharded like the dense MLP). `stage`: under pipeline parallelism,
        this rank holds its stage's layers only, the embedding on the first stage, the final
        norm and LM head on the last (and the embedding there too when the head is tied to it)."""
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.config = cfg
        self.dtype = dtype
        self.tp = tp
        self.stage = stage
        self.layer_range = stage.layer_range(cfg.num_layers, stage.partition)
        if cfg.moe is not None and experts is None:
            experts = ExpertLayout(cfg.moe.num_experts, cfg.moe.num_experts)
        self.expert_layout = experts
        keeps_embedding = stage.is_first or (stage.is_last and cfg.tie_word_embeddings)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, **factory) \
            if keeps_embedding else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, experts, **factory) for i in self.layer_range)
        # MLA's cache rows have no sliding kind: one group. Otherwise sliding and full layers (Gemma 3,
        # gpt-oss) get groups of their own, whose blocks behind the window are released.
        self.kv_layout = KVLayout.of([None if cfg.mla else cfg.window_of(i) for i in range(cfg.num_layers)])
        self.kv_indices = self.kv_layout.local_slots(self.layer_range)  # each layer's cache pair here
        for layer, i, kv_index in zip(self.layers, self.layer_range, self.kv_indices, strict=True):
            assert isinstance(layer, DecoderLayer)
            layer.kv_group, layer.kv_index = self.kv_layout.layer_group[i], kv_index
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset, **factory) \
            if stage.is_last else None
        vocab_rows = tp.split(cfg.vocab_size, "vocab_size")  # this rank's rows, as the embedding's
        self.lm_head = Linear(cfg.hidden_size, vocab_rows, bias=False, **factory) if stage.is_last else None
        self.rope: RotaryEmbedding | None = None
        self.rope_local: RotaryEmbedding | None = None  # the sliding layers' own (Gemma 3)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def setup_rope(self, max_positions: int) -> None:
        cfg = self.config
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, self.device,
                                    self.dtype, cfg.rotary_dim)
        if cfg.local_rope_theta is not None:
            self.rope_local = RotaryEmbedding(cfg.head_dim, max_positions, cfg.local_rope_theta, None, self.device,
                                              self.dtype)

    def _ropes(self) -> list[RotaryEmbedding]:
        """Each layer's rotary embedding: the sliding layers' own where they have one."""
        assert self.rope is not None, "setup_rope() must run before forward()"
        windows = [self.config.window_of(i) for i in self.layer_range]
        return [self.rope_local if self.rope_local is not None and window is not None else self.rope
                for window in windows]

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings and self.lm_head is not None:
            assert self.embed_tokens is not None
            self.lm_head.weight = self.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None, "only the first pipeline stage embeds tokens"
        rows = self.embed_tokens(input_ids)
        if self.config.embed_scale is not None:  # Gemma: the scale rounded to the model's dtype, as transformers does
            rows = rows * torch.tensor(self.config.embed_scale, dtype=rows.dtype)
        return rows

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata | DecodeMetadata | GraphedAttention) -> torch.Tensor:
        """hidden: input embeddings [T, H] of the flat batch -> final hidden states [T, H].
        With `DecodeMetadata` (one token per sequence) it is the decode graph `torch.compile`
        takes; with `GRAPHED`, the step graph's (attention read from `attention_step`)."""
        for layer, rope, kv_index in zip(self.layers, self._ropes(), self.kv_indices, strict=True):
            hidden = layer(hidden, positions, rope, kv_caches[kv_index], meta)
        # A pipeline stage before the last passes its layers' output on, unnormalised.
        return self.norm(hidden) if self.norm is not None else hidden

    @property
    def first_layer(self) -> DecoderLayer:
        layer = self.layers[0]
        assert isinstance(layer, DecoderLayer)
        return layer

    @property
    def moe_layers(self) -> list[FusedExperts]:
        """The expert slots of each sparse layer, in layer order (empty for a dense model)."""
        return [layer.mlp.experts for layer in self.layers if isinstance(layer.mlp, SparseMoeBlock)]

    def take_expert_load(self) -> torch.Tensor:
        """[MoE layers, physical experts]: tokens routed to each slot since the last call."""
        return torch.stack([experts.take_step_load() for experts in self.moe_layers]).cpu()

    @property
    def num_kv_caches(self) -> int:
        """The key and value cache pairs this rank holds: one per layer, or with several KV cache
        groups one per position in a group (`engine.kv_groups`)."""
        return max(self.kv_indices, default=-1) + 1

    @property
    def num_local_kv_heads(self) -> int:
        return self.first_layer.num_kv_heads

    def kv_cache_shapes(self, slots: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """Each layer's key and value cache shapes for `slots` token slots: [slots, kv heads, head
        size]; with MLA, the latents and the shared rotated key parts (`engine.models.mla`)."""
        mla = self.config.mla
        if mla is not None:
            return (slots, 1, mla.kv_lora_rank), (slots, 1, mla.qk_rope_head_dim)
        shape = (slots, self.num_local_kv_heads, self.config.head_dim)
        return shape, shape

    def pack_linears(self) -> None:
        """Lay every large linear weight out for oneDNN (engine/models/packed_linear.py): a decode
        step's matmuls then run near memory speed. Call once, when the weights are final."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(keep_weight=module is self.lm_head and self.config.tie_word_embeddings)

    def hold_tied_table_as_rows(self) -> None:
        """For steps on one compute thread (the worker calls this when it has one). A tied LM head
        keeps the embedding table beside its packed copy; hold that table as [hidden, vocab] rows
        instead (the embedding reads a strided view of them), so the head's product at one row runs
        on MKL's faster kernel (`Linear.transpose_for_one_row`) at no extra memory. Looking up a
        token then reads a column: with a cold cache +0.9 ms over a 512-token prompt of the
        32,000-row table, +0.08 ms for 16 tokens (docs/benchmarks.md); on more threads the packed
        head is as fast, so the table stays as it is. Call once, after `pack_linears`."""
        head, embed = self.lm_head, self.embed_tokens
        if head is None or embed is None or not self.config.tie_word_embeddings or head.weight is not embed.weight:
            return
        rows = head.transpose_for_one_row()
        if rows is not None:
            embed.weight = nn.Parameter(rows.t(), requires_grad=False)
            head.weight = embed.weight

    def quantize_linears(self, method: str | None, only: set[str] | None = None) -> None:
        """Quantization of every linear layer the kernel takes, the LM head included (`method`:
        "int8" weight-only, "w8a8", "int4", "q8_0" or "q4_0"; None: none), or of the layers named in
        `only` (a GGUF file's layers, one call per format). Call once the
        weights are final, before `pack_linears`. An MoE block's router stays in float, as vLLM keeps
        it: tiny, and an error there changes which experts run, not a logit's last digits."""
        if method is None:
            return
        if only is None:
            for module in self.modules():
                if isinstance(module, FusedExperts):
                    module.quantize(method)
        for _, linear in self._quantizable_linears(only):
            linear.quantize(method, keep_weight=linear is self.lm_head and self.config.tie_word_embeddings)

    def hold_file_blocks(self, method: str, only: set[str]) -> set[str]:
        """Before loading a GGUF file: the linear layers named in `only` (its layers of one block
        format) hold `method`'s storage ("q8_0", "q4_0", "q4_1", "q4_k"), which loading fills with
        the file's blocks as they are (`_copy_into`), not a float weight quantized again after.
        Returns the layers that do; the rest load as float."""
        tied = self.config.tie_word_embeddings
        return {name for name, linear in self._quantizable_linears(only)
                if linear.hold_file_blocks(method, keep_weight=linear is self.lm_head and tied)}

    def _quantizable_linears(self, only: set[str] | None) -> Iterator[tuple[str, Linear]]:
        """Every linear layer but routers (or those of them named in `only`), by name."""
        routers = {id(gate) for block in self.modules() if isinstance(block, SparseMoeBlock)
                   for gate in (block.gate, block.shared_expert_gate)}
        for name, module in self.named_modules():
            if isinstance(module, Linear) and id(module) not in routers and (only is None or name in only):
                yield name, module

    def linears_of(self, hf_names: set[str]) -> set[str]:
        """Our linear layers that hold the checkpoint weights `hf_names` (a fused layer is named once
        any of its parts is; a tied LM head by its embedding table, the weight it multiplies by)."""
        mapped = (self._map_name(name) for name in hf_names)
        names = {param.removesuffix(".weight") for param, _ in filter(None, mapped)}
        if self.config.tie_word_embeddings and self.lm_head is not None and "model.embed_tokens.weight" in hf_names:
            names.add("lm_head")
        return names

    @property
    def weight_bytes(self) -> int:
        """Bytes of this rank's weights as they are held: int8 rows and scales for quantized
        layers, the float weight's size for a packed one (its oneDNN copy replaced it)."""
        held = list(self.parameters()) + list(self.buffers())
        total = sum(t.numel() * t.element_size() for t in held if t.device.type != "meta")
        packed = [m.weight for m in self.modules() if isinstance(m, Linear) and m.packed is not None]
        return total + sum(w.numel() * w.element_size() for w in packed if w.device.type == "meta")

    @property
    def step_read_bytes(self) -> int:
        """Bytes a decode step reads at least: every weight but the embedding table (one row of it
        per token), which the LM head reads whole when it is tied and not quantized."""
        embed = self.embed_tokens.weight if self.embed_tokens is not None else None
        skip = 0 if embed is None else embed.numel() * embed.element_size()
        if self.lm_head is not None and self.config.tie_word_embeddings and self.lm_head.qweight is None:
            skip = 0
        return self.weight_bytes - skip

    @property
    def packed_linears(self) -> list[tuple[str, Linear]]:
        """The packed linear layers by name, in module order (the compiled graph's extra inputs)."""
        return [(name, m) for name, m in self.named_modules() if isinstance(m, Linear) and m.packed is not None]

    def compute_logits(self, hidden: torch.Tensor,
                       head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Full-vocabulary logits (gathered from every rank: a collective, so all ranks call it).
        `head`: the LM head's compiled graph, if it has one (engine/worker/decode_graphs.py)."""
        assert self.lm_head is not None, "only the last pipeline stage computes logits"
        logits = self.tp.all_gather_last_dim((head or self.lm_head)(hidden)).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    # ---- weight loading ---------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Copy HF-named checkpoint tensors into our (partly fused) parameters.

        A GGUF file's blocks (`Q8_0Blocks`, `Q4Blocks`) go as they are into the layers that hold them
        (`hold_file_blocks`); elsewhere they are dequantized. Raises `ModelLoadError` naming the
        tensor for a shape mismatch, an unexpected tensor, or parameters the checkpoint never provided.
        """
        params = dict(self.named_parameters())
        expected = {slot for name in params for slot in self._slots_of(name)}
        cfg = self.config
        if cfg.fused_checkpoint:  # safetensors checkpoints: no blocks
            weights = split_fused(as_floats(weights), cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
        if cfg.family == "gpt_oss":
            weights = split_stacked_experts(as_floats(weights))
        load_named_weights(params, weights, self._map_name, self._copy_into, expected, self.config.architecture)
        self.tie_weights()

    def _slots_of(self, name: str) -> list[tuple[str, int | None]]:
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            return []
        num_experts = self.config.moe.num_experts if self.config.moe else 0
        if name.endswith((".experts.w13", ".experts.w13_bias")):  # expert e's gate is slot 2e, its up 2e + 1
            return [(name, i) for i in range(2 * num_experts)]
        if name.endswith((".experts.w2", ".experts.w2_bias")):
            return [(name, e) for e in range(num_experts)]
        if ".qkv_proj." in name:
            return [(name, 0), (name, 1), (name, 2)]
        if ".gate_up_proj." in name:
            return [(name, 0), (name, 1)]
        return [(name, None)]

    # Fused parameters are filled from several checkpoint tensors: HF name -> (ours, slot).
    _FUSED = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    # One expert's tensors (Mixtral's w1/w3/w2, Qwen-MoE's gate/up/down) -> (ours, part)
    _EXPERT = {"w1": ("w13", 0), "gate_proj": ("w13", 0), "w3": ("w13", 1), "up_proj": ("w13", 1),
               "w2": ("w2", None), "down_proj": ("w2", None)}

    def _map_name(self, hf_name: str) -> tuple[str, int | None] | None:
        if "rotary_emb.inv_freq" in hf_name:
            return None
        if hf_name == "lm_head.weight" and (self.config.tie_word_embeddings or self.lm_head is None):
            return None
        name = hf_name.removeprefix("model.").replace("block_sparse_moe.", "mlp.")
        if self.config.mla is None:  # MLA keeps its own module (`self_attn`): its projections are not fused
            name = name.replace("self_attn.", "")
        # DeepSeek's router bias and ungated shared experts, where ours sit
        name = name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")
        staged = self._on_this_stage(name.replace(".mlp.shared_experts.", ".mlp.shared_expert."))
        if staged is None:
            return None
        name = staged
        parts = name.split(".")
        if len(parts) == 7 and parts[2:4] == ["mlp", "experts"] and parts[5] in self._EXPERT:
            ours, part = self._EXPERT[parts[5]]
            expert = int(parts[4])
            ours += "_bias" if parts[6] == "bias" else ""
            return ".".join([*parts[:4], ours]), expert if part is None else 2 * expert + part
        if len(parts) >= 3 and parts[-2] in self._FUSED and "self_attn" not in parts:
            fused, slot = self._FUSED[parts[-2]]
            return ".".join([*parts[:-2], fused, parts[-1]]), slot
        return name, None

    def _on_this_stage(self, name: str) -> str | None:
        """`name` with its layer renumbered to this stage's module list; None for a tensor another
        pipeline stage holds."""
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            if int(index) not in self.layer_range:
                return None
            return f"layers.{int(index) - self.layer_range.start}.{rest}"
        if (name.startswith("embed_tokens.") and self.embed_tokens is None) or \
                (name.startswith("norm.") and self.norm is None):
            return None
        return name

    def _copy_into(self, param: torch.Tensor, name: str, slot: int | None,
                   tensor: CheckpointTensor, hf_name: str) -> None:
        if isinstance(tensor, FileBlocks):
            self._copy_blocks(param, name, slot, tensor, hf_name)
            if param.device.type == "meta":  # only the blocks are held
                return
        if ".experts." in name and slot is not None:
            self._copy_expert(param, name, slot, as_float(tensor), hf_name)
            return
        checked_copy(self._slot_of(param, name, slot), self._sharded(name, tensor), hf_name)

    def _slot_of(self, tensor: torch.Tensor, name: str, slot: int | None) -> torch.Tensor:
        """The rows of a fused parameter's `tensor` (or of its quantized rows or scales) that `slot`
        fills; all of it for a parameter that is not fused."""
        if slot is None:
            return tensor.data
        sizes = self._slot_sizes(name, tensor)
        return tensor.data.narrow(0, sum(sizes[:slot]), sizes[slot])

    def _copy_blocks(self, param: torch.Tensor, name: str, slot: int | None, blocks: FileBlocks,
                     hf_name: str) -> None:
        """A file tensor's blocks into the layer that holds them as they are (`hold_file_blocks`):
        the parameter's own layer, or for a tied embedding table the LM head. None does: nothing."""
        tied_head = name == "embed_tokens.weight" and self.config.tie_word_embeddings
        layer = self.lm_head if tied_head else self.get_submodule(name.rsplit(".", 1)[0])
        if not (isinstance(layer, Linear) and layer.qmethod == blocks.method and name.endswith(".weight")):
            return
        assert layer.qweight is not None and layer.qscales is not None
        copied_blocks(self._slot_of(layer.qweight, name, slot), self._slot_of(layer.qscales, name, slot),
                      self._sharded(name, blocks), hf_name)

    def _copy_expert(self, param: torch.Tensor, name: str, slot: int, tensor: torch.Tensor, hf_name: str) -> None:
        """One logical expert's tensor into every local slot that holds a replica of it."""
        experts = self.get_submodule(name.rsplit(".", 1)[0])
        assert isinstance(experts, FusedExperts)
        sharded = experts.layout.ep_size == 1  # without expert parallelism each expert is tensor-sharded
        if name.endswith((".w13", ".w13_bias")):
            expert, part = divmod(slot, 2)
            half = param.shape[1] // 2
            tensor = self.tp.shard(tensor, 0) if sharded else tensor
            targets = [param.data[local].narrow(0, part * half, half) for local in experts.local_slots_of(expert)]
        else:  # the down projection; its bias is whole on every rank (`FusedExperts.add_down_bias`)
            tensor = self.tp.shard(tensor, 1) if sharded and name.endswith(".w2") else tensor
            targets = [param.data[local] for local in experts.local_slots_of(slot)]
        for target in targets:
            checked_copy(target, tensor, hf_name)

    def _slot_sizes(self, name: str, param: torch.Tensor) -> list[int]:
        if ".gate_up_proj." in name:
            return [param.shape[0] // 2] * 2
        return list(self.first_layer.split)

    _ROW_PARALLEL = (".o_proj.weight", ".down_proj.weight")
    _COLUMN_PARALLEL = (".qkv_proj.", ".gate_up_proj.", "embed_tokens.weight", "lm_head.weight", ".sinks",
                        ".q_b_proj.", ".kv_b_proj.", ".self_attn.q_proj.")  # MLA's heads split likewise

    def _sharded(self, name: str, tensor: T) -> T:
        """`_shard` of a tensor or of a file's blocks (their rows and blocks split as the features are)."""
        return tensor.map(partial(self._shard, name)) if isinstance(tensor, FileBlocks) else self._shard(name, tensor)

    def _shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full checkpoint tensor (the identity without tensor parallelism;
        routers and the shared expert's gate are replicated)."""
        if name.endswith(self._ROW_PARALLEL):
            return self.tp.shard(tensor, 1)
        if any(part in name for part in self._COLUMN_PARALLEL):
            return self.tp.shard(tensor, 0)
        return tensor
