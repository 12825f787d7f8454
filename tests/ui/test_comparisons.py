"""ui/figures/allocators.py, cache_cost.py, exercise.py and prefix_sharing.py: summaries and
figures carry the numbers of the Snapshots they are given
(hand-built test data here; the pages feed them real engine runs)."""

from dataclasses import replace

import pytest

from engine.lab import experiments
from engine.observe import recording
from engine.observe.snapshot import EngineMetrics, RequestInfo, Snapshot
from engine.observe.trace_events import Event
from tests.factories import make_engine_info
from ui.figures import allocators as AL
from ui.figures import cache_cost as CC
from ui.figures import exercise as EX
from ui.figures import prefix_sharing as PS


def info(num_blocks=10, block_size=16, allocator="paged"):
    return make_engine_info(
        num_blocks=num_blocks,
        block_size=block_size,
        allocator=allocator,
        max_model_len=64,
        max_num_seqs=8,
        enable_prefix_caching=False,
    )


def req(rid, prompt_len, output_len, state="running"):
    return RequestInfo(
        request_id=rid,
        state=state,
        tier=None,
        prompt_len=prompt_len,
        output_len=output_len,
        num_computed_tokens=prompt_len + output_len,
        num_cached_tokens=0,
        block_table=(),
        slots_allocated=0,
        kv_bytes=0,
    )


def snap(step, alloc, filled, running=1, reqs=(), allocator="paged", **m):
    waste = (1 - filled / alloc) if alloc else 0.0
    return Snapshot(
        step=step,
        time=float(step),
        info=info(allocator=allocator),
        blocks=(),
        requests=tuple(reqs),
        metrics=EngineMetrics(
            slots_allocated=alloc, slots_filled=filled, waste_fraction=waste, num_running=running, **m
        ),
    )


def ev(seq, kind, rid):
    return Event(seq=seq, step=seq, time=0.0, kind=kind, request_id=rid, data={"reason": "x"})


def rec(label, series, events=(), outputs=()):
    return recording.RunRecord(
        label=label, series=list(series), events=list(events), outputs={o: object() for o in outputs}, steps=len(series)
    )


def test_allocator_summary_numbers():
    paged = rec(
        "paged",
        [snap(0, 0, 0, 0), snap(1, 64, 60, 3), snap(2, 80, 78, 4), snap(3, 32, 20, 1)],
        [ev(1, "admit", "a"), ev(2, "admit", "b"), ev(3, "admit", "a"), ev(4, "preempt", "b"), ev(5, "wait", "c")],
        outputs=["a", "b"],
    )
    s = AL.allocator_summary(paged)
    assert s["peak_allocated"] == 80 and s["filled_at_peak"] == 78
    assert s["waste_at_peak"] == pytest.approx(2 / 80)
    assert s["mean_waste"] == pytest.approx(1 - (60 + 78 + 20) / (64 + 80 + 32))
    assert s["admitted"] == 2  # distinct requests, re-admission not double counted
    assert s["peak_running"] == 4 and s["preemptions"] == 1 and s["waits"] == 1
    assert s["finished"] == 2 and s["budget_slots"] == 160
    empty = AL.allocator_summary(rec("x", []))
    assert empty["mean_waste"] == 0.0 and empty["peak_allocated"] == 0


def test_allocator_figures_carry_slots_and_waste():
    a = rec("paged", [snap(0, 16, 10), snap(1, 32, 30)])
    b = rec("contiguous <slab>", [snap(0, 64, 10, allocator="contiguous"), snap(1, 64, 30, allocator="contiguous")])
    fig = AL.allocator_figure(a, b)
    alloc = [t for t in fig.data if t.name == "allocated slots"]
    assert [list(t.y) for t in alloc] == [[16, 32], [64, 64]]
    assert all("<slab>" not in ann.text for ann in fig.layout.annotations)
    bars = AL.allocator_bars(AL.allocator_summary(a), AL.allocator_summary(b))
    waste = [t for t in bars.data if t.x[0] == "mean over run"]
    assert waste[0].y[0] == pytest.approx(100 * (1 - 40 / 48))
    assert waste[1].y[0] == pytest.approx(100 * (1 - 40 / 128))


