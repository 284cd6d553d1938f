"""Turning logits into tokens, one row per request, with per-request parameters.

Order of operations (vLLM's): penalties, allowed token ids and logit bias, then the min_tokens mask, then
greedy argmax or temperature + min-p + top-k + top-p and a draw. Logprobs are
the raw model log-probabilities, before any of that.

A request with a `seed` draws its noise from its own generator, so its output
does not depend on what else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams
from engine.sched.output import TokenLogprobs


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def sample(logits: torch.Tensor, rows: list[SamplingRow], default_generator: torch.Generator) -> SamplerOutput:
    """logits: [B, V] float32, one row per entry of `rows`."""
    raw_logprobs = None
    if any(r.params.wants_logprobs for r in rows):
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    logits = apply_penalties(logits, rows)
    logits = apply_logit_bias(logits, rows)
    logits = mask_stop_tokens_below_min(logits, rows)
    chosen = _choose(logits, rows, default_generator)
    token_ids = chosen.tolist()
    logprobs: list[TokenLogprobs | None] = [None] * len(rows)
    if raw_logprobs is not None:
        for i, r in enumerate(rows):
            if r.params.wants_logprobs:
                logprobs[i] = top_logprobs(raw_logprobs[i], token_ids[i], r.params.logprobs or 0,
                                           r.params.logprob_token_ids)
    return SamplerOutput(token_ids, logprobs)


def top_logprobs(row_logprobs: torch.Tensor, token_id: int, num: int,
                 named: tuple[int, ...] | None = None) -> TokenLogprobs:
    """The chosen token's logprob and rank, then the `num` most likely tokens, or, given `named`
    (logprob_token_ids), those tokens' logprobs and ranks in the order named."""
    chosen_lp = row_logprobs[token_id]
    rank = int((row_logprobs > chosen_lp).sum()) + 1
    ids, lps, ranks = [token_id], [float(chosen_lp)], [rank]
    if named:
        index = torch.tensor(named, dtype=torch.long, device=row_logprobs.device)
        values = row_logprobs[index]
        ids += list(named)
        lps += values.tolist()
        ranks += ((row_logprobs[None, :] > values[:, None]).sum(dim=1) + 1).tolist()
    elif num > 0:
        top = torch.topk(row_logprobs, num)
        ids += top.indices.tolist()
        lps += top.values.tolist()
        ranks += list(range(1, num + 1))
    return ids, lps, ranks


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Bad words' final tokens masked where the rest of the word came just before, `allowed_token_ids`
    (everything else masked), then `logit_bias` added."""
    biased = [i for i, r in enumerate(rows) if r.params.logit_bias or r.params.allowed_token_ids is not None
              or r.params.bad_words_token_ids]
    if not biased:
        return logits
    logits = logits.clone()
    for i in biased:
        p = rows[i].params
        generated = rows[i].output_token_ids
        for words in p.bad_words_token_ids:  # the word's last token, where the rest of it was just generated
            prefix = list(words[:-1])
            if not prefix or generated[len(generated) - len(prefix):] == prefix:
                logits[i, words[-1]] = float("-inf")
        if p.allowed_token_ids is not None:
            keep = torch.full_like(logits[i], float("-inf"))
            ids = torch.tensor(p.allowed_token_ids, dtype=torch.long, device=logits.device)
            keep[ids] = logits[i, ids]
            logits[i] = keep
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=logits.device)
            logits[i, ids] += torch.tensor([b for _, b in p.logit_bias], dtype=logits.dtype, device=logits.device)
    return logits


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    penalised = [i for i, r in enumerate(rows) if r.params.uses_penalties]
    if not penalised:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for i in penalised:
        p = rows[i].params
        out_ids = torch.tensor(rows[i].output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out_ids[out_ids < vocab], minlength=vocab).to(logits.dtype)
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            prompt = torch.tensor(rows[i].prompt_token_ids, dtype=torch.long, device=logits.device)
            seen[prompt[prompt < vocab]] = True
            scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row = torch.where(seen, scaled, row)
        row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)
        logits[i] = row
    return logits


def mask_stop_tokens_below_min(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Before `min_tokens` are out, EOS and stop tokens cannot be chosen."""
    masked = False
    for i, r in enumerate(rows):
        p = r.params
        if len(r.output_token_ids) >= p.min_tokens:
            continue
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(p.eos_token_ids))
        banned = [t for t in banned if t < logits.shape[1]]
        if banned:
            if not masked:
                logits, masked = logits.clone(), True
            logits[i, banned] = float("-inf")
    return logits


def _choose(logits: torch.Tensor, rows: list[SamplingRow], default_generator: torch.Generator) -> torch.Tensor:
    greedy = argmax_rows(logits)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not random_rows:
        return greedy
    index = torch.tensor(random_rows, device=logits.device)
    probs = _filtered_probs(logits[index], [rows[i].params for i in random_rows])
    noise = torch.empty_like(probs)
    for j, i in enumerate(random_rows):
        noise[j].exponential_(generator=rows[i].generator or default_generator)
    # probs / Exp(1) noise: its argmax is a draw from probs (the exponential-race trick).
    drawn = argmax_rows(probs / noise)
    return greedy.index_copy(0, index, drawn)


ARGMAX_CHUNK = 128


def argmax_rows(rows: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first, on ties; a NaN counts as the largest, as in `max`).

    torch's `max(dim)` and `argmax` track an index per element and do not vectorise on CPU: 0.43 ms
    for 16 x 32,000 logits on one thread, 1.9 ms for 64, 5% of a served step at 16 streams. A
    plain maximum vectorises (0.03 ms), so: the maximum of each chunk of `ARGMAX_CHUNK` logits, the
    first chunk holding the row's maximum (a search over a few hundred), and the first maximum
    inside that chunk. 0.08 ms for 16 x 32,000, 0.27 for 64 (docs/benchmarks.md)."""
    num_rows, vocab = rows.shape
    whole = vocab - vocab % ARGMAX_CHUNK
    if num_rows == 1 or whole == 0:  # one row: `max` is as fast
        return rows.max(dim=-1).indices
    chunk_max = rows[:, :whole].reshape(num_rows, -1, ARGMAX_CHUNK).amax(-1)
    if whole < vocab:
        chunk_max = torch.cat([chunk_max, rows[:, whole:].amax(-1, keepdim=True)], 1)
    first_chunk = chunk_max.max(dim=-1).indices
    # The chunk's columns; the last chunk may run past the vocabulary: those repeat its last
    # column, after that column's own place, so the first maximum is still the true one.
    offsets = torch.arange(ARGMAX_CHUNK, device=rows.device)
    columns = (first_chunk[:, None] * ARGMAX_CHUNK + offsets).clamp_(max=vocab - 1)
    return first_chunk * ARGMAX_CHUNK + rows.gather(1, columns).max(dim=-1).indices


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    logits = logits / temperature[:, None]
    if any(p.min_p > 0 for p in params):
        probs = torch.softmax(logits, dim=-1)
        min_p = torch.tensor([p.min_p for p in params], device=device, dtype=logits.dtype)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        logits = _top_k_top_p(logits, params)
    return torch.softmax(logits, dim=-1)


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    device = logits.device
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    ranks = torch.arange(vocab, device=device)[None, :]
    drop = ranks >= top_k[:, None]
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=logits.dtype)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass strictly before each token
    drop |= before >= top_p[:, None]
    drop[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
