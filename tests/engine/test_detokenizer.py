"""Incremental detokenization (engine/core/detokenizer.py): the text after every appended token equals
the tokenizer's decode of all tokens so far, for random token sequences of the default model's
byte-level tokenizer (multi-byte characters split across tokens, special tokens skipped or kept)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core import detokenizer
from engine.model.models import load_tokenizer

TOK = load_tokenizer("default")


def decode(ids, skip):
    return TOK.decode(ids, skip_special_tokens=skip)


def test_the_default_tokenizer_is_concatenative():
    assert detokenizer.concatenative(TOK)
    assert not detokenizer.concatenative(SimpleNamespace(clean_up_tokenization_spaces=False))


# token ids biased toward the ones that carry pieces of multi-byte characters (emoji, CJK) and
# the special tokens at the start of the vocabulary
_emoji_ids = TOK.encode("héllo 😀🎉 漢字かな ü€ —", add_special_tokens=False)
_ids = st.one_of(st.integers(0, TOK.vocab_size - 1), st.sampled_from(_emoji_ids), st.integers(0, 16))


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(_ids, min_size=1, max_size=40), skip=st.booleans())
def test_increments_equal_decoding_everything(ids, skip):
    req = SimpleNamespace(output_token_ids=[], detok_offset=0, detok_prefix="")
    for tok in ids:
        req.output_token_ids.append(tok)
        assert detokenizer.output_text(decode, req, skip) == decode(req.output_token_ids, skip)
    assert req.detok_offset <= max(0, len(ids) - detokenizer.HOLD)


@pytest.mark.parametrize("text", ["plain words only, many of them " * 4, "😀" * 12 + " done"])
def test_the_prefix_settles(text):
    ids = TOK.encode(text, add_special_tokens=False)
    req = SimpleNamespace(output_token_ids=[], detok_offset=0, detok_prefix="")
    for tok in ids:
        req.output_token_ids.append(tok)
        out = detokenizer.output_text(decode, req, True)
    assert out == text
    assert req.detok_offset >= len(ids) - detokenizer.HOLD - 3  # folded, not decoded from 0


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(_ids, min_size=0, max_size=40), skip=st.booleans())
def test_a_concatenative_tokenizers_backend_decodes_as_transformers_does(ids, skip):
    """The engine decodes through the tokenizers backend where the tokenizer is concatenative
    (Engine.decode): the same text as transformers' decode, special tokens skipped or kept."""
    assert TOK.backend_tokenizer.decode(ids, skip_special_tokens=skip) == decode(ids, skip)