def test_cost_summary_and_fit():
    assert CC.fit_line([1, 2, 3], [2, 4, 6]) == pytest.approx((2.0, 0.0))
    assert CC.fit_line([5, 5], [1, 3]) == (0.0, 2.0)
    flat = [recording.CostPoint(i, 10 + i, 0.01, 1) for i in range(1, 41)]
    growing = [recording.CostPoint(i, 10 + i, 0.001 * (10 + i), 10 + i) for i in range(1, 41)]
    sf, sg = CC.cost_summary(flat), CC.cost_summary(growing)
    assert sf["slope_s_per_ctx_token"] == pytest.approx(0.0, abs=1e-12) and sf["growth"] == pytest.approx(1.0)
    assert sg["slope_s_per_ctx_token"] == pytest.approx(0.001)
    assert sg["late_step_s"] > sg["early_step_s"] and sg["total_s"] == pytest.approx(sum(p.step_s for p in growing))
    assert CC.cumulative(flat)[-1] == pytest.approx(0.4)
    fig = CC.cost_figure(flat, growing)
    cum = [t for t in fig.data if t.xaxis == "x2"]
    assert cum[1].y[-1] == pytest.approx(sg["total_s"])
    fed = [t for t in fig.data if t.xaxis == "x3"]
    assert fed[0].y[-1] == 40 and fed[1].y[-1] == sum(10 + i for i in range(1, 41))
    assert CC.cumulative_fed(growing)[:2] == [11, 23]
    assert list(fig.data[0].x)[:2] == [11, 12]
    assert CC.cost_summary([])["tokens"] == 0


def test_exercise_demand_vs_budget():
    # budget: 10 blocks x 16 = 160 tokens
    s0 = snap(0, 0, 0, reqs=[req("a", 50, 0, "waiting"), req("b", 50, 0, "waiting")])
    s1 = snap(1, 128, 100, reqs=[req("a", 50, 30), req("b", 50, 20)], num_blocks_used=7)
    s2 = snap(
        2,
        96,
        90,
        reqs=[req("a", 50, 40), req("b", 50, 40, "preempted"), req("c", 50, 40, "finished")],
        num_preemptions_total=1,
        num_finished=1,
        num_blocks_used=6,
    )
    r = rec("LRU", [s0, s1, s2], [ev(1, "preempt", "b"), ev(2, "wait", "b")], outputs=["c"])
    rows = EX.exercise_rows(r)
    assert rows["demand"] == [100, 150, 180]  # finished sequences no longer count
    assert rows["budget"] == [160, 160, 160] and rows["held"] == [0, 112, 96]
    assert EX.first_over_budget(r) == 2
    s = EX.exercise_summary(r)
    assert s["peak_demand"] == 180 and s["over_budget_step"] == 2 and s["preemptions"] == 1
    assert s["waits"] == 1 and s["finished"] == 1 and s["requests"] == 3
    fig = EX.exercise_figure([r, rec("other", [s0])])
    demand = [t for t in fig.data if t.name.startswith("demand")]
    assert list(demand[0].y) == [100, 150, 180]
    assert EX.first_held_over_budget(r) is None and s["held_over_budget_step"] is None
    r.budget_tokens = 100  # engine held 112 slots at step 1
    assert EX.first_held_over_budget(r) == 1
    fig = EX.exercise_figure([r])
    assert any("KV use > budget at step 1" in (a.text or "") for a in fig.layout.annotations)


class FakeOut:
    def __init__(self, rid):
        self.request_id, self.finished = rid, True


class FakeRing:
    def __init__(self):
        self.evs = []

    @property
    def last_seq(self):
        return len(self.evs)

    def since(self, seq):
        return [e for e in self.evs if e.seq > seq]


class FakeEngine:
    """Minimal stand-in with the LLMEngine surface run_engine uses (test-only)."""

    def __init__(self):
        self.events, self.pending, self.step_no = FakeRing(), [], 0

    def add_request(self, rid, prompt, params):
        if prompt == "":
            raise ValueError("prompt must not be empty")
        self.pending.append(rid)
        self.events.evs.append(ev(len(self.events.evs) + 1, "admit", rid))

    def has_unfinished_requests(self):
        return bool(self.pending)

    def step(self):
        self.step_no += 1
        return [FakeOut(self.pending.pop(0))]

    def snapshot(self):
        return snap(self.step_no, 16 * len(self.pending), 10 * len(self.pending), running=len(self.pending))


