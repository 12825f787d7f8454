"""ui/figures/replay.py: trace loading (bad files get the reader's message) and tick views."""

import pytest

from engine.observe.snapshot import EngineMetrics, Snapshot
from engine.observe.trace_events import Event, trace_to_string
from tests.factories import make_engine_info
from ui.figures import replay as R


def info():
    return make_engine_info(model="tiny<b>", num_blocks=8, max_model_len=64, max_num_seqs=8)


def snaps(n=4):
    return [
        Snapshot(step=i * 2, time=0.5 * i, info=info(), blocks=(), requests=(), metrics=EngineMetrics(num_running=i))
        for i in range(n)
    ]


def evs():
    return [
        Event(
            seq=i + 1,
            step=i,
            time=0.1 * i,
            kind="admit" if i % 2 == 0 else "preempt",
            request_id=f"r{i}",
            data={"reason": "test"},
        )
        for i in range(7)
    ]


def test_roundtrip_and_tick_views():
    data = trace_to_string(snaps(), evs()).encode()
    tr = R.load_trace_bytes(data)
    assert len(tr.snapshots) == 4 and len(tr.events) == 7
    v = R.view_at(tr, 1)
    assert v.tick == 1 and v.snapshot.step == 2 and [s.step for s in v.series] == [0, 2]
    assert [e.step for e in v.events] == [0, 1, 2]
    assert R.view_at(tr, 99).tick == 3 and R.view_at(tr, -5).tick == 0
    assert [e.step for e in R.events_between(tr.events, 2, 4)] == [3, 4]
    assert [e.step for e in R.events_between(tr.events, None, 0)] == [0]
    s = R.trace_summary(tr)
    assert s["snapshots"] == 4 and s["last_step"] == 6 and s["duration_s"] == pytest.approx(1.5)
    assert s["event_kinds"] == {"admit": 4, "preempt": 3}
    assert "tiny&lt;b&gt;" in R.summary_html(s)


@pytest.mark.parametrize(
    "data, msg",
    [
        (b"", "empty"),
        (b"\xff\xfe\x00", "UTF-8"),
        (b'{"kind": "kvscope-trace", "version": 1}\n{"kind": "snapshot", "snapshot": {"step": 1', "line 2"),
        (b'{"kind": "pickle"}\n', "header"),
        (b'{"kind": "kvscope-trace", "version": 1}\n', "no snapshot"),
        (
            b'{"kind": "kvscope-trace", "version": 1}\n{"kind": "event", "event": {"seq": 1, "step": 0, '
            b'"time": 0, "kind": "__import__(os)"}}\n',
            "unknown kind",
        ),
    ],
)
def test_bad_traces_give_the_readers_message(data, msg):
    with pytest.raises(ValueError, match=msg):
        R.load_trace_bytes(data)


def test_upload_size_limit():
    with pytest.raises(ValueError, match="over the replay limit"):
        R.load_trace_bytes(b"x" * 2048, max_bytes=1024)


def test_demo_traces_listing(tmp_path):
    assert R.demo_traces(tmp_path / "missing") == {}
    (tmp_path / "b.jsonl").write_text(trace_to_string(snaps(2), []))
    (tmp_path / "a.jsonl").write_text(trace_to_string(snaps(3), []))
    (tmp_path / "notes.md").write_text("x")
    d = R.demo_traces(tmp_path)
    assert list(d) == ["a.jsonl", "b.jsonl"]
    assert len(R.load_demo_trace(d["a.jsonl"]).snapshots) == 3


def test_interesting_tick_prefers_busy_keyframes():
    from dataclasses import replace

    from engine.observe.snapshot import BlockInfo

    ss = snaps(4)
    ss[1] = replace(ss[1], metrics=EngineMetrics(num_running=9))  # busiest, no pool
    ss[2] = replace(ss[2], metrics=EngineMetrics(num_running=5), blocks=(BlockInfo(0, "used", 1, ("a",), 3),))
    tr = R.load_trace_bytes(trace_to_string(ss, []).encode())
    assert R.interesting_tick(tr) == 2
    tr2 = R.load_trace_bytes(trace_to_string(snaps(4), []).encode())
    assert R.interesting_tick(tr2) == 3
