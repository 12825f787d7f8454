"""engine/fleet/state.py: every dataclass survives to_dict/from_dict and FleetTrace JSON exactly."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.fleet.state import (
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

ids = st.sampled_from(["e0", "e1", "e2"])
hexes = st.text("0123456789abcdef", min_size=1, max_size=16)

nodes = st.builds(
    TreeNode,
    block_hash=hexes,
    parent=hexes | st.just(""),
    token_count=st.integers(0, 64),
    holders=st.lists(ids, max_size=3).map(tuple),
    depth=st.integers(-1, 50),
)
instances = st.builds(
    InstanceStatus,
    url=st.just("http://127.0.0.1:1"),
    engine_id=ids,
    up=st.booleans(),
    reason=st.text(max_size=10),
    kv_usage=st.none() | st.floats(0, 1),
    running=st.none() | st.integers(0, 9),
    stream=st.builds(StreamHealth, seq_gaps=st.integers(0, 5), encoding=st.sampled_from(["", "msgpack"])),
)
rows = st.builds(
    RequestRow,
    request_id=st.text(min_size=1, max_size=8),
    served_by=ids,
    held_at_arrival=st.dictionaries(ids, st.integers(0, 999)),
    cached_tokens=st.none() | st.integers(0, 999),
    no_hit_reason=st.sampled_from(["", "never_stored", "evicted"]),
)
runs = st.builds(
    PolicyRun,
    policy=st.sampled_from(["round_robin", "kv_aware"]),
    per_instance_requests=st.dictionaries(ids, st.integers(0, 50)),
)
whatifs = st.builds(
    WhatIfRow, rule=st.sampled_from(["round_robin", "llmd_longest_prefix"]), hit_tokens=st.integers(0, 99)
)
traces = st.builds(
    FleetTrace,
    snapshots=st.lists(
        st.builds(
            FleetSnapshot,
            t=st.floats(0, 100),
            instances=st.lists(instances, max_size=3).map(tuple),
            tree=st.builds(
                PrefixTree, nodes=st.lists(nodes, max_size=5).map(tuple), duplicated_blocks=st.integers(0, 9)
            ),
        ),
        max_size=3,
    ).map(tuple),
    requests=st.lists(rows, max_size=4).map(tuple),
    runs=st.lists(runs, max_size=2).map(tuple),
    whatif=st.lists(whatifs, max_size=2).map(tuple),
    meta=st.dictionaries(st.text(max_size=5), st.integers()),
)


@settings(max_examples=60, deadline=None)
@given(traces)
def test_trace_round_trips_exactly(tr):
    back = FleetTrace.from_json(tr.to_json())
    assert back == tr
    assert back.to_json() == tr.to_json()


def test_save_load(tmp_path):
    tr = FleetTrace(whatif=(WhatIfRow("round_robin", requests=3),), meta={"model": "tiny"})
    p = tmp_path / "t.json"
    tr.save(p)
    assert FleetTrace.load(p) == tr


def test_holders_are_a_sorted_set():
    assert TreeNode("a", holders=("e1", "e0", "e1")).holders == ("e0", "e1")


def test_whatif_rows_are_always_replays():
    assert WhatIfRow("x").label == "replay"
    with pytest.raises(ValueError, match="label"):
        WhatIfRow.from_dict({"rule": "x", "label": "measured"})


def test_newer_version_is_refused():
    with pytest.raises(ValueError, match="version"):
        FleetTrace.from_dict({"version": 99})
