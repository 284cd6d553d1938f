"""The sampler on hand-made logits: greedy, top-k, top-p, min-p, seeds, penalties, logprobs."""

from __future__ import annotations

import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.worker.sampler import ARGMAX_CHUNK, SamplingRow, argmax_rows, draw, sample


def rows(*params, outputs=None, prompt=None):
    result = []
    for i, p in enumerate(params):
        gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        result.append(SamplingRow(p, gen, prompt or [0], list(outputs[i]) if outputs else []))
    return result


LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
DEFAULT = torch.Generator().manual_seed(0)


def draws(params: SamplingParams, n: int = 400) -> set[int]:
    seen = set()
    for _ in range(n):
        seen.add(sample(LOGITS.clone(), rows(params), DEFAULT).token_ids[0])
    return seen


def test_greedy_takes_theargmax_rows():
    assert sample(LOGITS, rows(SamplingParams(temperature=0)), DEFAULT).token_ids == [0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # numpy's argmax; the chunked torch path
@pytest.mark.parametrize("vocab", [5, 100, ARGMAX_CHUNK, ARGMAX_CHUNK + 2, 12869, 32000])
def test_argmax_rows_finds_the_first_maximum_as_max_does(vocab, dtype):
    """Both ways: float32 CPU logits through numpy's vectorised argmax, other dtypes (and devices)
    through the chunked torch path."""
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab), dtype=dtype)
    logits[0, 3] = logits[0, vocab - 1] = 50.0  # a tie across chunks: the first wins
    logits[1] = float("-inf")
    logits[1, vocab - 1] = 1.0  # the maximum in the last column, past the whole chunks
    logits[2] = float("-inf")  # every token masked: the first
    logits[3, vocab // 2] = float("nan")  # a NaN is the largest, as in `max`
    logits[4] = 7.0  # all equal: the first
    logits[5, 1:3] = 60.0  # a tie inside one chunk
    assert torch.equal(argmax_rows(logits), logits.max(dim=-1).indices)
    assert torch.equal(argmax_rows(logits[:1]), logits[:1].max(dim=-1).indices)
    strided = logits.t().contiguous().t()  # the same values, column-major
    assert torch.equal(argmax_rows(strided), logits.max(dim=-1).indices)


def test_top_k_top_p_min_p_restrict_the_candidates():
    assert draws(SamplingParams(temperature=1.0)) == {0, 1, 2, 3}
    assert draws(SamplingParams(temperature=1.0, top_k=2)) == {0, 1}
    assert draws(SamplingParams(temperature=1.0, top_p=0.7)) == {0, 1}  # 0.5 + 0.3 reaches 0.7
    assert draws(SamplingParams(temperature=1.0, min_p=0.5)) == {0, 1}  # 0.15 < 0.5 * 0.5


def test_draws_follow_the_probabilities_and_never_pick_a_token_of_probability_zero():
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.0, 0.2], [0.0, 0.0, 0.0, 0.0, 1.0]])
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    for _ in range(4000):
        tokens = draw(probs, [generator, generator])
        counts[tokens[0]] += 1
        assert tokens[1] == 4
    assert counts[1] == counts[3] == 0
    # 4,000 draws: each share within 3% of its probability (over 4 standard deviations)
    torch.testing.assert_close(counts / 4000, probs[0], atol=0.03, rtol=0)
    # one large row: a token's share of 1e-6 stays that small, the sums in float64
    wide = torch.full((1, 151936), 1e-6 / 151935)
    wide[0, 77] = 1 - 1e-6
    assert {int(draw(wide, [generator])[0]) for _ in range(200)} == {77}


def test_seeded_rows_do_not_depend_on_their_neighbours():
    logits = torch.randn(1, 50)
    seeded = SamplingParams(temperature=1.0, seed=5)
    alone = sample(logits, rows(seeded), DEFAULT).token_ids[0]
    batch_rows = rows(SamplingParams(temperature=1.0), seeded, SamplingParams(temperature=0.5, seed=9))
    batch = torch.cat([torch.randn(1, 50), logits, torch.randn(1, 50)])
    assert sample(batch, batch_rows, DEFAULT).token_ids[1] == alone
    # and a seeded row's successive draws follow its own generator, not the default one
    fresh = rows(seeded)
    first = [sample(logits, fresh, DEFAULT).token_ids[0] for _ in range(20)]
    again = rows(seeded)
    second = [sample(logits, again, torch.Generator().manual_seed(123)).token_ids[0] for _ in range(20)]
    assert first == second and len(set(first)) > 1


def test_penalties_push_down_repeated_tokens():
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    plain = SamplingParams(temperature=0)
    assert sample(logits, rows(plain, outputs=[[0]]), DEFAULT).token_ids == [0]
    for params in (SamplingParams(temperature=0, frequency_penalty=0.5),
                   SamplingParams(temperature=0, presence_penalty=0.5),
                   SamplingParams(temperature=0, repetition_penalty=1.5)):
        assert sample(logits, rows(params, outputs=[[0]]), DEFAULT).token_ids == [1], params
    # repetition penalty also covers prompt tokens
    assert sample(logits, rows(SamplingParams(temperature=0, repetition_penalty=1.5), prompt=[0]),
                  DEFAULT).token_ids == [1]


