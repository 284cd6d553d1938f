"""Turning logits into tokens, one row per request, with per-request parameters.

Order of operations (vLLM's): penalties, allowed token ids and logit bias, then the min_tokens mask, then
greedy argmax or temperature + min-p + top-k + top-p and a draw. Logprobs are
the raw model log-probabilities, before any of that.

A request with a `seed` draws its noise from its own generator, so its output
does not depend on what else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy
import torch

from engine.sampling_params import SamplingParams
from engine.sched.output import TokenLogprobs
from engine.worker.transfers import HostCopy, to_device


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


@dataclass
class DeviceSample:
    """A batch's sampled tokens and logprobs, still on the device: nothing has been read back, so
    nothing has waited for the device yet. `read_back` starts the one copy to the host.

    Logprobs are flat: for each row that asked (`logprob_counts[row]` entries, else 0), the chosen
    token's id, logprob and rank, then its top (or named) tokens'."""

    token_ids: torch.Tensor  # [B] long
    logprob_counts: list[int]
    logprob_ids: torch.Tensor  # [sum(counts)] long
    logprob_values: torch.Tensor  # [sum(counts)] float32
    logprob_ranks: torch.Tensor  # [sum(counts)] long

    def read_back(self, side_stream: Any = None) -> HostSample:
        """Start copying the sample to the host (see `HostCopy`); read it from the result once its
        copy is done."""
        longs = torch.cat([self.token_ids, self.logprob_ids, self.logprob_ranks])
        return HostSample(self.logprob_counts, HostCopy([longs, self.logprob_values], side_stream))


@dataclass
class HostSample:
    """A `DeviceSample` on its way to the host: `result` once `copy` is done."""

    logprob_counts: list[int]
    copy: HostCopy

    def result(self) -> SamplerOutput:
        """The lists; waits for the copy (at once on CPU, and once its event is done)."""
        self.copy.wait()
        longs, values = self.copy.tensors()
        count = len(self.logprob_counts)
        flat = sum(self.logprob_counts)
        token_ids = longs[:count].tolist()
        ids, ranks = longs[count:count + flat].tolist(), longs[count + flat:].tolist()
        lps = values.tolist()
        logprobs: list[TokenLogprobs | None] = []
        start = 0
        for n in self.logprob_counts:
            logprobs.append((ids[start:start + n], lps[start:start + n], ranks[start:start + n]) if n else None)
            start += n
        return SamplerOutput(token_ids, logprobs)


def sample(logits: torch.Tensor, rows: list[SamplingRow], default_generator: torch.Generator) -> SamplerOutput:
    """logits: [B, V] float32, one row per entry of `rows`. Reads the result back at once."""
    return sample_on_device(logits, rows, default_generator).read_back().result()


def chosen_from_logits_alone(params: SamplingParams, num_output: int) -> bool:
    """Whether `sample_on_device` leaves this row's logits as they are before `choose`, with
    `num_output` tokens out before it: no logprobs, no penalties, no bias, allowed ids or bad words,
    and `min_tokens` reached (below it, stop tokens are masked). Its token is then `choose`'s of its
    logits alone (`LeanBurst`)."""
    return (not params.wants_logprobs and not params.uses_penalties and not params.logit_bias
            and params.allowed_token_ids is None and not params.bad_words_token_ids
            and num_output >= params.min_tokens)


def sample_on_device(logits: torch.Tensor, rows: list[SamplingRow],
                     default_generator: torch.Generator) -> DeviceSample:
    """`sample` without reading anything back: every operation stays on the logits' device, so on
    CUDA the host does not wait for the device here."""
    raw_logprobs = None
    if any(r.params.wants_logprobs for r in rows):
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    logits = apply_penalties(logits, rows)
    logits = apply_logit_bias(logits, rows)
    logits = mask_stop_tokens_below_min(logits, rows)
    chosen = choose(logits, rows, default_generator)
    counts = [0] * len(rows)
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    if raw_logprobs is not None:
        for i, r in enumerate(rows):
            if r.params.wants_logprobs:
                parts.append(logprobs_on_device(raw_logprobs[i], chosen[i:i + 1], r.params.logprobs or 0,
                                                r.params.logprob_token_ids))
                counts[i] = parts[-1][0].numel()
    empty_long = chosen.new_empty(0)
    return DeviceSample(
        chosen, counts,
        torch.cat([p[0] for p in parts]) if parts else empty_long,
        torch.cat([p[1] for p in parts]) if parts else logits.new_empty(0),
        torch.cat([p[2] for p in parts]) if parts else empty_long,
    )


def logprobs_on_device(row_logprobs: torch.Tensor, chosen: torch.Tensor, num: int,
                       named: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ids, logprobs and ranks, as device tensors: the `chosen` token's ([1]), then the `num` most
    likely tokens', or, given `named` (logprob_token_ids), those tokens' in the order named."""
    chosen_lp = row_logprobs[chosen]
    ids, values = [chosen], [chosen_lp]
    ranks = [(row_logprobs[None, :] > chosen_lp[:, None]).sum(dim=1) + 1]
    if named:
        index = to_device(named, torch.long, row_logprobs.device)
        named_values = row_logprobs[index]
        ids.append(index)
        values.append(named_values)
        ranks.append((row_logprobs[None, :] > named_values[:, None]).sum(dim=1) + 1)
    elif num > 0:
        top = torch.topk(row_logprobs, num)
        ids.append(top.indices)
        values.append(top.values)
        ranks.append(torch.arange(1, num + 1, device=row_logprobs.device))
    return torch.cat(ids), torch.cat(values).float(), torch.cat(ranks)


