"""ui/figures/fleet.py: the Fleet page's views, as pure functions of a hand-made FleetSnapshot."""

from __future__ import annotations

from engine.fleet.state import (
    NO_HIT_ELSEWHERE,
    NO_HIT_EVICTED,
    NO_HIT_NEVER_STORED,
    FleetSnapshot,
    FleetTrace,
    InstanceStatus,
    PolicyRun,
    PrefixTree,
    RequestRow,
    StreamHealth,
    TreeNode,
    WhatIfRow,
)
from ui.figures import fleet as F

EVIL = "<img src=x onerror=alert(1)>"


def _snapshot() -> FleetSnapshot:
    # a chain r -> a -> {b, c}: r and a on both instances, b only on e0, c only on e1;
    # x's parent is cached nowhere
    nodes = (
        TreeNode("r0", "", 16, ("e0", "e1"), 0),
        TreeNode("a1", "r0", 16, ("e1", "e0"), 1),
        TreeNode("b2", "a1", 16, ("e0",), 2),
        TreeNode("c2", "a1", 16, ("e1",), 2),
        TreeNode("x9", "gone", 16, ("e1",), -1),
    )
    tree = PrefixTree(nodes, duplicated_blocks=2, duplicated_bytes=2 * 4096, bytes_per_block=4096)
    up = InstanceStatus(
        "http://127.0.0.1:9001",
        "e0",
        up=True,
        kv_usage=0.25,
        running=2,
        waiting=1,
        prefix_hit_rate=0.5,
        prefix_queries=200,
        prefix_hits=100,
        preemptions=3,
        block_size=16,
        num_blocks=64,
        cached_blocks=3,
        stream=StreamHealth(
            connected=True,
            encoding="msgpack",
            batches=10,
            events=25,
            last_seq=9,
            seq_gaps=1,
            replays=1,
            replayed_batches=2,
            clears=0,
            missed=3,
        ),
    )
    down = InstanceStatus(
        "http://127.0.0.1:9002",
        "e1",
        up=False,
        reason=f"connection refused {EVIL}",
        cached_blocks=4,
        stream=StreamHealth(connected=False, error=f"timeout {EVIL}"),
    )
    return FleetSnapshot(5.0, (up, down), tree, "http://127.0.0.1:9000", "kv_aware")


def _rows() -> list[RequestRow]:
    return [
        RequestRow(
            "r-1",
            1.0,
            "kv_aware",
            "e0",
            400,
            {"e0": 384, "e1": 0},
            "e0",
            384,
            384,
            384,
            "",
            0.05,
            conversation=EVIL,
            turn=2,
        ),
        RequestRow("r-2", 2.0, "round_robin", "e1", 400, {"e0": 384, "e1": 0}, "e0", 384, 0, None, NO_HIT_ELSEWHERE),
        RequestRow("r-3", 3.0, "round_robin", "e0", 400, {"e0": 0, "e1": 0}, "", 0, 0, None, NO_HIT_NEVER_STORED),
        RequestRow("r-4", 4.0, "kv_aware", "e1", 400, {"e0": 0, "e1": 0}, "", 0, 0, 16, NO_HIT_EVICTED),
    ]


def _runs() -> list[PolicyRun]:
    return [
        PolicyRun("round_robin", 12, 0, 0.31, 0.2, 0.9, 40.0, 10.0, {"e0": 6, "e1": 6}, 9, 1, 0.5, "release-freeze"),
        PolicyRun("kv_aware", 12, 1, 0.72, 0.1, 0.4, 55.0, 8.0, {"e0": 9, "e1": 3}, 2, 0, 1.0, "release-freeze"),
    ]


def test_instances_table_shows_state_numbers_and_stream_health_escaped():
    h = F.instances_html(_snapshot())
    assert "▲ up" in h and "▼ down" in h
    assert EVIL not in h and "&lt;img src=x onerror=alert(1)&gt;" in h
    assert "25.0 %" in h and "2 · 1" in h and "50.0 %" in h and "100 / 200 tok" in h
    assert "<td class='n'>16</td>" in h and "of 64" in h
    assert "10<br><span class='sub'>seq 9 · msgpack" in h  # batches, last seq, encoding
    assert (
        "<td class='n'>1<br><span class='sub'>3 missed</span></td><td class='n'>1<br><span class='sub'>2 batches" in h
    )
    assert "events: not connected: timeout" in h
    assert "last seq 9 · 1 gaps (3 seq numbers missed) · 1 replays (2 batches) · 0 clears · msgpack" in (
        F.stream_text(_snapshot().instances[0])
    )


def test_tree_counts_and_duplication_text():
    s = _snapshot()
    c = F.tree_counts(s.tree)
    assert c == dict(
        blocks=5, copies=7, shared_blocks=2, duplicated_blocks=2, duplicated_bytes=8192, bytes_per_block=4096
    )
    t = F.duplication_text(s.tree)
    assert "5 distinct blocks" in t and "7 copies" in t and "2 duplicated blocks" in t and "8.0 KiB" in t
    assert F.duplication_text(PrefixTree()) == "No cached blocks on any instance."


