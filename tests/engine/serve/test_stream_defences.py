"""The packet-size defences of a streamed answer, on the wire (plain HTTP here; over TLS in
test_packet_lab.py): stream_options.include_obfuscation (OpenAI's `obfuscation` field, on by
default), coalesce_tokens and pad_chunks_to; and their bad input."""

import json
import re

import pytest

from engine.serve.render import OBFUSCATION_MAX, OBFUSCATION_MIN, sse_event

from .test_bad_input import CHAT, assert_error, still_serving

BODY = dict(CHAT, max_tokens=10, ignore_eos=True, temperature=1.0, seed=7, stream=True)


def events(http, body) -> list[str]:
    """The raw SSE events of one streamed chat answer, each with its trailing blank line."""
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        raw = b"".join(r.iter_bytes()).decode()
    parts = raw.split("\n\n")
    assert parts[-1] == ""
    return [p + "\n\n" for p in parts[:-1]]


def chunks(evs):
    return [json.loads(e[6:]) for e in evs if e.startswith("data: {")]


def test_obfuscation_is_on_by_default_as_openai_does(http):
    evs = events(http, dict(BODY, stream_options={"include_usage": True}))
    cs = chunks(evs)
    with_choices = [c for c in cs if c["choices"]]
    assert len(with_choices) >= 3
    for c in with_choices:
        assert re.fullmatch(r"[A-Za-z0-9]*", c["obfuscation"]), c
        content = json.dumps(c["choices"][0]["delta"])
        # padded up to a length drawn from [MIN, MAX], never past MAX by the padding itself
        assert len(c["obfuscation"]) <= OBFUSCATION_MAX
        assert len(content) >= OBFUSCATION_MIN or len(content) + len(c["obfuscation"]) >= OBFUSCATION_MIN
    usage = [c for c in cs if not c["choices"]]
    assert len(usage) == 1 and "obfuscation" not in usage[0]
    assert evs[-1] == "data: [DONE]\n\n"


def test_obfuscation_off_leaves_the_chunk_as_before(http):
    cs = chunks(events(http, dict(BODY, stream_options={"include_obfuscation": False})))
    assert cs and all("obfuscation" not in c for c in cs)


def test_the_text_is_the_same_under_every_defence(http):
    texts = set()
    for opts in ({"include_obfuscation": False}, {}, {"coalesce_tokens": 3}, {"pad_chunks_to": 256}):
        cs = chunks(events(http, dict(BODY, stream_options=opts)))
        texts.add("".join(c["choices"][0]["delta"].get("content") or "" for c in cs if c["choices"]))
    assert len(texts) == 1 and texts.pop()


@pytest.mark.parametrize("bucket", [64, 256, 512])
def test_pad_chunks_to_makes_every_event_a_multiple_of_the_bucket(http, bucket):
    evs = events(http, dict(BODY, stream_options={"pad_chunks_to": bucket, "include_usage": True}))
    padded = [e for e in evs if e.startswith("data: {") and json.loads(e[6:])["choices"]]
    assert len(padded) >= 3
    for e in padded:
        assert len(e.encode()) % bucket == 0, (len(e), e)
        assert re.fullmatch(r"[A-Za-z0-9]*", json.loads(e[6:])["obfuscation"])


def test_coalesce_tokens_puts_that_many_tokens_in_each_chunk(http):
    body = dict(BODY, max_tokens=13, logprobs=True, stream_options={"coalesce_tokens": 4, "include_obfuscation": False})
    cs = [c for c in chunks(events(http, body)) if c["choices"] and c["choices"][0]["logprobs"]]
    counts = [len(c["choices"][0]["logprobs"]["content"]) for c in cs]
    assert sum(counts) == 13
    assert all(n >= 4 for n in counts[:-1]), counts
    assert len(counts) <= 4


def test_sse_event_padding_rule():
    import random

    chunk = {"id": "x", "choices": [{"index": 0, "delta": {"content": "hello"}}]}
    rng = random.Random(0)
    plain = sse_event(chunk, 20, obfuscate=False, pad_to=0)
    assert plain == f"data: {json.dumps(chunk)}\n\n"
    for pad_to in (32, 100, 4096):
        assert len(sse_event(chunk, 20, obfuscate=True, pad_to=pad_to, rng=rng)) % pad_to == 0
    for content in (1, 10, 30, 47, 60):
        e = json.loads(sse_event(chunk, content, obfuscate=True, pad_to=0, rng=rng)[6:])
        pad = len(e["obfuscation"])
        if content >= OBFUSCATION_MAX:
            assert pad == 0
        else:  # padded up to the draw, or already past it
            assert OBFUSCATION_MIN <= content + pad <= OBFUSCATION_MAX or pad == 0


BAD = [
    ({"coalesce_tokens": 0}, "stream_options.coalesce_tokens"),
    ({"coalesce_tokens": 65}, "stream_options.coalesce_tokens"),
    ({"coalesce_tokens": "4"}, "stream_options.coalesce_tokens"),
    ({"pad_chunks_to": 8}, "pad_chunks_to"),
    ({"pad_chunks_to": 5000}, "stream_options.pad_chunks_to"),
    ({"pad_chunks_to": -1}, "stream_options.pad_chunks_to"),
    ({"include_obfuscation": "yes"}, "stream_options.include_obfuscation"),
    ({"include_obfuscation": 1}, "stream_options.include_obfuscation"),
]


@pytest.mark.parametrize("opts,words", BAD, ids=[json.dumps(b[0]) for b in BAD])
def test_bad_stream_options_name_the_field(http, opts, words):
    r = http.post("/v1/chat/completions", json=dict(BODY, stream_options=opts))
    assert_error(r, 400, words)
    still_serving(http)


def test_defence_fields_without_stream_are_refused(http):
    r = http.post("/v1/chat/completions", json=dict(CHAT, stream_options={"coalesce_tokens": 2}))
    assert_error(r, 400, "stream_options")
