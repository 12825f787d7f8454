"""Demo chapters (issue 15 item 2) on the committed traces: every chapter is anchored on the
moment the trace's own events or snapshots show, and its caption carries that moment's data."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.observe.trace_events import ADMIT, PREEMPT, PREFIX_HIT, SPEC_FALLBACK, read_trace
from ui.figures import demo as D

TRACES = Path(__file__).resolve().parents[2] / "assets" / "traces"


@pytest.fixture(scope="module")
def rf():
    return read_trace((TRACES / "release-freeze.jsonl").read_text())


@pytest.fixture(scope="module")
def spec():
    return read_trace((TRACES / "speculation.jsonl").read_text())


def test_recorded_on_the_default_model(rf, spec):
    assert rf.snapshots[-1].info.model == "default"
    assert spec.snapshots[-1].info.model == "default"
    assert spec.snapshots[-1].info.speculative


def test_release_freeze_moments_come_from_the_events(rf):
    chs = {c.key: c for c in D.chapters(rf, "release-freeze")}
    assert all(c.moment is not None for c in chs.values()), [c.missing for c in chs.values()]
    pre = min((e for e in rf.events if e.kind == PREEMPT), key=lambda e: e.seq)
    assert chs["preempt"].moment.step == pre.step
    assert chs["preempt"].moment.request_id == pre.request_id
    assert f"The victim is {pre.request_id}" in chs["preempt"].moment.caption
    assert str(pre.data["tokens_to_recompute"]) in chs["preempt"].moment.caption
    hit = min((e for e in rf.events if e.kind == PREFIX_HIT), key=lambda e: e.seq)
    assert chs["prefix"].moment.step == hit.step and chs["prefix"].moment.request_id == hit.request_id
    first = min((e for e in rf.events if e.kind == ADMIT), key=lambda e: e.seq)
    assert chs["grow"].moment.request_id == first.request_id
    # budget crossing: the first snapshot whose demand exceeds the pool, none before it
    cross = chs["crossing"].moment
    s = rf.snapshots[cross.tick]
    assert D.kv_demand_blocks(s) > s.info.num_blocks
    assert all(D.kv_demand_blocks(x) <= x.info.num_blocks for x in rf.snapshots[: cross.tick])
    q = chs["queue"].moment
    assert any(r.state == "waiting" and r.waiting_reason for r in rf.snapshots[q.tick].requests)
    for c in chs.values():  # a chapter's tick is the first snapshot at or after its step
        assert rf.snapshots[c.moment.tick].step >= c.moment.step
        assert c.moment.tick == 0 or rf.snapshots[c.moment.tick - 1].step < c.moment.step


def test_speculation_moments(spec):
    chs = {c.key: c for c in D.chapters(spec, "speculation")}
    fb = min(
        (e for e in spec.events if e.kind == SPEC_FALLBACK and e.data.get("speculating") is False), key=lambda e: e.seq
    )
    assert chs["fallback"].moment.step == fb.step
    assert chs["passage"].moment.request_id == "passage-edit"
    assert chs["break"].moment.request_id.startswith("open-ended")

    # the passage edit's drafts land far more often than the open-ended ones
    def alpha(rid):
        for s in reversed(spec.snapshots):
            r = s.request(rid)
            if r is not None:
                return r.spec_num_accepted_tokens / max(1, r.spec_num_draft_tokens)

    assert alpha("passage-edit") > 2 * alpha(chs["break"].moment.request_id)


def test_current_chapter_and_advance(rf):
    chs = D.chapters(rf, "release-freeze")
    last = max(chs, key=lambda c: c.moment.tick)
    assert chs[D.current_chapter(chs, len(rf.snapshots) - 1)].moment.tick == last.moment.tick
    first_tick = min(c.moment.tick for c in chs)
    assert first_tick == 0 or D.current_chapter(chs, first_tick - 1) is None
    # two moments on one recorded snapshot: the one just picked is the one shown
    twins = [(i, j) for i, a in enumerate(chs) for j, b in enumerate(chs) if i < j and a.moment.tick == b.moment.tick]
    for i, j in twins:
        assert D.current_chapter(chs, chs[i].moment.tick, prefer=i) == i
        assert D.current_chapter(chs, chs[j].moment.tick, prefer=j) == j
    assert D.advance(0, 10, 2.0) == (1, False)
    assert D.advance(8, 10, 4.0) == (9, True)
    assert D.advance(0, 10, 0.5) == (1, False)


def test_missing_moments_say_why(rf):
    from engine.observe.trace_events import Trace

    t = Trace(rf.snapshots[:1], [])
    chs = D.chapters(t, "release-freeze")
    assert all(c.moment is None and c.missing for c in chs)
