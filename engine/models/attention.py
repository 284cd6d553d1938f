"""Attention over the paged KV cache, in plain torch (CPU and CUDA), and our own CPU kernels.

The KV cache of one layer is two tensors of shape [num_blocks * block_size,
num_kv_heads, head_dim]: slot `b * block_size + i` holds position i of block
b. Each step writes the new tokens' keys and values to their slots, then each
sequence attends over the slots its block table names.

The flat batch is split into groups so padding stays small: one group of
decodes (one query token per sequence, no query padding) and one of prefill
chunks (queries padded to the longest chunk). Per group the keys and values
are gathered whole blocks at a time (`index_select` over the block table:
one contiguous copy per block rather than one per position, 16x fewer index
operations, measured as the difference between 48 and 8 ms per decode step of
64 sequences) into a padded [B, L, H, D] batch and handed to
`scaled_dot_product_attention` with a causal mask built from positions.

Our C kernels (engine/kernels) take these instead where they apply: in float32 a fresh prompt
alone at any thread count (`causal_prompt_attention`) and, on one compute thread, prompt chunks
one sequence at a time (`prompt_chunks_by_kernel`), each query against its own positions only,
cached ones read through their slots; and the decodes in place, from a float32 or 16-bit cache,
on torch's threads (`decodes_by_kernel`). Where a kernel declines (a dtype or head size it does
not take, a sliding window, no C compiler here) the torch path above runs.

The compiled decode path (`engine.worker.decode_graphs`) calls the same decode kernel as the
graph's operator `trio_llm::paged_decode` on CPU (`DecodeMetadata.attend`), and elsewhere
`paged_decode_attention`: written as plain reductions over the block table, which inductor
turns into kernels that read each key and value straight from its cache slot, so the gather is
never materialised (in eager mode the same code would build [B, L, H, G, D] products: it is
for compiled graphs only).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from engine.kernels import paged_decode as decode_kernel
from engine.kernels.causal_attention import causal_attention
from engine.kernels.operators import operator


@dataclass
class AttentionGroup:
    token_start: int  # the group is tokens [token_start, token_end) of the flat batch
    token_end: int
    q_index: torch.Tensor | None  # [B, Lq] into the group's tokens; None when every sequence has one query
    q_valid: torch.Tensor | None  # [B, Lq] which padded query rows are real
    block_table: torch.Tensor | None  # [B * nb] block ids per sequence, flattened, 0-padded; None: fresh
    # A group whose chunks all start at position 0 attends only to its own new keys and values,
    # so they are taken from the step's k/v by q_index instead of gathered back from the cache.
    num_seqs: int
    # [B, 1, Lq, nb * block_size] additive: 0 where attention is allowed, -inf elsewhere; None for
    # one fresh sequence, which attends causally to its own tokens (SDPA's `is_causal`, which
    # skips the masked half: 27 against 49 ms at 2,048 tokens, one thread, 4 heads)
    mask: torch.Tensor | None
    # The group's sequences, for the per-sequence kernel (`prompt_chunks_by_kernel`), and the
    # KV-cache rows of each one's positions, filled by its first layer for the others.
    chunks: Sequence[SequenceChunk] = ()
    kernel_rows: list[torch.Tensor | None] | None = None
    seq_lens: torch.Tensor | None = None  # [B] of a group of decodes, for the decode kernel (filled likewise)
    # The sliding window cuts into some sequence's keys: the mask says which, and our kernels
    # (which attend to every position before a query) decline the group.
    windowed: bool = False


@dataclass
class AttentionMetadata:
    """A step's attention layout. Its groups depend on the attention window, which is the layer's
    (Gemma 3 and gpt-oss alternate sliding and full layers): built per window when a layer first
    asks (`groups_for`), then shared by the layers with that window."""

    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    block_size: int
    chunks: Sequence[SequenceChunk]
    device: torch.device
    dtype: torch.dtype
    _groups: dict[int | None, list[AttentionGroup]] = field(default_factory=dict)
    # KV cache groups 1.. of a hybrid layout (engine/kv_groups.py): the same step over their block
    # tables. This metadata is group 0's; with none, it serves every layer (one group, or a profile
    # run whose every token writes one scratch block).
    other_kv_groups: Sequence[AttentionMetadata] = ()
    # Per window, the groups first built by any KV cache group of the step: their masks and query
    # indices depend on positions only, so the other KV cache groups take them with their own tables.
    _built: dict[int | None, list[AttentionGroup]] = field(default_factory=dict)

    def of_group(self, kv_group: int) -> AttentionMetadata:
        """The step over KV cache group `kv_group`'s block tables."""
        return self.other_kv_groups[kv_group - 1] if kv_group and self.other_kv_groups else self

    def groups_for(self, sliding_window: int | None) -> list[AttentionGroup]:
        """The step's groups with each query attending to every position before it (None) or to
        itself and the `sliding_window - 1` positions before it."""
        groups = self._groups.get(sliding_window)
        if groups is None:
            built = self._built.get(sliding_window)
            if built is None:
                groups = self._built[sliding_window] = _groups(self.chunks, self.block_size, self.device, self.dtype,
                                                               sliding_window)
            else:
                groups = _over_tables(built, self.chunks, self.block_size, self.device)
            self._groups[sliding_window] = groups
        return groups

    @property
    def groups(self) -> list[AttentionGroup]:
        """The groups of full attention."""
        return self.groups_for(None)


