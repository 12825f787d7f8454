"""ui/figures/load.py and ui/figures/events_table.py: the numbers the load page's figures carry, built from
hand-made Snapshots/Events (test data only; the pages show real engine data)."""

from dataclasses import dataclass, replace

import pytest

from engine.observe import recording
from engine.observe.snapshot import EngineMetrics, HistoryPoint, RequestInfo, Snapshot
from engine.observe.trace_events import Event
from tests.factories import make_engine_info
from ui.figures import events_table as et
from ui.figures import load as L


def req(rid, computed, state="running", history=(), arrival=0.0):
    return RequestInfo(
        request_id=rid,
        state=state,
        tier=None,
        prompt_len=10,
        output_len=computed - 10,
        num_computed_tokens=computed,
        num_cached_tokens=0,
        block_table=(),
        slots_allocated=0,
        kv_bytes=computed * 1536,
        arrival_time=arrival,
        history=tuple(history),
    )


def snap(step, t, reqs=(), num_blocks=64, **m):
    return Snapshot(
        step=step,
        time=t,
        info=make_engine_info(num_blocks=num_blocks),
        blocks=(),
        requests=tuple(reqs),
        metrics=EngineMetrics(**m),
    )


def test_append_snapshot_dedups_and_bounds():
    s = []
    for i in range(50):
        s = recording.append_snapshot(s, snap(i, float(i)), cap=20)
        s = recording.append_snapshot(s, snap(i, float(i)), cap=20)  # repeat: ignored
    assert len(s) <= 20
    steps = [x.step for x in s]
    assert steps == sorted(steps) and steps[0] == 0 and steps[-1] == 49
    assert recording.append_snapshot(s, None) == s


def test_counts_and_kv_usage_carry_the_metrics():
    series = [
        snap(
            1,
            10.0,
            num_running=2,
            num_waiting=5,
            num_preempted=0,
            num_swapped=0,
            num_blocks_used=10,
            num_blocks_cached=3,
        ),
        snap(
            2,
            10.5,
            num_running=3,
            num_waiting=1,
            num_preempted=2,
            num_swapped=1,
            num_blocks_used=30,
            num_blocks_cached=0,
            num_blocks_free=2,
        ),
    ]
    c = L.counts_over_time(series)
    assert c == {"running": [2, 3], "waiting": [5, 1], "preempted": [0, 2], "swapped": [0, 1]}
    fig = L.counts_figure(series)
    by = {t.name: t for t in fig.data}
    assert list(by["preempted"].y) == [0, 2]
    assert list(by["running"].x) == [0.0, 0.5]  # time since the first snapshot
    series[1] = replace(series[1], info=make_engine_info(num_blocks=32))  # budget tightened mid-run
    fig = L.kv_usage_figure(series)
    by = {t.name: t for t in fig.data}
    assert list(by["used by requests"].y) == [10, 30]
    assert list(by["budget (pool size)"].y) == [64, 32]


def test_growth_lines_prefer_history_and_cap():
    h = [
        HistoryPoint(step=i, time=float(i), num_cached_tokens=16 * i, num_blocks=i, kv_bytes=0, phase="decode")
        for i in range(1, 4)
    ]
    s1 = snap(1, 1.0, [req("a", 20), req("b", 50)])
    s2 = snap(2, 2.0, [req("a", 0, state="preempted", history=h), req("c", 30)])
    lines = L.growth_lines([s1, s2])
    assert lines["a"] == ([1.0, 2.0, 3.0], [16, 32, 48])  # history from its latest snapshot
    assert lines["b"] == ([1.0], [50])  # sampled fallback
    capped = L.growth_lines([s1, s2], max_lines=2)
    assert set(capped) == {"b", "a"}  # largest peaks: b 50, a 48
    fig = L.growth_figure([s1, s2], max_lines=2)
    assert len(fig.data) == 2 and "2 largest of 3" in fig.layout.title.text


def test_growth_hover_escapes_request_ids():
    s = snap(1, 1.0, [req("<img src=x onerror=alert(1)>", 20)])
    fig = L.growth_figure([s])
    assert "<img" not in fig.data[0].hovertemplate
    assert "&lt;img" in fig.data[0].hovertemplate


