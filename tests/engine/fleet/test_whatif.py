"""engine/fleet/whatif.py on small synthetic streams: each rule's choices and hit tokens, by hand."""

from __future__ import annotations

import pytest

from engine.fleet.whatif import RULES, SimCache, StreamRequest, block_keys, replay, replay_all


def req(i, blocks, t=None, dur=0.0, served=""):
    return StreamRequest(f"r{i}", float(i if t is None else t), dur, 16 * len(blocks) + 1, tuple(blocks), served)


def test_block_keys_chain_on_content():
    a = block_keys(list(range(40)), 16)
    b = block_keys(list(range(32)) + [7] * 8, 16)
    assert len(a) == 2 and a == b  # the partial third block is not a block
    assert block_keys([1] * 16 + list(range(16)), 16)[1] != block_keys([2] * 16 + list(range(16)), 16)[1]


def test_round_robin_alternates_and_counts_hits():
    s = [req(0, "AB"), req(1, "AB"), req(2, "AB"), req(3, "AB")]
    row = replay(s, ["x", "y"], "round_robin")
    assert row.label == "replay"
    assert row.per_instance_requests == {"x": 2, "y": 2}
    assert row.hit_tokens == 2 * 32  # requests 2 and 3 find their two blocks


def test_longest_prefix_sticks_to_the_holder():
    s = [req(0, "AB"), req(1, "ABC"), req(2, "ABCD")]
    row = replay(s, ["x", "y"], "llmd_longest_prefix")
    assert row.per_instance_requests == {"x": 3, "y": 0}
    assert row.hit_tokens == 32 + 48


def test_dynamo_cost_spreads_load_when_nothing_is_held():
    # two long unrelated requests in flight at once: the second goes where nothing is in flight
    s = [req(0, "ABCD", t=0.0, dur=10.0), req(1, "EFGH", t=0.1, dur=10.0)]
    row = replay(s, ["x", "y"], "dynamo_overlap_cost")
    assert row.per_instance_requests == {"x": 1, "y": 1}


def test_recorded_rule_follows_the_gateway():
    s = [req(0, "AB", served="y"), req(1, "AB", served="y")]
    row = replay(s, ["x", "y"], "recorded")
    assert row.per_instance_requests == {"x": 0, "y": 2} and row.hit_tokens == 32


def test_lru_capacity_evicts_oldest():
    c = SimCache(2)
    c.store("AB")
    c.store("C")
    assert c.held("AB") == 0 and c.held("C") == 1


def test_every_rule_is_a_labelled_replay_and_bad_rule_is_named():
    rows = replay_all([req(0, "A")], ["x"])
    assert [r.rule for r in rows] == list(RULES) and all(r.label == "replay" for r in rows)
    with pytest.raises(ValueError, match="rule"):
        replay([], ["x"], "magic")
