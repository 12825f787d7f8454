"""AppTest of the Attach page (pages/attach.py) against stub servers on 127.0.0.1: a vLLM-format
/metrics + KV events stub (the page decodes token text with the engine's tokenizer because the stub
tokenizes with the same one), and a kvscope stub serving a tiny-model engine's recorded snapshot
stream. Waits are bounded loops (hang guards, not timing assertions)."""

from __future__ import annotations

import pytest

from tests.app import helpers as H
from tests.attach_stubs import KvscopeStub, VllmStub, demo_batches, record_stub_run, stub_engine
from tests.waiting import wait_until

pytestmark = pytest.mark.usefixtures("tiny_test_mode")


@pytest.fixture
def attach_page(app_test):
    """factory: the Attach page, run once."""
    return lambda: app_test(page="pages/attach.py").run()


def _attach(at, base, events="", replay="", mode="auto"):
    at.text_input(key="at_base_in").input(base)
    at.text_input(key="at_ev_in").input(events)
    at.text_input(key="at_rp_in").input(replay)
    at.selectbox(key="at_mode_in").select(mode)
    next(b for b in at.button if b.label == "Attach").click()
    return at.run()


def test_attach_to_a_vllm_stub(attach_page):
    from ui.widgets import engine_access as ea

    at = attach_page()
    assert not at.exception
    tok = ea.get_engine().tokenizer
    text_a = tok.encode(
        "The KV cache keeps keys and values of earlier tokens <b>so</b> decoding is fast.", add_special_tokens=False
    )[:8]
    text_b = text_a[:4] + tok.encode(" & <i>more</i> text here", add_special_tokens=False)[:4]
    stub = VllmStub(demo_batches("current", text_a, text_b, 4), tokenizer=tok)
    try:
        at = _attach(at, stub.base_url, stub.events_endpoint, stub.replay_endpoint)
        assert not at.exception, [e.value for e in at.exception]
        sess = at.session_state["at_session"]
        assert sess.kind == "vllm"
        assert sess.events_bind  # vLLM's publisher connects to a concrete endpoint: this side binds
        wait_until(
            lambda: (
                (stub.pump() or True)
                and sess.event_state is not None
                and sess.event_state.last_seq == 2
                and len(sess.history) >= 2
                and sess.tokenizer_ok
            ),
            "the stub's batches, two scrapes and the tokenizer check",
        )
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        assert H.metric(at, "KV cache usage") == "25.0 %"
        assert H.metric(at, "Prefix hit rate (10 s)") == "40.0 %"
        assert H.metric(at, "TTFT p50") == "50 ms"
        titles = [s["layout"]["title"]["text"] for s in H.plotly_specs(at)]
        assert any(t.startswith("Acceptance per draft position") for t in titles)
        tree = next(s for s in H.plotly_specs(at) if s["layout"]["title"]["text"].startswith("Prefix cache rebuilt"))
        assert "2 cached blocks, 1 chains" in tree["layout"]["title"]["text"]
        labels = tree["data"][0]["labels"]
        assert any("&lt;" in lab or "&amp;" in lab for lab in labels[1:]), labels  # decoded and escaped
        assert not any("<i>" in h or "<b>so" in h for h in tree["data"][0]["hovertext"])
        assert not at.warning, [w.value for w in at.warning]  # nothing missing on this stub
        assert any("Server block size: **16 tokens** (from vllm:cache_config_info)" in c.value for c in at.caption)
        assert any("events socket tcp://127.0.0.1:" in c.value and "bind: vLLM connects" in c.value for c in at.caption)
    finally:
        at.session_state["at_session"].stop()
        stub.close()


def test_attach_to_a_vllm_stub_without_events_or_spec_notes_what_is_missing(attach_page):
    at = attach_page()
    stub = VllmStub([], spec=False, sources_route=False)
    try:
        at = _attach(at, stub.base_url)
        sess = at.session_state["at_session"]
        wait_until(lambda: len(sess.history) >= 1, "a first scrape")
        at.run()
        notes = " ".join(w.value for w in at.warning)
        assert "speculative acceptance per position" in notes and "no KV events endpoint" in notes
        assert any("No speculative decoding counters" in c.value for c in at.caption)
    finally:
        at.session_state["at_session"].stop()
        stub.close()