def test_percentiles_match_numpy_linear():
    np = pytest.importorskip("numpy")
    vals = [0.5, 0.1, 0.9, 0.3, 2.0, 0.25, 1.1]
    for p in (50, 90, 99):
        assert L.percentile(vals, p) == pytest.approx(float(np.percentile(vals, p)))
    assert L.percentile([], 50) is None
    assert L.percentile([3.0], 99) == 3.0
    s = snap(1, 0.0, ttft_s=(0.1, 0.2, 0.3, 0.4), e2e_latency_s=(1.0, 3.0))
    p = L.latency_percentiles(s)
    assert p["ttft"][50] == pytest.approx(0.25)
    assert p["e2e"][90] == pytest.approx(2.8)
    assert L.latency_percentiles(None)["ttft"][99] is None
    fig = L.percentiles_figure([snap(0, 0.0), s])
    by = {t.name: t for t in fig.data}
    assert list(by["TTFT p50"].y) == [None, pytest.approx(0.25)]


@dataclass
class WR:
    arrival_s: float
    prompt: str
    max_tokens: int
    tier: str | None = None


def test_feeder_submits_in_arrival_order_and_counts_rejections():
    got = []

    def submit(prompt, params, request_id=None):
        if prompt == "bad":
            raise ValueError("prompt is over the tier 'free' cap of 1024 tokens")
        got.append((request_id, prompt, params))

    reqs = [WR(0.02, "b", 5), WR(0.0, "a", 4), WR(0.03, "bad", 9), WR(0.04, "c", 6)]
    f = recording.LoadFeeder(submit, reqs, make_params=lambda r: r.max_tokens, run_id="t1", time_scale=1.0).start()
    f.join(5)
    st = f.snapshot_status()
    assert st.done and not st.stopped
    assert [p for _, p, _ in got] == ["a", "b", "c"]
    assert [m for _, _, m in got] == [4, 5, 6]
    assert st.submitted == 3 and st.rejected == 1 and "tier 'free' cap" in st.errors[0]
    assert st.request_ids == ["t1-000", "t1-001", "t1-003"]


def test_feeder_stops_promptly_and_is_bounded():
    calls = []
    reqs = [WR(1000.0 + i, "x", 1) for i in range(recording.MAX_LOAD_REQUESTS + 50)]
    f = recording.LoadFeeder(lambda *a, **k: calls.append(1), reqs, make_params=lambda r: None, run_id="t2")
    assert f.status.total == recording.MAX_LOAD_REQUESTS
    f.start()
    f.stop()
    f.join(5)
    assert not f.alive and f.snapshot_status().stopped and calls == []


def test_feeder_stops_on_engine_failure():
    def submit(*a, **k):
        raise RuntimeError("engine thread crashed")

    f = recording.LoadFeeder(submit, [WR(0, "a", 1), WR(0, "b", 1)], make_params=lambda r: None, run_id="t3").start()
    f.join(5)
    st = f.snapshot_status()
    assert st.done and st.submitted == 0 and "RuntimeError" in st.errors[0] and len(st.errors) == 1


# ------------------------------------------------------------------ events table


def ev(seq, kind, rid=None, **data):
    return Event(seq=seq, step=seq, time=seq / 10, kind=kind, request_id=rid, data=data)


def test_filter_events_newest_first_capped():
    evs = [ev(i, "admit" if i % 2 else "preempt", f"r{i}") for i in range(1, 11)]
    out = et.filter_events(evs, kinds=["preempt"], limit=3)
    assert [e.seq for e in out] == [10, 8, 6]
    assert len(et.filter_events(evs, None, limit=100)) == 10
    assert [e.seq for e in et.filter_events(evs, None, request_id="r3")] == [3]
    assert et.count_by_kind(evs) == {"admit": 5, "preempt": 5}


def test_events_html_escapes_everything():
    hostile = "<script>alert(1)</script>"
    evs = [
        ev(1, "preempt", '"><svg onload=alert(1)>', reason=hostile, mode="recompute", blocks_freed=3),
        ev(2, "reject", "r\u202eevil", reason="prompt of 5000 tokens exceeds tier 'free' cap 1024"),
    ]
    out = et.events_html(evs)
    assert "<script>" not in out and "<svg" not in out
    assert "&lt;script&gt;" in out and "&lt;svg onload" in out
    assert "mode=recompute; blocks_freed=3" in out
    assert "exceeds tier &#x27;free&#x27; cap 1024" in out
    rows = et.event_rows(evs)
    assert rows[0]["reason"] == hostile and rows[0]["details"] == "mode=recompute; blocks_freed=3"
    assert "No events" in et.events_html([])