def top_logprobs(row_logprobs: torch.Tensor, token_id: int, num: int,
                 named: tuple[int, ...] | None = None) -> TokenLogprobs:
    """`logprobs_on_device` for one known token, read back as lists."""
    chosen = to_device([token_id], torch.long, row_logprobs.device)
    ids, values, ranks = logprobs_on_device(row_logprobs, chosen, num, named)
    return ids.tolist(), values.tolist(), ranks.tolist()


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
            ids = to_device(p.allowed_token_ids, torch.long, logits.device)
            keep[ids] = logits[i, ids]
            logits[i] = keep
        if p.logit_bias:
            ids = to_device([t for t, _ in p.logit_bias], torch.long, logits.device)
            logits[i, ids] += to_device([b for _, b in p.logit_bias], logits.dtype, logits.device)
    return logits


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    penalised = [i for i, r in enumerate(rows) if r.params.uses_penalties]
    if not penalised:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for i in penalised:
        p = rows[i].params
        out_ids = to_device(rows[i].output_token_ids, torch.long, logits.device)
        counts = torch.bincount(out_ids[out_ids < vocab], minlength=vocab).to(logits.dtype)
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            prompt = to_device(rows[i].prompt_token_ids, torch.long, logits.device)
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
            logits[i, to_device(banned, torch.long, logits.device)] = float("-inf")
    return logits


def choose(logits: torch.Tensor, rows: list[SamplingRow], default_generator: torch.Generator) -> torch.Tensor:
    """Each row's token from its logits as they are: the argmax for greedy rows, a draw from its
    generator (or `default_generator`) for the others, after temperature, top-k, top-p and min-p."""
    greedy = argmax_rows(logits)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not random_rows:
        return greedy
    index = to_device(random_rows, torch.long, logits.device)
    probs, ids = _filtered_probs(logits[index], [rows[i].params for i in random_rows])
    drawn = draw(probs, [rows[i].generator or default_generator for i in random_rows])
    if ids is not None:  # `probs` over the tokens top-k and top-p kept: their ids
        drawn = ids.gather(1, drawn[:, None]).squeeze(1)
    return greedy.index_copy(0, index, drawn)


def draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token from each row of `probs`, the row's uniform number from its generator: the first
    token whose cumulative probability passes it (inverse transform sampling; a token of
    probability zero is never drawn). vLLM's exponential race (the argmax of probs / Exp(1) noise)
    draws a number per token, and torch's CPU `exponential_` costs: 1.1 ms for a row of 32,000,
    5.2 ms for Qwen's 151,936, against 0.13 and 0.38 ms here (docs/benchmarks.md). The sums are
    in float64 so that rounding over a large vocabulary moves no token's share measurably."""
    uniform = torch.empty(len(generators), 1, dtype=torch.float64, device=probs.device)
    for j, generator in enumerate(generators):
        uniform[j].uniform_(generator=generator)
    cumulative = probs.double().cumsum(-1)
    drawn = torch.searchsorted(cumulative, uniform * cumulative[:, -1:], right=True).squeeze(1)
    return drawn.clamp_(max=probs.shape[-1] - 1)


ARGMAX_CHUNK = 128


def argmax_rows(rows: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first, on ties; a NaN counts as the largest, as in `max`).

    torch's `max(dim)` and `argmax` track an index per element and do not vectorise on CPU: 0.43 ms
    for 16 x 32,000 logits on one thread, 1.9 ms for 64, 5% of a served step at 16 streams, and
    40-65 us for one row. numpy's `argmax` is vectorised (its SIMD kernels) with the same answers
    (the first maximum; the first NaN where a row has one), so float32 CPU logits go there: 0.01 ms
    for one row of 32,000, 0.09 for 16, 0.39 for 64. Other dtypes and devices: a plain maximum
    vectorises, so the maximum of each chunk of `ARGMAX_CHUNK` logits, the first chunk holding the
    row's maximum (a search over a few hundred), and the first maximum inside that chunk (0.16 ms
    for 16 x 32,000 on two threads, 0.42 for 64; docs/benchmarks.md)."""
    if rows.dtype == torch.float32 and rows.device.type == "cpu":
        return torch.from_numpy(numpy.argmax(rows.detach().numpy(), axis=-1))
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


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's probabilities after temperature, min-p, top-k and top-p, in vocabulary order:
    over the whole row (ids None), or, where top-k and top-p were settled among the candidates
    (`_among_candidates`), over those candidates alone, `ids` [rows, TOP_CANDIDATES] their token
    ids (ascending; a dropped one has probability zero). A draw's sums then run over the tokens
    the whole row's would, in the same order."""
    device = logits.device
    temperature = to_device([p.temperature for p in params], logits.dtype, device)
    logits = logits / temperature[:, None]
    if any(p.min_p > 0 for p in params):
        probs = torch.softmax(logits, dim=-1)
        min_p = to_device([p.min_p for p in params], logits.dtype, device)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    ids = None
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        logits, ids = _top_k_top_p(logits, params)
    return torch.softmax(logits, dim=-1), ids


