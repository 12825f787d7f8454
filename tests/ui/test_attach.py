"""ui/servers/attach.py against stub servers on 127.0.0.1: a vLLM-format /metrics + KV events (both wire
forms) and a kvscope snapshot stream recorded from a real tiny-model engine. Waits are bounded
loops of short sleeps (hang guards, never timing assertions)."""

import pytest

from tests.attach_stubs import KvscopeStub, VllmStub, demo_batches, record_stub_run, stub_engine
from tests.waiting import wait_until
from ui.servers import attach as A

A_TOK = list(range(100, 108))
B_TOK = list(range(100, 104)) + [7, 7, 7, 7]


class ByteTokenizer:
    """encode/decode over UTF-8 bytes: enough to exercise the tokenizer-match probe."""

    def __init__(self, shift=0):
        self.shift = shift

    def encode(self, text, add_special_tokens=True):
        return [b + self.shift for b in text.encode()]

    def decode(self, ids):
        return bytes(i - self.shift for i in ids if 0 <= i - self.shift < 256).decode("utf-8", "replace")


@pytest.mark.parametrize("wire", ["current", "legacy"])
def test_vllm_stub_scrapes_and_rebuilds_the_prefix_tree(wire):
    stub = VllmStub(demo_batches(wire, A_TOK, B_TOK, 4), tokenizer=ByteTokenizer())
    s = A.AttachSession(
        stub.base_url, None, stub.events_endpoint, stub.replay_endpoint, interval=0.1, tokenizer=ByteTokenizer()
    )
    try:
        assert s.kind == "vllm"

        def done():
            stub.pump()
            st = s.event_state
            return st is not None and st.last_seq == 2 and len(s.history) >= 3

        wait_until(done, "the stub's three batches applied")
        with s.lock:
            assert s.tree.hashes() == {1, 3} and s.tree.nodes[3].tokens == (7, 7, 7, 7)
            assert s.event_state.wires == {wire} and s.event_state.decode_errors == 0
        assert s.tokenizer_ok, s.tokenizer_reason
        v = s.vllm_view()
        assert v["notes"] == [] and v["acceptance"] == [(0, 0.8), (1, 0.5), (2, 0.25)]
        assert v["rows"][-1].kv_usage == 0.25 and v["rows"][-1].hit_rate == pytest.approx(0.4)
        # the page stops refreshing (a background tab): the session pauses, then resumes where it was
        idle, s.idle_timeout = s.idle_timeout, 0.0  # no touch() since: idle at once
        wait_until(lambda: not s.alive, "the session to stop on its own")
        s.idle_timeout = idle
        n = len(s.history)
        assert s.resume() and s.alive
        wait_until(lambda: (stub.pump() or True) and len(s.history) > n, "a scrape after resume")
        with s.lock:
            assert s.tree.hashes() == {1, 3} and s.tree.nodes[1].reports == 1  # nothing applied twice
            assert s.event_state.last_seq == 2
    finally:
        s.stop()
        s.join()
        stub.close()
    assert not s.alive


def test_missing_metrics_and_events_degrade_with_notes_and_idle_stops():
    stub = VllmStub([], spec=False, itl=False, sources_route=False)
    s = A.AttachSession(stub.base_url, interval=0.1, idle_timeout=0.5, tokenizer=ByteTokenizer(shift=1))
    try:
        wait_until(lambda: len(s.history) >= 1, "a first scrape")
        v = s.vllm_view()
        assert any("inter-token latency, speculative acceptance per position" in n for n in v["notes"])
        assert any("no KV events endpoint" in n for n in v["notes"])
        assert v["acceptance"] == [] and v["rows"][-1].itl == {}
        wait_until(lambda: s.tokenizer_reason != "not checked", "the tokenizer check")
        assert not s.tokenizer_ok  # the stub has no /tokenize: no decoded text
        wait_until(lambda: not s.alive, "the idle session to stop")  # nobody touched it: it stopped by itself
        s.stop()
        assert not s.resume()  # stopped by the user: stays stopped
    finally:
        s.stop()
        stub.close()


def test_api_key_and_bad_urls():
    stub = VllmStub([], api_key="sekret")
    try:
        with pytest.raises(ValueError, match="API key"):
            A.AttachSession(stub.base_url)
        s = A.AttachSession(stub.base_url + "/v1/", "sekret", interval=0.1)
        assert s.kind == "vllm" and s.base_url == stub.base_url
        s.stop()
        s.join()
    finally:
        stub.close()
    for bad, msg in (("", "base URL"), ("ftp://x", "http"), ("http://h:99999", "port"), ("http://", "http")):
        with pytest.raises(ValueError, match=msg):
            A.normalise_base_url(bad)
    with pytest.raises(ValueError, match="KV events endpoint"):
        A.AttachSession("http://127.0.0.1:9", events_endpoint="http://x", kind="vllm")


def test_sse_parsing():
    lines = [b": comment\n", b'data: {"a":\n', b"data: 1}\n", b"\n", b"data: x\n"]
    assert list(A.iter_sse(lines)) == ['{"a":\n1}', "x"]
    with pytest.raises(ValueError):
        A.parse_stream_message("[1]")


def test_kvscope_stub_stream_gives_snapshots_and_events():
    eng = stub_engine()
    frames = record_stub_run(eng)
    stub = KvscopeStub(frames)
    s = A.AttachSession(stub.base_url, interval=0.2)
    try:
        assert s.kind == "kvscope"
        last = frames[-1][0]
        n_events = sum(len(e) for _, e in frames)
        wait_until(
            lambda: s.snapshot is not None and s.snapshot.step == last.step and len(s.events) == n_events,
            "the last frame and every event",
        )
        with s.lock:
            assert s.snapshot == last and [e.seq for e in s.events] == [e.seq for _, es in frames for e in es]
            assert s.last_event_seq == eng.events.last_seq and s.stream_mode == "stream"
            assert len(s.series) >= 1
    finally:
        s.stop()
        s.join()
        stub.close()