def test_min_tokens_masks_eos_and_stop_tokens():
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1]).with_eos((0,))
    assert sample(LOGITS, rows(params, outputs=[[3]]), DEFAULT).token_ids == [2]
    assert sample(LOGITS, rows(params, outputs=[[3, 3]]), DEFAULT).token_ids == [0]


def test_logprob_token_ids_report_the_named_tokens_in_order():
    params = SamplingParams(temperature=0, logprob_token_ids=[3, 1])
    ids, lps, ranks = sample(LOGITS, rows(params), DEFAULT).logprobs[0]
    assert ids == [0, 3, 1] and ranks == [1, 4, 2]  # the chosen token, then those named, not the top N
    assert lps == torch.log_softmax(LOGITS[0], dim=-1)[[0, 3, 1]].tolist()
    assert sample(LOGITS, rows(SamplingParams(temperature=0)), DEFAULT).logprobs == [None]


def test_logprobs_report_rank_and_top_candidates():
    out = sample(LOGITS, rows(SamplingParams(temperature=0, logprobs=2)), DEFAULT)
    ids, lps, ranks = out.logprobs[0]
    assert ids == [0, 0, 1] and ranks == [1, 1, 2]
    assert lps[0] == torch.log(torch.tensor(0.5)).item()


def whole_row(logits, params):
    """`_top_k_top_p`'s kept logits over each whole row (-inf where dropped)."""
    from engine.worker import sampler

    kept, ids = sampler._top_k_top_p(logits, params)
    return kept if ids is None else torch.full_like(logits, float("-inf")).scatter_(1, ids, kept)


@pytest.mark.parametrize("spread", [8.0, 0.01])  # a peaked row (small nucleus), a nearly flat one (huge)
def test_top_k_and_top_p_among_the_candidates_keep_what_the_full_sort_keeps(spread, monkeypatch):
    """Rows of 32,000 logits, mixed top-k and top-p in one batch: the tokens kept and their logits
    are the full sort's. A peaked batch is decided among the candidates (the sort never runs); a
    flat one, whose nucleus runs past them, falls back to the sort."""
    from engine.worker import sampler

    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 32000, generator=generator) * spread
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=p)
              for k, p in ((40, 1.0), (0, 0.9), (256, 0.5), (5, 0.95), (0, 0.5), (1, 1.0))]
    top_k = [p.top_k if p.top_k > 0 else 32000 for p in params]
    want = sampler._kept_by_sorting(logits, top_k, params)
    sorts = []
    real_sort = sampler._kept_by_sorting
    monkeypatch.setattr(sampler, "_kept_by_sorting", lambda *a: sorts.append(1) or real_sort(*a))
    got = whole_row(logits, params)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert torch.equal(got[torch.isfinite(got)], want[torch.isfinite(want)])
    assert bool(torch.isfinite(got).sum(-1).min() >= 1)
    assert sorts == ([] if spread > 1 else [1])
    # a top-k past the candidates but short of the vocabulary: only the sort knows its set
    wide = [SamplingParams(temperature=1.0, top_k=1000, top_p=0.9)]
    assert torch.equal(whole_row(logits[:1], wide), real_sort(logits[:1], [1000], wide))


def test_a_draw_among_the_candidates_is_the_whole_rows_draw():
    """With top-k and top-p settled among the candidates, the draw runs over them alone, in
    vocabulary order: each uniform number picks the token the whole row's probabilities pick."""
    from engine.worker import sampler

    logits = torch.randn(1, 32000, generator=torch.Generator().manual_seed(9)) * 8
    for params in (SamplingParams(temperature=0.8, top_k=40, top_p=0.95), SamplingParams(temperature=1.0, top_p=0.9)):
        whole = torch.softmax(whole_row(logits / params.temperature, [params]), dim=-1)
        assert int((whole > 0).sum()) > 1  # a real choice
        for seed in range(200):
            want = draw(whole, [torch.Generator().manual_seed(seed)])
            got = sampler.choose(logits, rows(params), torch.Generator().manual_seed(seed))
            assert got.tolist() == want.tolist(), seed


def test_off_the_cpu_the_candidates_never_read_the_device():
    """On a GPU sampling must not wait for the device: a nucleus (whose closing is read on the host)
    takes the sort there, while a top-k that fits the candidates is settled among them without a
    read. A meta tensor stands in for the device: any read of its values would raise."""
    from engine.worker import sampler

    logits = torch.empty(2, 32000, device="meta")
    nucleus = [SamplingParams(temperature=1.0, top_p=0.9)] * 2
    assert sampler._among_candidates(logits, [32000, 32000], nucleus) is None
    top_k = [SamplingParams(temperature=1.0, top_k=40, top_p=0.9)] * 2
    kept, ids = sampler._among_candidates(logits, [40, 40], top_k)
    assert kept.shape == ids.shape == (2, sampler.TOP_CANDIDATES) and kept.device.type == "meta"