TOP_CANDIDATES = 256  # tokens `_top_k_top_p` ranks before it sorts a whole row


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's logits with every token top-k and top-p drop set to -inf: ranked by logit, a
    token goes past the row's top_k, or once the probability before it (over the tokens top-k
    keeps) reaches top_p; the most likely token always stays. Returned over the whole row (ids
    None), or over the row's candidates with their token ids (`_among_candidates`).

    What survives is a prefix of the ranking, and with top-k up to `TOP_CANDIDATES`, or a nucleus
    inside that many, the prefix is decided among the row's `TOP_CANDIDATES` largest logits alone
    (`topk`: 70 us for a row of 32,000 against 2.1 ms for torch's full sort, 11.5 ms for Qwen's
    151,936; docs/benchmarks.md). Any other row sends the batch through the full sort."""
    top_k = _top_ks(logits, params)
    among = _among_candidates(logits, top_k, params)
    return among if among is not None else (_kept_by_sorting(logits, top_k, params), None)


def _top_ks(logits: torch.Tensor, params: list[SamplingParams]) -> list[int]:
    vocab = logits.shape[1]
    return [p.top_k if 0 < p.top_k < vocab else vocab for p in params]


def _among_candidates(logits: torch.Tensor, top_k: list[int],
                      params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`_top_k_top_p` decided among each row's `TOP_CANDIDATES` largest logits: their logits
    (-inf where dropped) and token ids, in vocabulary order. None where a row's prefix may run past
    them: a top-k between the candidates and the vocabulary (its probabilities are over a set only
    a sort finds), or a nucleus not complete among them. Whether a nucleus closes is read on the
    host, so on a GPU (where sampling never waits for the device) only rows with a top-k that fits
    take this way."""
    vocab = logits.shape[1]
    inside = [k <= TOP_CANDIDATES for k in top_k]
    nucleus_only = [k == vocab and p.top_p < 1.0 for k, p in zip(top_k, params, strict=True)]
    if vocab <= TOP_CANDIDATES or not all(a or b for a, b in zip(inside, nucleus_only, strict=True)) \
            or (not all(inside) and logits.device.type != "cpu"):
        return None
    device = logits.device
    values, order = logits.topk(TOP_CANDIDATES, dim=-1)  # sorted, largest first
    ranks = torch.arange(TOP_CANDIDATES, device=device)[None, :]
    drop = ranks >= to_device(top_k, torch.long, device)[:, None]
    # The probabilities over the tokens top-k keeps: among the candidates where top-k fits in them,
    # else over the whole row (top-k then keeps it all, and the nucleus must close among them).
    among = torch.logsumexp(values.masked_fill(drop, float("-inf")), dim=-1, keepdim=True)
    if not all(inside):  # the whole row's normaliser (40 us for 32,000 logits): only where needed
        within = to_device(inside, torch.bool, device)[:, None]
        among = torch.where(within, among, torch.logsumexp(logits, dim=-1, keepdim=True))
    probs = torch.exp(values.masked_fill(drop, float("-inf")) - among)
    mass = probs.cumsum(dim=-1)
    before = mass - probs  # probability mass strictly before each token
    top_p = to_device([p.top_p for p in params], logits.dtype, device)[:, None]
    if not all(inside) and not bool((within | (mass[:, -1:] >= top_p)).all()):  # CPU only (above)
        return None  # a nucleus larger than the candidates
    drop |= before >= top_p
    drop[:, 0] = False  # the most likely token always survives
    ids, by_id = order.sort(dim=-1)
    return values.masked_fill(drop, float("-inf")).gather(1, by_id), ids


def _kept_by_sorting(logits: torch.Tensor, top_k: list[int], params: list[SamplingParams]) -> torch.Tensor:
    """`_top_k_top_p` over each row's whole ranking (a full sort)."""
    device = logits.device
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    drop = ranks >= to_device(top_k, torch.long, device)[:, None]
    top_p = to_device([p.top_p for p in params], logits.dtype, device)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass strictly before each token
    drop |= before >= top_p[:, None]
    drop[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