def test_attach_to_a_kvscope_stub(attach_page):
    from engine.observe.kv_event_wire import published_hash
    from engine.observe.kv_events import KVEventPublisher

    eng = stub_engine()
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")  # the engine's real events
    pub.attach(eng)
    frames = record_stub_run(eng)
    pub.flush()
    cached = {published_hash(h) for h in eng.bm.hash_to_block}
    stub = KvscopeStub(frames)
    at = attach_page()
    try:
        at = _attach(at, stub.base_url, pub.endpoint, pub.replay_endpoint)
        assert not at.exception, [e.value for e in at.exception]
        sess = at.session_state["at_session"]
        last = frames[-1][0]
        wait_until(  # a late subscriber: rebuilt from the replay buffer
            lambda: sess.snapshot is not None and sess.snapshot.step == last.step and sess.tree.hashes() == cached,
            "the last frame and the cached hashes",
        )
        at.run()
        tree = next(s for s in H.plotly_specs(at) if s["layout"]["title"]["text"].startswith("Prefix cache rebuilt"))
        assert f"{len(cached)} cached blocks" in tree["layout"]["title"]["text"]
        assert any("token text decoded: the server runs the same tokenizer" in c.value for c in at.caption)
        assert not at.exception, [e.value for e in at.exception]
        m = last.metrics
        assert H.metric(at, "KV blocks used") == f"{m.num_blocks_used} / {last.info.num_blocks}"
        assert H.metric(at, "Preemptions") == str(m.num_preemptions_total)
        specs = H.plotly_specs(at)
        pool_map = next(s for s in specs if "used" in s["layout"]["title"]["text"] and s["data"][0].get("z"))
        cells = [v for row in pool_map["data"][0]["z"] for v in row if v is not None]
        assert len(cells) == last.info.num_blocks
    finally:
        at.session_state["at_session"].stop()
        stub.close()
        pub.close()


def test_bad_url_is_an_error_not_a_crash(attach_page):
    at = attach_page()
    at = _attach(at, "ftp://nowhere")
    assert not at.exception
    assert any("base URL" in e.value for e in at.error)


@pytest.mark.parametrize("publisher,by_rank", [("connect", False), ("bind", False), ("connect", True)])
def test_attach_finds_the_events_endpoint_from_kv_event_sources(publisher, by_rank, attach_page):
    """No endpoint typed: the page reads vLLM's GET /kv_event_sources. A publisher that connects
    (vLLM with a concrete endpoint) is bound by auto; one that binds 127.0.0.1 needs "connect"."""
    from ui.widgets import engine_access as ea

    at = attach_page()
    tok = ea.get_engine().tokenizer
    text_a = tok.encode("Shared prefix blocks are stored once and reused by later requests.", add_special_tokens=False)
    stub = VllmStub(
        demo_batches("legacy", text_a[:8], text_a[:4] + text_a[8:12], 4),
        tokenizer=tok,
        publisher=publisher,
        sources_by_rank=by_rank,
    )
    try:
        at = _attach(at, stub.base_url, mode="auto" if publisher == "connect" else "connect")
        assert not at.exception, [e.value for e in at.exception]
        sess = at.session_state["at_session"]
        assert sess.events_endpoint == stub.events_endpoint and sess.replay_endpoint == stub.replay_endpoint
        assert sess.events_bind == (publisher == "connect")
        wait_until(
            lambda: (stub.pump() or True) and sess.event_state is not None and sess.event_state.last_seq == 2,
            "the stub's batches up to seq 2",
        )
        assert len(sess.tree) == 2 and sess.tree.block_size == 4
        assert sess.event_error is None
    finally:
        at.session_state["at_session"].stop()
        stub.close()


def test_events_socket_mode_follows_vllms_bind_rule():
    from ui.servers.attach import events_socket_mode, reachable_endpoint

    assert events_socket_mode("auto", "vllm", "tcp://127.0.0.1:5557")[0] is True
    assert events_socket_mode("auto", "vllm", "tcp://*:5557")[0] is False
    assert events_socket_mode("auto", "vllm", "ipc:///tmp/kv")[0] is False
    assert events_socket_mode("auto", "kvscope", "tcp://127.0.0.1:5557")[0] is False
    assert events_socket_mode("bind", "kvscope", "tcp://*:5557")[0] is True
    with pytest.raises(ValueError, match="KV events socket: expected one of auto, bind, connect"):
        events_socket_mode("listen", "vllm", "tcp://127.0.0.1:5557")
    assert reachable_endpoint("tcp://*:5557", "http://127.0.0.1:8000") == "tcp://127.0.0.1:5557"
    assert reachable_endpoint("tcp://10.1.2.3:5557", "http://127.0.0.1:8000") == "tcp://10.1.2.3:5557"
