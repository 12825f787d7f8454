"""Incremental detokenization: a request's output text without decoding all its tokens again each
step. The text is a settled prefix (the tokens before `Request.detok_offset`, decoded once) plus
the decode of the last few tokens; tokens are folded into the prefix once HOLD newer ones follow
and the fold ends on a whole character (a byte-level token can carry part of a UTF-8 character,
which decodes as U+FFFD until the rest arrives).

That equals decoding every token again only where decoding is concatenative: a byte-level BPE
decoder (tokens -> bytes -> UTF-8) with no clean-up of tokenization spaces. `concatenative` says
whether a tokenizer is one; for any other (SentencePiece's leading-space rule, clean-up rules
that look across a token boundary) the engine decodes every token each step, as before.
"""

from __future__ import annotations

HOLD = 4  # tokens kept undecided at the end of the text


def concatenative(tokenizer) -> bool:
    """Whether decode(a + b) == decode(a) + decode(b) wherever a ends on a whole character."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return type(decoder).__name__ == "ByteLevel" and not getattr(tokenizer, "clean_up_tokenization_spaces", False)


def output_text(decode, req, skip_special_tokens: bool) -> str:
    """req's output text; `decode(ids, skip_special_tokens)` is the tokenizer's. Advances
    req.detok_offset / req.detok_prefix."""
    ids = req.output_token_ids
    tail = decode(ids[req.detok_offset :], skip_special_tokens)
    fold = len(ids) - HOLD
    if fold > req.detok_offset and "\ufffd" not in tail:
        head = decode(ids[req.detok_offset : fold], skip_special_tokens)
        if tail.startswith(head):
            req.detok_prefix += head
            req.detok_offset = fold
            tail = tail[len(head) :]
    return req.detok_prefix + tail