# One KV cache group's part of a decode batch: each sequence's new-token slot and its block table.
GroupTables = tuple[Sequence[int], Sequence[Sequence[int]]]


@dataclass
class DecodeMetadata:
    """A batch of decodes (one new token per sequence), in the fixed shapes a compiled graph
    takes: rows past the real ones are padding whose slot and blocks are a scratch block."""

    # With several KV cache groups (engine/kv_groups.py) these two have a leading group dimension.
    slot_mapping: torch.Tensor  # [B] cache slot of each new token
    block_table: torch.Tensor  # [B, nb] block ids per sequence, padded with the scratch block
    seq_lens: torch.Tensor  # [B] tokens each sequence attends to (its cached ones plus the new one)
    block_size: int

    def of_group(self, kv_group: int) -> DecodeMetadata:
        """The batch over KV cache group `kv_group`'s block tables."""
        if self.slot_mapping.dim() == 1:
            return self
        return type(self)(self.slot_mapping[kv_group], self.block_table[kv_group], self.seq_lens, self.block_size)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
               sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """The batch's attention: on CPU our decode kernel as the graph's operator
        (`trio_llm::paged_decode`, engine/kernels/paged_decode.c), which reads each cached row in
        place, once for every query head of its KV head; where it does not apply (a window, sinks,
        another device, a head size it does not take) reductions written for inductor
        (`paged_decode_attention`). `sliding_window`: the layer's (a constant of the graph), or
        None; `sinks`: its heads' sink logits (gpt-oss), or None."""
        if sliding_window is None and sinks is None and decode_kernel.takes(q, k_cache, v_cache):
            blocks = (-1, self.block_size, *k_cache.shape[1:])
            out = decode_kernel.graph_decode((q.float() * scale).contiguous(), k_cache.view(blocks),
                                             v_cache.view(blocks), self.block_table, self.seq_lens)
            return out.to(q.dtype)
        return paged_decode_attention(q, k_cache, v_cache, self, scale, sliding_window, sinks)


@dataclass
class GatheredDecodeMetadata(DecodeMetadata):
    """A batch of decodes for a captured CUDA graph (`engine.worker.cuda_graphs`): attention is one
    SDPA call over the keys and values the block table gathers (`gathered_decode_attention`),
    which runs eagerly on any device and launches the same kernels at every replay."""

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
               sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        return gathered_decode_attention(q, k_cache, v_cache, self, scale, sliding_window, sinks)


@dataclass(frozen=True)
class GraphedAttention:
    """The metadata a compiled step graph sees (`engine.worker.step_graph`): none. Its layers call
    `step_attention`, an opaque op that finds the step's `AttentionMetadata` and the KV caches where
    `attention_step` put them, so one graph with a dynamic token count serves every mix of prompt
    chunks and decodes (vLLM's piecewise graph keeps attention out of the graph the same way)."""


GRAPHED = GraphedAttention()


