"""The Claims page's fleet row (engine/lab/claims.py: fleet_row) from bench fleet's fields."""

from __future__ import annotations

import json

from engine.lab import bench_results as BR
from engine.lab import claims as C


def test_fleet_row_names_the_policies_that_hold():
    f = {"round_robin_hit_rate": 0.44, "kv_aware_hit_rate": 0.67, "cache_aware_hit_rate": 0.49, "fleet_model": "tiny"}
    row = C.fleet_row(f, "bench 'fleet'")
    assert row.key == "fleet_prefix" and row.holds is True
    assert "round_robin 44 %" in row.measured and "kv_aware 67 %" in row.measured
    assert "held under kv_aware" in row.why and "not under round_robin, cache_aware" in row.why


def test_fleet_row_fails_when_no_policy_reaches_half():
    row = C.fleet_row({"round_robin_hit_rate": 0.2, "kv_aware_hit_rate": 0.45}, "s")
    assert row.holds is False and "held under no policy" in row.why


def test_rows_from_bench_reads_the_newest_fleet_result(tmp_path):
    (tmp_path / "fleet-20261203T185400Z.json").write_text(
        json.dumps(
            {
                "suite": "fleet",
                "quick": True,
                "model": "default",
                "fields": {"round_robin_hit_rate": 0.4, "kv_aware_hit_rate": 0.7, "cache_aware_hit_rate": 0.6},
            }
        )
    )
    rows = {r.key: r for r in C.rows_from_bench(BR.latest_results(tmp_path))}
    assert rows["fleet_prefix"].holds is True and "fleet-20261203T185400Z.json" in rows["fleet_prefix"].source
    assert C.rows_from_bench({})[-1].holds is None  # not measured: says how to measure
