"""The packet-size side channel over real TLS on 127.0.0.1 (engine/lab/packet_channel.py and
tls_relay.py): the relay sees only TLS records, never plaintext; the attack reads the answer from
record lengths without a defence and falls to chance with the padding defences (seeded, tiny
model); the attack's pure parts on hand-made inputs."""

import math
import random
import shutil
import ssl

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.lab import packet_channel as P
from engine.lab import tls_relay as R
from engine.serve.ports import free_port

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


@pytest.fixture(scope="module")
def tls_server(server, tmp_path_factory):
    """The serve tests' engine, also served over TLS with a certificate made now."""
    from engine.serve import create_app, run_in_background

    cert, key = R.make_certificate(tmp_path_factory.mktemp("tls"))
    port = free_port()
    srv = run_in_background(
        create_app(server.thread, model_name="kvscope-tiny"), "127.0.0.1", port, ssl_context=R.server_context(cert, key)
    )
    assert srv.started
    try:
        yield port, cert
    finally:
        srv.should_exit = True
        srv.thread.join(10)


def test_the_relay_sees_tls_records_and_no_plaintext(tls_server):
    port, cert = tls_server
    body = {
        "messages": [{"role": "user", "content": "Tell me a secret"}],
        "max_tokens": 16,
        "ignore_eos": True,
        "temperature": 1.0,
        "seed": 11,
        "stream": True,
    }
    with R.TlsRelay(("127.0.0.1", port), keep_bytes=True) as relay:
        trust = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(base_url=f"https://127.0.0.1:{relay.port}", verify=trust, timeout=60) as c:
            text, cipher = P.stream_answer(c, body)
        conn = relay.connections[-1]
        assert relay.wait_closed(conn)
    assert cipher.startswith("TLS_")
    assert not conn.not_tls
    for direction in ("c2s", "s2c"):
        raw = bytes(conn.raw[direction])
        recs = [r for r in conn.records if r.direction == direction]
        assert sum(r.length + R.HEADER for r in recs) == len(raw)  # every byte is inside a record
    s2c = bytes(conn.raw["s2c"])
    words = [w for w in text.split() if len(w) >= 5]
    assert words, text
    for needle in [w.encode() for w in words] + [b"chat.completion.chunk", b"data: ", b"HTTP/1.1", b"obfuscation"]:
        assert needle not in s2c
    assert b"Tell me a secret" not in bytes(conn.raw["c2s"])
    assert {r.content_type for r in conn.records} <= {20, 21, 22, 23}
    resp = [r for r in conn.records if r.direction == "s2c" and r.content_type == R.APPLICATION_DATA]
    assert len(resp) >= 16  # one record per chunk, at least


@pytest.fixture(scope="module")
def lab(server):
    return P.measure(server.thread, trials=16, candidates=8, new_tokens=16, temperature=1.0, seed=3)


def test_the_attack_reads_the_answer_without_a_defence(lab):
    by = {s.defence: s for s in lab.summaries()}
    assert by["none"].accuracy >= 0.9, by["none"]
    assert by["none"].length_accuracy >= 0.6 and by["none"].length_accuracy > 2 * by["none"].length_chance
    assert by["none"].bits_per_token > 1
    assert all(t.answer_matches for t in lab.trials)  # the victim's answers are the candidates


def test_padding_defences_bring_the_attack_to_chance(lab):
    by = {s.defence: s for s in lab.summaries()}
    for d in ("obfuscation", "fixed"):
        assert by[d].accuracy <= 3 * by[d].chance, by[d]  # chance 1/8; no defence: ~1.0
        assert by[d].length_accuracy <= by[d].length_chance + 0.1, by[d]
        assert by[d].bytes_per_answer > by["none"].bytes_per_answer  # what it costs


def test_coalescing_hides_token_lengths_but_not_the_answer(lab):
    by = {s.defence: s for s in lab.summaries()}
    c = by["coalesce"]
    assert c.length_accuracy <= c.length_chance + 0.1, c
    # the groups' sums and the total still tell the candidates apart: matching keeps working
    assert c.accuracy >= 0.5, c
    assert c.bytes_per_answer < by["none"].bytes_per_answer  # fewer chunks: fewer bytes


def test_trials_alternate_defences_and_are_seeded(lab):
    assert len(lab.trials) == 16 * len(P.DEFENCES)
    firsts = [t.defence for t in lab.trials[:: len(P.DEFENCES)]]
    assert len(set(firsts[: len(P.DEFENCES)])) == len(P.DEFENCES)  # the order turns each round
    assert len({t.truth for t in lab.trials}) > 1


def test_measure_refuses_bad_arguments(server):
    for kw, word in (
        ({"trials": 0}, "trials"),
        ({"trials": P.MAX_TRIALS + 1}, "trials"),
        ({"candidates": 1}, "candidates"),
        ({"new_tokens": 1}, "new_tokens"),
        ({"new_tokens": P.MAX_NEW_TOKENS + 1}, "new_tokens"),
        ({"defences": ("none", "rot13")}, "defences"),
        ({"questions": ("", "x")}, "questions"),
    ):
        with pytest.raises(ValueError, match=word):
            P.measure(server.thread, **kw)


# ------------------------------------------------------------------ the attack's parts
def test_token_text_sizes_add_up_to_the_answer(server):
    tok = server.thread.tokenizer
    ids = tok.encode("Paged attention reads K/V in blocks. Café, naïve — ünïcode!", add_special_tokens=False)
    sizes = P.token_text_sizes(tok, ids)
    assert sum(sizes) == P.text_bytes(tok.decode(ids))


@given(st.lists(st.integers(1, 12), min_size=2, max_size=20), st.integers(100, 300), st.integers(0, 40))
@settings(max_examples=60, deadline=None)
def test_alignment_is_exact_for_the_true_answer(sizes, k, k_last):
    records = [s + k for s in sizes]
    records[-1] += k_last
    assert P.calibrate(records, sizes) == (k, k_last)
    assert P.align_cost(records, sizes, k, k_last) == 0
    assert P.recover_lengths(records, k, k_last) == sizes
    # tokens merged two by two still align at no cost
    merged = [sizes[i] + (sizes[i + 1] if i + 1 < len(sizes) else 0) + k for i in range(0, len(sizes), 2)]
    merged[-1] += k_last
    assert P.align_cost(merged, sizes, k, k_last) == 0


def test_best_match_and_its_limits():
    rng = random.Random(0)
    cands = [[3, 5, 2, 7], [3, 5, 2, 6], [1, 1, 1, 1]]
    records = [s + 200 for s in cands[1]]
    assert P.best_match(records, cands, 200, 0, rng) == 1
    assert P.align_cost(records[:1], cands[0], 200, 0, max_group=2) == math.inf  # 4 tokens can't fit one record
    assert P.align_cost([], cands[0], 200, 0) == math.inf
    assert P.calibrate([210, 211], [3]) is None  # counts differ: a merged chunk


def test_vocab_bits(server):
    counts = P.vocab_length_counts(server.thread.tokenizer)
    common = counts.most_common(1)[0][0]
    rare = min(counts, key=counts.get)
    assert 0 < P.vocab_bits(common, counts) < P.vocab_bits(rare, counts)
    assert P.vocab_bits(10**6, counts) == 0.0