@dataclass
class _Step:
    meta: AttentionMetadata
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]


# The step a compiled graph is running. A context variable: per thread (and task), so engines
# stepping in different threads of one process never see each other's step.
_current: contextvars.ContextVar[_Step] = contextvars.ContextVar("trio_llm_attention_step")


@contextlib.contextmanager
def attention_step(meta: AttentionMetadata, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """Make `meta` and `kv_caches` the ones `step_attention` uses while a compiled graph runs."""
    token = _current.set(_Step(meta, kv_caches))
    try:
        yield
    finally:
        _current.reset(token)


@operator("trio_llm::step_attention")
def step_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_index: int, kv_group: int, scale: float,
                   sliding_window: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A layer's attention for the step `attention_step` set: writes this step's keys and values
    to the layer's cache (pair `kv_index`, in KV cache group `kv_group`), then attends
    (`paged_attention`; `sliding_window` 0: none). The cache is state outside the graph, which is
    why the graph never sees it."""
    step = _current.get()
    k_cache, v_cache = step.kv_caches[kv_index]
    meta = step.meta.of_group(kv_group)
    write_kv(k_cache, v_cache, meta.slot_mapping, k, v)
    return paged_attention(q, k, v, k_cache, v_cache, meta, scale, sliding_window or None, sinks).contiguous()


@step_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_index: int, kv_group: int, scale: float,
      sliding_window: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    return q.new_empty(q.shape)


@dataclass(frozen=True)
class SequenceChunk:
    """One sequence's part of a step, as attention needs it."""

    start_position: int
    num_tokens: int
    block_ids: Sequence[int]


def build_metadata(chunks: Sequence[SequenceChunk], block_size: int, device: torch.device,
                   dtype: torch.dtype = torch.float32,
                   other_kv_groups: Sequence[Sequence[SequenceChunk]] = ()) -> AttentionMetadata:
    """Metadata for a flat batch whose sequences are laid out in `chunks` order, decodes first.
    `other_kv_groups`: the same chunks over the block tables of KV cache groups 1.., if any.

    `dtype` is the model's: the mask is additive in that dtype, which CPU SDPA
    runs about twice as fast as a boolean mask."""
    if other_kv_groups:
        first = build_metadata(chunks, block_size, device, dtype)
        others = [replace(build_metadata(group, block_size, device, dtype), _built=first._built)
                  for group in other_kv_groups]
        return replace(first, other_kv_groups=others)
    slots: list[int] = []
    for c in chunks:
        for pos in range(c.start_position, c.start_position + c.num_tokens):
            slots.append(c.block_ids[pos // block_size] * block_size + pos % block_size)
    return AttentionMetadata(_on(device, torch.tensor(slots, dtype=torch.long)), block_size, chunks, device, dtype)


def _groups(chunks: Sequence[SequenceChunk], block_size: int, device: torch.device, dtype: torch.dtype,
            sliding_window: int | None) -> list[AttentionGroup]:
    """One group of decodes (the first chunks) and one of prompt chunks (the rest), if any."""
    num_decodes = 0
    while num_decodes < len(chunks) and chunks[num_decodes].num_tokens == 1:
        num_decodes += 1
    groups = []
    if num_decodes:
        groups.append(_group(chunks[:num_decodes], 0, block_size, device, dtype, True, sliding_window))
    if num_decodes < len(chunks):
        groups.append(_group(chunks[num_decodes:], num_decodes, block_size, device, dtype, False, sliding_window))
    return groups


def _group(chunks: Sequence[SequenceChunk], token_start: int, block_size: int, device: torch.device,
           dtype: torch.dtype, single_query: bool, sliding_window: int | None) -> AttentionGroup:
    max_len = max(c.start_position + c.num_tokens for c in chunks)
    fresh = not single_query and all(c.start_position == 0 for c in chunks)
    windowed = sliding_window is not None and max_len > sliding_window
    if fresh and len(chunks) == 1 and not windowed:
        return AttentionGroup(token_start, token_start + chunks[0].num_tokens, None, None, None, 1, None, chunks)
    block_table = None
    if fresh:
        pos = torch.arange(max_len)
    else:
        block_table = _block_table(chunks, block_size, device)
        pos = torch.arange(block_table.shape[0] // len(chunks) * block_size)
    max_q = max(c.num_tokens for c in chunks)
    q_offsets = torch.arange(max_q)
    counts = torch.tensor([c.num_tokens for c in chunks])
    starts = torch.tensor([c.start_position for c in chunks])
    q_valid = q_offsets[None, :] < counts[:, None]
    q_pos = torch.where(q_valid, starts[:, None] + q_offsets[None, :], 0)  # padded rows see position 0 only
    allowed = pos[None, None, :] <= q_pos[:, :, None]
    if windowed and sliding_window is not None:
        allowed &= pos[None, None, :] > q_pos[:, :, None] - sliding_window
    allowed = allowed.unsqueeze(1)
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    token_end = token_start + int(counts.sum())
    q_index = None
    if not single_query:
        first = torch.cumsum(counts, 0) - counts
        q_index = _on(device, torch.where(q_valid, first[:, None] + q_offsets[None, :], 0))
        q_valid = _on(device, q_valid)
    return AttentionGroup(token_start, token_end, q_index, None if single_query else q_valid,
                          block_table, len(chunks), _on(device, mask), chunks, windowed=windowed)


def _block_table(chunks: Sequence[SequenceChunk], block_size: int, device: torch.device) -> torch.Tensor:
    """[B * nb]: each chunk's blocks up to the longest one's end, 0-padded, flattened."""
    num_table_blocks = -(-max(c.start_position + c.num_tokens for c in chunks) // block_size)
    tables = torch.tensor([_padded(c.block_ids, num_table_blocks) for c in chunks], dtype=torch.long)
    return _on(device, tables.view(-1))


def _over_tables(built: list[AttentionGroup], chunks: Sequence[SequenceChunk], block_size: int,
                 device: torch.device) -> list[AttentionGroup]:
    """`built`'s groups (another KV cache group's, the same step) over `chunks`' block tables."""
    groups, first = [], 0
    for group in built:
        own = chunks[first:first + group.num_seqs]
        first += group.num_seqs
        table = None if group.block_table is None else _block_table(own, block_size, device)
        groups.append(replace(group, block_table=table, chunks=own, kernel_rows=None, seq_lens=None))
    return groups


def _on(device: torch.device, tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor of the step's metadata on `device`, without the host waiting: on CUDA through
    pinned memory, since a copy from pageable memory returns only once the stream has run every
    kernel queued before it (each prompt step's metadata would drain the queue)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _padded(block_ids: Sequence[int], length: int) -> list[int]:
    ids = list(block_ids[:length])
    return ids + [0] * (length - len(ids))


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """This step's keys and values into their slots, rounded to the cache's dtype where that is
    narrower than the model's (--kv-cache-dtype)."""
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_blocks(cache: torch.Tensor, group: AttentionGroup, block_size: int,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """[slots, H, D] cache -> [B, H, nb * block_size, D]: each sequence's blocks, in table order,
    in `dtype` (the queries'; None: the cache's)."""
    _, heads, dim = cache.shape
    assert group.block_table is not None
    # On a 2-D view each block is one row: index_select copies rows ~3x faster than 4-D blocks.
    blocks = cache.view(-1, block_size * heads * dim).index_select(0, group.block_table)
    return blocks.to(dtype or cache.dtype).view(group.num_seqs, -1, heads, dim).transpose(1, 2)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D], each token attending to its sequence's cached positions (the
    last `sliding_window` of them, with a window).

    k, v: [T, Hkv, D], this step's keys and values (already written to the cache). `sinks` [Hq]:
    each head's sink logit (gpt-oss; `sink_attention`), or None."""
    outputs = []
    for g in meta.groups_for(sliding_window):
        window = slice(g.token_start, g.token_end)
        q_group, k_group, v_group = q[window], k[window], v[window]
        if sinks is not None:  # neither SDPA nor our kernels take a sink
            outputs.append(masked_group_attention(q_group, k_group, v_group, k_cache, v_cache, g, meta.block_size,
                                                  scale, sinks))
            continue
        if g.mask is None:  # one fresh sequence: causal over its own tokens
            outputs.append(causal_prompt_attention(q_group, k_group, v_group, scale))
            continue
        if not g.windowed and (g.q_index is None or torch.get_num_threads() == 1):
            # our kernels: decodes on torch's threads, prompt chunks on one thread
            if g.q_index is None:
                by_kernel = decodes_by_kernel(q_group, k_cache, v_cache, g, meta.block_size, scale)
            else:
                by_kernel = prompt_chunks_by_kernel(q_group, k_group, v_group, k_cache, v_cache, g, meta.block_size,
                                                    scale)
            if by_kernel is not None:
                outputs.append(by_kernel)
                continue
        outputs.append(masked_group_attention(q_group, k_group, v_group, k_cache, v_cache, g, meta.block_size, scale))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def masked_group_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, group: AttentionGroup, block_size: int,
                           scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A group's sequences in one SDPA call (`sink_attention` with `sinks`): queries padded to the
    longest, keys taken from this step's rows (all fresh) or gathered from the cache, the group's
    additive mask over both."""
    if group.mask is None:  # one fresh sequence, unmasked elsewhere: its causal mask, for the sinks
        assert sinks is not None
        tokens = q.shape[0]
        causal = torch.zeros(tokens, tokens, dtype=q.dtype, device=q.device).masked_fill_(
            torch.ones(tokens, tokens, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        q_seq, k_seq, v_seq = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        return sink_attention(q_seq, k_seq, v_seq, causal, scale, sinks)[0].transpose(0, 1)
    q_batch = q.unsqueeze(1) if group.q_index is None else q[group.q_index]
    if group.block_table is None:
        k_batch = k[group.q_index].transpose(1, 2)
        v_batch = v[group.q_index].transpose(1, 2)
    else:
        k_batch = gather_blocks(k_cache, group, block_size, q.dtype)
        v_batch = gather_blocks(v_cache, group, block_size, q.dtype)
    if sinks is None:
        out = F.scaled_dot_product_attention(q_batch.transpose(1, 2), k_batch, v_batch,
                                             attn_mask=group.mask, scale=scale, enable_gqa=True)
    else:
        out = sink_attention(q_batch.transpose(1, 2), k_batch, v_batch, group.mask, scale, sinks)
    out = out.transpose(1, 2)  # [B, Lq, Hq, D]
    return out.squeeze(1) if group.q_index is None else out[group.q_valid]


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                   sinks: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, Lq, D], k and v [B, Hkv, L, D], `mask` additive, broadcast to [B, Hq, Lq, L] ->
    [B, Hq, Lq, D]: attention with each head's sink logit `sinks` [Hq] in the softmax's denominator
    (gpt-oss's attention sinks): the sink takes its share of the weight and contributes no value.

    The share the keys keep is sigmoid(lse - sink), lse being the log of the keys' own softmax
    denominator; on CPU torch's flash kernel returns it beside its output, so the sink costs a
    scaling of that output (8.6x faster than writing the softmax out, and no [Lq, L] scores held:
    bfloat16, 64 query and 8 KV heads, 512 queries over 2,048 keys, 77 against 665 ms on two
    threads). Elsewhere the softmax is written out, scores in float32, as transformers computes it,
    `SINK_QUERY_BLOCK` queries at a time."""
    num_heads, queries = q.shape[1], q.shape[2]
    group = num_heads // k.shape[1]  # query heads per KV head, each KV head's together
    if q.device.type == "cpu" and _FLASH_WITH_LSE is not None:
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out, lse = _FLASH_WITH_LSE(q, k, v, 0.0, False, attn_mask=mask.to(q.dtype), scale=scale)
        kept = torch.sigmoid(lse - sinks.float().view(1, num_heads, 1)).unsqueeze(-1)
        return (out.float() * kept).to(q.dtype)
    if queries <= SINK_QUERY_BLOCK:
        return _written_out_sink_attention(q, k, v, mask, scale, sinks)
    return torch.cat([_written_out_sink_attention(q[:, :, start:start + SINK_QUERY_BLOCK], k, v,
                                                  mask if mask.shape[-2] == 1 else
                                                  mask[..., start:start + SINK_QUERY_BLOCK, :], scale, sinks)
                      for start in range(0, queries, SINK_QUERY_BLOCK)], dim=2)


# Queries whose softmax is written out at once (`sink_attention` off the CPU): bounds the float32
# scores held to heads x this x keys (64 heads over 8,192 keys: 1 GiB, where a whole 8,192-token
# prompt at once would hold 16).
SINK_QUERY_BLOCK = 512


def _written_out_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                                sinks: torch.Tensor) -> torch.Tensor:
    """`sink_attention` as transformers computes it: scores in float32, the sink concatenated, the
    softmax, the sink's column dropped."""
    batch, num_heads, queries, dim = q.shape
    num_kv_heads, length = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads  # query heads per KV head, each KV head's together
    q_grouped = q.reshape(batch, num_kv_heads, group * queries, dim)
    scores = (q_grouped @ k.transpose(-1, -2)).float().view(batch, num_heads, queries, length) * scale + mask
    sink = sinks.float().view(1, num_heads, 1, 1).expand(batch, num_heads, queries, 1)
    weights = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :length]
    out = weights.to(v.dtype).view(batch, num_kv_heads, group * queries, length) @ v
    return out.view(batch, num_heads, queries, dim)


# torch's CPU flash attention with its log-sum-exp (an aten op, not public API): None where this
# torch lacks it, and the sinks are then written out.
_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def prompt_chunks_by_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, group: AttentionGroup, block_size: int,
                             scale: float) -> torch.Tensor | None:
    """A group of prompt chunks one sequence at a time on our kernel (`causal_attention`), instead of
    one padded, masked SDPA call: a fresh chunk over its own rows of this step, a chunk after cached
    positions over the cache's slots. None if the kernel declines them (it declines every chunk
    of a group alike: its dtype and head size), so that only the first call was made."""
    if group.kernel_rows is None:
        group.kernel_rows = [None if c.start_position == 0 else _cache_rows(c, block_size) for c in group.chunks]
    outputs = []
    offset = 0
    for chunk, rows in zip(group.chunks, group.kernel_rows, strict=True):
        mine = slice(offset, offset + chunk.num_tokens)
        offset += chunk.num_tokens
        if rows is None:
            out = causal_attention(q[mine], k[mine], v[mine], scale)
        else:
            out = causal_attention(q[mine], k_cache, v_cache, scale, past=chunk.start_position, kv_rows=rows)
        if out is None:
            return None
        outputs.append(out)
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def decodes_by_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: AttentionGroup,
                      block_size: int, scale: float) -> torch.Tensor | None:
    """A group of decodes (one query per sequence) on our decode kernel (engine/kernels/paged_decode.c,
    on torch's threads), each over its cached positions through its block table, instead of one
    masked SDPA call over gathered blocks. None if the kernel declines them."""
    assert group.block_table is not None, "decodes read the cache"
    if torch.compiler.is_compiling() or q.device.type != "cpu":  # a graph being traced has no data to point at
        return None
    if group.seq_lens is None:
        group.seq_lens = torch.tensor([c.start_position + 1 for c in group.chunks], dtype=torch.long)
    out = decode_kernel.decode_attention(q, k_cache, v_cache, group.block_table.view(group.num_seqs, -1),
                                         group.seq_lens, block_size, scale, torch.get_num_threads())
    return None if out is None else out.to(q.dtype)


def _cache_rows(chunk: SequenceChunk, block_size: int) -> torch.Tensor:
    """The KV-cache slot of each of the chunk's sequence's positions up to its last new one."""
    end = chunk.start_position + chunk.num_tokens
    blocks = torch.tensor(chunk.block_ids[:-(-end // block_size)], dtype=torch.long)
    return (blocks[:, None] * block_size + torch.arange(block_size)).view(-1)[:end].contiguous()


# A prompt of up to this many tokens, on one compute thread, that our own kernel does not take
# (bfloat16; or no C compiler here) is attended in blocks of queries (`causal_prompt_attention`);
# measured on this machine's CPU flash kernel (docs/benchmarks.md, "One compute thread: ...";
# `trio-llm bench kernels`), float32, 4 query and 2 KV heads of 64, one thread:
#   tokens          256    512    1024   2048
#   causal SDPA     0.84   3.29   9.70   32.4 ms
#   blocks of 64    0.68   2.29   8.32   33.0 ms
# On two threads the blocks lose (512 tokens: 2.30 against 2.07 ms): the kernel splits one call's
# queries across threads, and a block of 64 queries gives it too little to split. bfloat16 gains
# as float32 does (512 tokens: 2.61 against 3.63 ms); float16 loses at 1,024 tokens (23.8 against
# 16.1 ms), so it keeps the one causal call.
PROMPT_BLOCKED_MAX_TOKENS = 1024
# Our kernel splits a prompt's query heads over torch's threads from queries x keys of this many
# (about 180 fresh tokens): on two threads here, starting the second cost more than it saved at
# 128 tokens (0.19 against 0.15 ms on one) and gained from 256 (0.38 against 0.46 ms).
KERNEL_PARALLEL_MIN_PAIRS = 32768
PROMPT_QUERY_BLOCK = 64
PROMPT_BLOCKED_DTYPES = (torch.float32, torch.bfloat16)


def causal_prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [T, Hq, D], k, v: [T, Hkv, D] of one sequence's first T tokens -> [T, Hq, D], each token
    attending to itself and the tokens before it.

    torch's CPU flash kernel skips masked work only a whole 512-key block at a time, so a causal
    prompt of up to 512 tokens costs what full attention does. A float32 prompt runs our own
    kernel instead (`engine.kernels.causal_attention`: each query against its own keys only; 1.6
    against 3.4 ms at 512 tokens on one thread, 0.93 against 2.2 on two), on torch's threads once
    the prompt is long enough to pay for starting them (`KERNEL_PARALLEL_MIN_PAIRS`), else on this
    one. Where that kernel does not apply, on one thread, prompts of up to
    `PROMPT_BLOCKED_MAX_TOKENS` in `PROMPT_BLOCKED_DTYPES` are computed a block of
    `PROMPT_QUERY_BLOCK` queries at a time, each over the keys up to its own end, only the last
    `PROMPT_QUERY_BLOCK` of them masked: about half the products at 512 tokens."""
    threads, tokens = torch.get_num_threads(), q.shape[0]
    kernel_threads = threads if tokens * tokens >= KERNEL_PARALLEL_MIN_PAIRS else 1
    if (out := causal_attention(q, k, v, scale, threads=kernel_threads)) is not None:
        return out
    one_thread = threads == 1
    if one_thread and PROMPT_QUERY_BLOCK < tokens <= PROMPT_BLOCKED_MAX_TOKENS and q.dtype in PROMPT_BLOCKED_DTYPES:
        return query_block_attention(q, k, v, scale)
    q_seq, k_seq, v_seq = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, T, D]
    out = F.scaled_dot_product_attention(q_seq, k_seq, v_seq, is_causal=True, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def query_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """`causal_prompt_attention` a block of `PROMPT_QUERY_BLOCK` queries at a time: one SDPA call
    per block, over the keys up to the block's end, only its diagonal masked."""
    q_seq, k_seq, v_seq = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, T, D]
    tokens, block = q.shape[0], PROMPT_QUERY_BLOCK
    later = torch.ones(block, block, dtype=torch.bool, device=q.device).triu(1)  # key after query
    diagonal = torch.zeros(block, block, dtype=q.dtype, device=q.device).masked_fill_(later, float("-inf"))
    outputs = []
    for start in range(0, tokens, block):
        end = min(tokens, start + block)
        mask = q.new_zeros(end - start, end)
        mask[:, start:] = diagonal[:end - start, :end - start]
        outputs.append(F.scaled_dot_product_attention(q_seq[:, :, start:end], k_seq[:, :, :end], v_seq[:, :, :end],
                                                      attn_mask=mask, scale=scale, enable_gqa=True))
    return torch.cat(outputs, 2)[0].transpose(0, 1)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: DecodeMetadata, scale: float, sliding_window: int | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, Hq, D] (one query per sequence) -> [B, Hq, D], over each sequence's cached keys
    and values (this step's already written), with each head's sink logit in the softmax's
    denominator when `sinks` [Hq] is given. For compiled graphs only: see the module doc.

    The shapes are chosen for the loops inductor writes from them (docs/benchmarks.md, "Decode
    attention in the compiled graph"): the softmax runs along positions laid out contiguously,
    and the values are summed a block at a time, then over blocks, with the normalisation left
    to the end; at 64 sequences of 193 tokens that is 25-34% faster than one softmax over
    [B, L, Hkv, G] followed by one sum over every position."""
    B, num_heads, dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads  # GQA: query heads per KV head
    num_blocks, block_size = meta.block_table.shape[1], meta.block_size
    length = num_blocks * block_size
    keys = k_cache.view(-1, block_size, num_kv_heads, dim)[meta.block_table]  # [B, nb, bs, Hkv, D]
    values = v_cache.view(-1, block_size, num_kv_heads, dim)[meta.block_table]
    q_grouped = q.view(B, 1, 1, num_kv_heads, group, dim)
    scores = (q_grouped * keys.unsqueeze(4)).sum(-1, dtype=torch.float32) * scale  # [B, nb, bs, Hkv, G]
    scores = scores.permute(0, 3, 4, 1, 2).reshape(B, num_kv_heads, group, length)
    scores = scores.masked_fill(~decode_allowed(length, meta.seq_lens, sliding_window)[:, None, None, :],
                                float("-inf"))
    top = scores.amax(-1, keepdim=True)
    if sinks is not None:
        sink = sinks.float().view(1, num_kv_heads, group, 1)
        top = torch.maximum(top, sink)
    weights = torch.exp(scores - top)  # unnormalised softmax
    per_block = weights.view(B, num_kv_heads, group, num_blocks, block_size).permute(0, 3, 4, 1, 2)
    out = (per_block.unsqueeze(-1) * values.unsqueeze(4)).sum(2).sum(1)  # [B, Hkv, G, D]
    total = weights.sum(-1, keepdim=True)
    out = out / (total if sinks is None else total + torch.exp(sink - top))
    return out.reshape(B, num_heads, dim).to(q.dtype)


def gathered_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: DecodeMetadata, scale: float, sliding_window: int | None = None,
                              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, Hq, D] (one query per sequence) -> [B, Hq, D]: the keys and values of each sequence's
    block table gathered ([B, Hkv, L, D]), then one SDPA call masked to each one's length.

    Grouped-query attention without copying the keys per query head: a sequence's one query per
    head is laid out as G queries of its KV head ([B, Hkv, G, D]), which every SDPA backend takes
    (`enable_gqa` is not taken by all of CUDA's). Shapes depend only on the batch size and the
    table's width, never on the lengths, so a CUDA graph captured at one width replays at any
    lengths within it."""
    B, num_heads, dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    length = meta.block_table.shape[1] * meta.block_size
    keys = k_cache.view(-1, meta.block_size, num_kv_heads, dim)[meta.block_table].view(B, length, num_kv_heads, dim)
    values = v_cache.view(-1, meta.block_size, num_kv_heads, dim)[meta.block_table].view(B, length, num_kv_heads, dim)
    keys, values = keys.to(q.dtype), values.to(q.dtype)  # a 16-bit cache under a wider model (--kv-cache-dtype)
    allowed = decode_allowed(length, meta.seq_lens, sliding_window)
    if sinks is not None:
        mask = torch.zeros(allowed.shape, dtype=torch.float32, device=q.device).masked_fill_(~allowed, float("-inf"))
        out = sink_attention(q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), mask[:, None, None, :],
                             scale, sinks)
        return out.reshape(B, num_heads, dim)
    out = F.scaled_dot_product_attention(q.view(B, num_kv_heads, group, dim), keys.transpose(1, 2),
                                         values.transpose(1, 2), attn_mask=allowed[:, None, None, :], scale=scale)
    return out.reshape(B, num_heads, dim)


def decode_allowed(length: int, seq_lens: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """[B, L]: which of a decode's table positions it attends to: those before its length, and
    within `sliding_window` of its query (the last one) when there is a window."""
    positions = torch.arange(length, device=seq_lens.device)[None, :]
    allowed = positions < seq_lens[:, None]
    if sliding_window is not None:
        allowed &= positions >= seq_lens[:, None] - sliding_window
    return allowed
