"""The bodies of generation responses: usage (with cached_tokens), finish / stop reasons, the
logprobs of completions and of chat, the per-choice streaming cursor, and the SSE event of a
streamed chunk with its padding (`sse_event`: the packet-size side channel's defences)."""

from __future__ import annotations

import json
import random
import string

# stream_options.include_obfuscation: each chunk's content (its delta, serialized) is padded by an
# `obfuscation` string up to a length drawn per chunk from this range (bytes), so a chunk's size no
# longer follows its token's length; content longer than the draw is not padded. OpenAI documents
# the field (random characters that normalize payload sizes) but not its distribution: this is ours.
OBFUSCATION_MIN, OBFUSCATION_MAX = 16, 48
_PAD_CHARS = string.ascii_letters + string.digits
_RNG = random.SystemRandom()  # padding an on-path observer must not predict


def sse_event(chunk: dict, content_bytes: int, obfuscate: bool, pad_to: int, rng=_RNG) -> str:
    """`data: <chunk JSON>\n\n`. With pad_to > 0 the chunk gets an `obfuscation` field sized so
    the whole event is a multiple of pad_to bytes (fixed-size chunks); else, with obfuscate, one
    of random characters that brings `content_bytes` up to a length drawn from [OBFUSCATION_MIN,
    OBFUSCATION_MAX]. The JSON is ASCII (json.dumps escapes the rest), so characters are bytes."""
    if not (obfuscate or pad_to):
        return f"data: {json.dumps(chunk)}\n\n"
    base = len(f"data: {json.dumps({**chunk, 'obfuscation': ''})}\n\n")
    if pad_to:
        k = -base % pad_to
    else:
        k = max(0, rng.randint(OBFUSCATION_MIN, OBFUSCATION_MAX) - content_bytes)
    pad = "".join(rng.choice(_PAD_CHARS) for _ in range(k))
    return f"data: {json.dumps({**chunk, 'obfuscation': pad})}\n\n"


def usage(run, n: int) -> dict:
    prompt = sum(run.prompt_lens)
    completion = sum(len(h.output.outputs[0].token_ids) for h in run.handles if h.output is not None)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        # prompt tokens served by the prefix cache at admission, one count per prompt (its first
        # choice; the forks of n > 1 share those blocks), as vLLM's cached_tokens
        "prompt_tokens_details": {"cached_tokens": cached_tokens(run, n)},
    }


def cached_tokens(run, n: int) -> int:
    return sum(h.output.metrics.num_cached_tokens for h in run.handles[::n] if h.output is not None)


def finish_reason(out) -> str | None:
    r = out.outputs[0].finish_reason if out is not None else None
    return {"error": "abort"}.get(r, r) if r else None


class Delta:
    """Per-choice streaming cursor: new text (holding back an incomplete UTF-8 sequence and,
    while stop strings may still match, their length - 1 characters) and new token ids."""

    def __init__(self, stop: list[str] | None):
        self.text_sent = 0
        self.tokens_sent = 0
        self.hold = max((len(s) for s in stop), default=1) - 1 if stop else 0

    def take(self, out) -> tuple[str, list[int], int]:
        c = out.outputs[0]
        text = c.text
        end = len(text)
        if not out.finished:
            end = len(text.rstrip("\ufffd"))
            end = max(self.text_sent, end - self.hold)
        delta = text[self.text_sent : end] if end > self.text_sent else ""
        self.text_sent = max(self.text_sent, end)
        first = self.tokens_sent
        toks = c.token_ids[first:]
        self.tokens_sent = len(c.token_ids)
        return delta, toks, first


def _tok_text(th, tid: int) -> str:
    return th.tokenizer.decode([tid])


def completion_logprobs(th, c, first: int, count: int, offset0: int) -> dict | None:
    if c.logprobs is None:
        return None
    toks, lps, tops, offs = [], [], [], []
    off = offset0
    for i in range(first, first + count):
        tid = c.token_ids[i]
        lp, alts = c.logprobs[i]
        t = _tok_text(th, tid)
        toks.append(t)
        lps.append(lp)
        top = {_tok_text(th, a): v for a, v in alts}
        top.setdefault(t, lp)
        tops.append(top)
        offs.append(off)
        off += len(t)
    return {"text_offset": offs, "token_logprobs": lps, "tokens": toks, "top_logprobs": tops}


def chat_logprobs(th, c, first: int, count: int) -> dict | None:
    if c.logprobs is None:
        return None
    content = []
    for i in range(first, first + count):
        tid = c.token_ids[i]
        lp, alts = c.logprobs[i]
        t = _tok_text(th, tid)
        content.append(
            {
                "token": t,
                "logprob": lp,
                "bytes": list(t.encode("utf-8")),
                "top_logprobs": [
                    {"token": _tok_text(th, a), "logprob": v, "bytes": list(_tok_text(th, a).encode("utf-8"))}
                    for a, v in alts
                ],
            }
        )
    return {"content": content}


def stop_reason(out):
    return out.outputs[0].stop_reason if out is not None else None
