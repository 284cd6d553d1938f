"""Incremental detokenization: never half a UTF-8 character; stop strings held back while ambiguous."""

from __future__ import annotations

import pytest

from engine.render.detokenizer import IncrementalDetokenizer
from engine.render.tokenizer import Tokenizer
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return Tokenizer(tiny_model_dir)


def test_multibyte_characters_are_never_split(tokenizer):
    text = "naïve café — 日本語のテキスト 🎉🚀 done"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # byte-level pieces: many characters span several tokens
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    pieces = []
    for token_id in ids:
        detok.add_tokens([token_id])
        pieces.append(detok.take_new_text(finished=False))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    assert any(p == "" for p in pieces)  # some tokens were held back mid-character


def test_stop_string_is_cut_and_its_prefix_never_released(tokenizer):
    text = "first part STOP second part"
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["STOP"]))
    released = []
    matched = None
    for token_id in tokenizer.encode(text):
        matched = detok.add_tokens([token_id])
        released.append(detok.take_new_text(finished=matched is not None))
        if matched:
            break
    assert matched == "STOP"
    assert "".join(released) == "first part "
    assert all("S" not in piece for piece in released)


def test_earliest_of_several_stop_strings_wins(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["part", "first"]))
    assert detok.add_tokens(tokenizer.encode("a first part")) == "first"
    assert detok.text == "a "


def test_stop_strings_wait_for_min_tokens(tiny_model_dir):
    from engine.render.detokenizer import IncrementalDetokenizer
    from engine.render.tokenizer import Tokenizer
    from engine.sampling_params import SamplingParams

    tokenizer = Tokenizer(tiny_model_dir)
    ids = tokenizer.encode("ab ab ab ab", False)
    early = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["ab"]))
    assert early.add_tokens(ids[:1]) == "ab"
    late = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["ab"], min_tokens=len(ids) - 1, max_tokens=50))
    assert late.add_tokens(ids[:-1]) is None  # within min_tokens: no stop
    assert late.add_tokens(ids[-1:]) == "ab" and late.text.endswith(" ")


@pytest.mark.parametrize("include_stop", [False, True])
async def test_the_eos_that_ends_a_sequence_is_in_its_ids_not_its_text_even_with_special_tokens_kept(
        tiny_model_dir, tokenizer, include_stop):
    """vLLM's rule: the stop token's text is left out unless include_stop_str_in_output, so a
    client that keeps special tokens (gpt-oss's harmony parser does) never sees the EOS."""
    from engine import open_engine
    from tests.conftest import engine_config
    from tests.helpers import final_output

    eos = tokenizer.backend.token_to_id("<|im_end|>")
    params = SamplingParams(max_tokens=4, logit_bias={eos: 100.0}, skip_special_tokens=False,
                            include_stop_str_in_output=include_stop)
    async with open_engine(engine_config(tiny_model_dir)) as engine:
        completion = (await final_output(engine, [5, 6, 7], params)).outputs[0]
    assert completion.token_ids == [eos] and completion.finish_reason == "stop"
    assert completion.text == ("<|im_end|>" if include_stop else "")