def test_merged_tree_marks_holders_and_hangs_unknown_parents():
    s = _snapshot()
    fig = F.merged_tree_figure(s.tree, F.instance_ids(s))
    d = fig.data[0]
    ids, parents, labels = list(d.ids), list(d.parents), list(d.labels)
    assert ids[0] == F.ROOT and parents[0] == ""
    assert parents[ids.index("r0")] == F.ROOT and parents[ids.index("a1")] == "r0"
    assert parents[ids.index("b2")] == "a1" and parents[ids.index("c2")] == "a1"
    assert parents[ids.index("x9")] == F.UNKNOWN_PARENT and parents[ids.index(F.UNKNOWN_PARENT)] == F.ROOT
    assert labels[ids.index("r0")] == "e0+e1 ×2" and labels[ids.index("b2")] == "e0"
    colors = F.instance_colors(["e0", "e1"])
    cols = list(d.marker.colors)
    assert cols[ids.index("a1")] == F.SHARED_COLOR
    assert cols[ids.index("b2")] == colors["e0"] and cols[ids.index("c2")] == colors["e1"]
    assert "2 duplicated" in fig.layout.title.text
    # drawing fewer nodes than the tree has says so; a kept child whose parent was cut is not lost
    fig = F.merged_tree_figure(s.tree, ["e0", "e1"], max_drawn=2)
    assert len(fig.data[0].ids) == 3 and "2 of 5" in fig.layout.title.text


def test_holdings_split_unique_and_shared_per_instance():
    fig = F.holdings_figure(_snapshot())
    only, shared = fig.data
    assert list(only.y) == ["e0", "e1"]
    assert list(only.x) == [1, 2]  # e0: b2; e1: c2, x9
    assert list(shared.x) == [2, 2]  # r0, a1 on both


def test_ledger_marks_server_best_holder_outcomes_and_escapes():
    s = _snapshot()
    h = F.ledger_html(_rows(), F.instance_ids(s))
    assert EVIL not in h and "&lt;img" in h
    assert h.index("r-4") < h.index("r-1")  # newest first
    assert "font-weight:700'>384 ★" in h  # r-1: served by e0, the best holder
    assert "384 =" in h  # router credit equals the reported cached tokens
    assert "16 ≠" in h
    assert F.NO_HIT_SHORT[NO_HIT_NEVER_STORED] in h
    assert F.NO_HIT_SHORT[NO_HIT_EVICTED] in h
    assert "held on e0 (384), sent elsewhere" in h
    assert "hit 384 / 400" in h
    assert "newest 2 of 4" in F.ledger_html(_rows(), ["e0", "e1"], limit=2)
    c = F.ledger_counts(_rows())
    assert c["requests"] == 4 and c["hits"] == 1
    assert (c["never_stored"], c["evicted"], c["held_elsewhere"]) == (1, 1, 1)
    assert (c["credit_known"], c["credit_equal"]) == (2, 1)
    assert (c["on_best"], c["with_holder"]) == (1, 2)


def test_policy_views_put_runs_side_by_side():
    runs = _runs()
    h = F.policy_table_html(runs)
    assert h.index("round_robin") < h.index("kv_aware")
    assert "31.0 %" in h and "72.0 %" in h and "900 ms" in h and "e0 9 · e1 3" in h and "12 (1)" in h
    fig = F.policy_figure(runs, ["e0", "e1"])
    assert [t.name for t in fig.data[:2]] == ["TTFT p50", "TTFT p99"] and list(fig.data[1].y) == [900.0, 400.0]
    inst = [t for t in fig.data if t.legendgroup == "inst"]
    assert [t.name for t in inst] == ["e0", "e1"]
    assert list(inst[0].base) == [0, 0] and list(inst[1].base) == [6, 9]  # stacked
    assert F.policy_table_html([]) == ""


def test_whatif_is_labelled_a_replay_on_every_row():
    rows = [
        WhatIfRow("round_robin", requests=10, hit_tokens=100, prompt_tokens=400, hit_rate=0.25, note=EVIL),
        WhatIfRow("llmd_longest_prefix", requests=10, hit_tokens=300, prompt_tokens=400, hit_rate=0.75),
    ]
    h = F.whatif_html(rows)
    assert F.REPLAY_LABEL in h
    assert h.count("<span class='kv-replay'>replay</span>") == 2
    fig = F.hit_rate_figure(_runs(), rows)
    measured, replayed = fig.data
    assert list(measured.y) == ["measured: round_robin", "measured: kv_aware"] and list(measured.x) == [31.0, 72.0]
    assert replayed.name == F.REPLAY_LABEL and list(replayed.y) == ["replay: round robin", "replay: llm-d prefix"]
    assert list(replayed.x) == [25.0, 75.0] and replayed.marker.pattern.shape == "/"
    assert EVIL not in h and "25.0 %" in h and "300 of 400" in h
    assert F.whatif_html([]) == ""


def test_timeline_reads_every_snapshot_and_round_trips_through_a_trace():
    s = _snapshot()
    later = FleetSnapshot(6.0, s.instances, PrefixTree(s.tree.nodes[:1]), s.router, s.policy)
    trace = FleetTrace.from_json(FleetTrace((s, later), tuple(_rows()), tuple(_runs())).to_json())
    fig = F.timeline_figure(trace.snapshots)
    names = [t.name for t in fig.data]
    assert names == ["e0 KV usage", "e1 KV usage", "duplicated blocks"]
    assert list(fig.data[0].y) == [25.0, 25.0] and list(fig.data[1].y) == [None, None]  # e1 is down
    assert list(fig.data[2].y) == [2, 0]