def test_run_engine_records_every_step_and_rejections():
    eng = FakeEngine()
    seen = []
    r = recording.run_engine(
        eng, [("a", "x", None), ("b", "", None), ("c", "y", None)], label="fake", on_step=lambda i, s: seen.append(i)
    )
    assert r.steps == 2 and seen == [1, 2] and set(r.outputs) == {"a", "c"}
    assert [s.step for s in r.series] == [0, 1, 2]
    assert r.add_errors == ["b: prompt must not be empty"] and not r.truncated
    assert [e.request_id for e in r.events] == ["a", "c"]
    eng2 = FakeEngine()
    r2 = recording.run_engine(eng2, [("a", "x", None), ("b", "y", None)], label="cut", max_steps=1)
    assert r2.truncated and r2.steps == 1


def test_prefix_helpers():
    from engine.observe.snapshot import BlockInfo

    blocks = (
        BlockInfo(0, "used", 3, ("a", "b", "c"), 16),
        BlockInfo(1, "used", 3, ("a", "b", "c"), 16),
        BlockInfo(2, "used", 1, ("a",), 5),
        BlockInfo(3, "cached", 0, (), 16),
    )
    s1 = replace(snap(1, 0, 0), blocks=blocks)
    s0 = replace(snap(0, 0, 0), blocks=blocks[2:])
    st = experiments.sharing_stats(s1)
    assert st == {"shared_blocks": 2, "max_ref": 3, "refs_saved": 4}
    assert (
        experiments.more_shared(s1, s0) is s1
        and experiments.more_shared(s0, s1) is s1
        and experiments.more_shared(None, s0) is s0
    )
    assert experiments.sharing_stats(None)["shared_blocks"] == 0
    hit = [experiments.PrefixRow("h1", 1, 0.05, 100, 96), experiments.PrefixRow("h2", 2, 0.07, 110, 96)]
    miss = [experiments.PrefixRow("m1", 1, 0.20, 100, 0), experiments.PrefixRow("m2", 2, None, 110, 0)]
    sh, sm = PS.prefix_summary(hit), PS.prefix_summary(miss)
    assert sh["hit_rate"] == pytest.approx(192 / 210) and sh["mean_ttft_s"] == pytest.approx(0.06)
    assert sm["hit_rate"] == 0.0 and sm["mean_ttft_s"] == pytest.approx(0.20)
    fig = PS.prefix_figure(hit, miss)
    ttft = [t for t in fig.data if t.legendgroup in ("prefix cache on", "forced misses (fresh cache_salt)")]
    assert list(ttft[0].y) == [pytest.approx(50), pytest.approx(70)] and list(ttft[1].y)[1] is None
    comp = [t for t in fig.data if t.legendgroup == "computed"][0]
    assert list(comp.y) == [4, 14] and list(comp.base) == [96, 96]


def test_exercise_prompts_and_waiting_reasons():
    ps = experiments.exercise_prompts(50, 12)
    assert len(ps) == 50 and all(len(p) == 12 for p in ps)
    assert len({p[0] for p in ps}) == 50 and all(1000 <= t < 40000 for p in ps for t in p)
    s0 = snap(
        0,
        0,
        0,
        reqs=[
            replace(req("a", 5, 0, "waiting"), waiting_reason="no free KV blocks: needs 2, 0 free"),
            replace(req("b", 5, 0, "waiting"), waiting_reason="no free KV blocks: needs 2, 0 free"),
            replace(req("c", 5, 0, "preempted"), waiting_reason="preempted: no free KV blocks"),
        ],
    )
    s1 = snap(1, 0, 0, reqs=[replace(req("a", 5, 0, "waiting"), waiting_reason="no free KV blocks: needs 2, 0 free")])
    r = EX.waiting_reasons(rec("x", [s0, s1]))
    assert r == [("no free KV blocks: needs 2, 0 free", 2), ("preempted", 1)]
    r2 = rec("y", [s0])
    r2.budget_tokens = 50
    assert EX.exercise_rows(r2)["budget"] == [50]