def test_growth_lines_start_at_admission_and_end_at_finish():
    s = [
        snap(1, 1.0, [req("a", 0, state="waiting")]),
        snap(2, 2.0, [req("a", 12)]),
        snap(3, 3.0, [req("a", 0, state="preempted")]),
        snap(4, 4.0, [req("a", 20)]),
        snap(5, 5.0, [req("a", 0, state="finished")]),
        snap(6, 6.0, [req("a", 0, state="finished"), req("b", 0, state="waiting")]),
    ]
    lines = L.growth_lines(s)
    assert lines == {"a": ([2.0, 3.0, 4.0, 5.0], [12, 0, 20, 0])}  # b never held KV: no line


def test_slim_snapshot_drops_growing_fields_keeps_counts():
    from engine.observe.snapshot import BlockInfo, TokenMark

    r = replace(
        req("a", 30),
        tokens=(TokenMark(1, "x"),),
        output_text="secret",
        prompt_preview="p",
        waiting_reason="no free KV blocks",
    )
    s = replace(snap(3, 1.0, [r]), blocks=(BlockInfo(0, "used", 1, ("a",), 16),))
    slim = recording.slim_snapshot(s)
    assert slim.blocks == () and slim.requests[0].tokens == () and slim.requests[0].output_text == ""
    assert slim.requests[0].num_computed_tokens == 30 and slim.requests[0].waiting_reason == "no free KV blocks"
    assert recording.slim_snapshot(s, keep_blocks=True).blocks == s.blocks


class FakeThread:
    """The two EngineThread reads the recorder uses (test-only)."""

    def __init__(self):
        from engine.observe.trace_events import EventRing

        self.events = EventRing(100)
        self.snap = snap(0, 0.0)

    def snapshot(self):
        return self.snap


def test_recorder_collects_new_steps_and_events_bounded():
    th = FakeThread()
    th.events.emit(0, 0.0, "config", None, reason="before the run")
    rec = recording.SnapshotRecorder("R1", start_time=0.5, start_seq=th.events.last_seq)
    rec.poll(th)  # snapshot older than the run start: ignored
    assert rec.series == []
    for i in range(1, 5):
        th.snap = replace(snap(i, float(i), [req("R1-a", 10 * i)]), blocks=())
        th.events.emit(i, float(i), "decode", "R1-a", token=1)
        th.events.emit(i, float(i), "admit" if i == 1 else "preempt", "R1-a", reason="r")
        rec.poll(th)
        rec.poll(th)  # idempotent: same step twice
    assert [s.step for s in rec.series] == [1, 2, 3, 4]
    assert [e.kind for e in rec.events] == ["admit", "preempt", "preempt", "preempt"]  # no decode chatter
    text = rec.trace_text()
    from engine.observe.trace_events import read_trace

    tr = read_trace(text)
    assert [s.step for s in tr.snapshots] == [1, 2, 3, 4] and len(tr.events) == 4
    assert L.run_request_ids_pending(th.snap, ["R1-a", "zz"]) == 0
    th.snap = replace(th.snap, running_ids=("R1-a",))
    assert L.run_request_ids_pending(th.snap, ["R1-a", "zz"]) == 1


def test_percentile_table_html_formats_numbers():
    s = snap(1, 0.0, ttft_s=(0.1, 0.2), e2e_latency_s=(12.0, 14.0))
    html = L.percentile_table_html(L.latency_percentiles(s), L.percentile_counts(s))
    assert "150 ms" in html and "13.0 s" in html and "(n=2)" in html and "—" in html


def test_recorder_starts_over_when_the_engine_is_rebuilt():
    from engine.observe.trace_events import EventRing

    th = FakeThread()
    rec = recording.SnapshotRecorder("R2")
    for i in range(1, 4):
        th.snap = snap(i, float(i))
        th.events.emit(i, float(i), "admit", "R2-a", reason="r")
        rec.poll(th)
    assert len(rec.series) == 3 and len(rec.events) == 3
    th.events, th.snap = EventRing(100), snap(1, 0.2)  # rebuilt: step, clock and seq restart
    th.events.emit(1, 0.2, "config", None, reason="engine started")
    rec.poll(th)
    assert rec.restarts == 1 and [s.step for s in rec.series] == [1] and [e.kind for e in rec.events] == ["config"]
