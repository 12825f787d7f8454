"""Claims (issue 15 item 3): verdicts follow the stated rules; the bench's newest stamped result per
suite is read with its date; a missing result says "not measured yet" with the reason, never a
number; the committed fixture (a real quick bench run on the tiny model) gives a row per claim."""

from __future__ import annotations

import json
from pathlib import Path

from engine.lab import bench_results as BR
from engine.lab import claims as C
from engine.lab import claims_kv as KV

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "bench"


def test_latest_results_picks_newest_stamp_and_skips_junk(tmp_path):
    (tmp_path / "prefix-20260101T000000Z.json").write_text(json.dumps({"model": "a", "fields": {"ttft_cold_s": 1}}))
    (tmp_path / "prefix-20260102T000000Z.json").write_text(json.dumps({"model": "b", "fields": {"ttft_cold_s": 2}}))
    (tmp_path / "cache-20260103T000000Z.json").write_text("{not json")
    (tmp_path / "prefix-latest.json").write_text("{}")
    res = BR.latest_results(tmp_path)
    assert set(res) == {"prefix"}
    assert res["prefix"].model == "b" and res["prefix"].when.day == 2
    assert "2026-01-02 00:00 UTC" in res["prefix"].label


def test_no_results_means_not_measured(tmp_path):
    rows = C.rows_from_bench(BR.latest_results(tmp_path))
    assert [r.key for r in rows] == list(C.CLAIMS)
    bench_rows = [r for r in rows if r.key != "kv_quant"]  # kv_quant also reads the committed assets/ file
    assert all(r.holds is None and r.measured == "—" for r in bench_rows)
    assert all("not measured yet" in r.why or "press Measure" in r.why for r in bench_rows)


def test_rules():
    r = C.memory_bound_row(0.036, 0.0147, 0.0018, 36.6, "x")
    assert r.holds is True and "41 %" in r.why
    assert C.memory_bound_row(0.01, 0.001, 0.002, 1.0, "x").holds is False
    assert C.verify_cost_row({1: 1.05, 4: 1.31, 8: 1.7}, "x").holds is True
    assert C.verify_cost_row({4: 1.6}, "x").holds is False
    # the floor the arithmetic sets: 5 rows x 2.5 ms at the matmul rate against a 6.25 ms one-row pass
    assert C.verify_floor_ratio(4, 0.0025, 0.00625) == 2.0
    assert C.verify_floor_ratio(4, 0.0001, 0.00625) == 1.0  # never below one pass
    r = C.verify_cost_row({4: 2.4}, "x", row_compute_s=0.0025, step_s=0.00625)
    assert r.holds is False and "no less than 2.00× at k=4" in r.why and "however fast" in r.why
    r = C.verify_cost_row({4: 1.2}, "x", row_compute_s=0.0005, step_s=0.00625)
    assert r.holds is True and "no less than 1.00×" in r.why and "however fast" not in r.why
    assert "no less than" not in C.verify_cost_row({4: 1.2}, "x", row_compute_s=None, step_s=0.006).why
    assert C.batching_row({1: 0.04, 8: 0.08}, "x").holds is True  # 4x total, each request slower
    assert C.batching_row({1: 0.04, 8: 0.2}, "x").holds is False  # total only 1.6x
    assert C.batching_row({1: 0.04}, "x").holds is None
    f = {
        "passage_edit_speedup": 2.98,
        "open_ended_speedup": 1.10,
        "passage_edit_acceptance_rate": 0.841,
        "passage_edit_tokens_per_target_pass": 3.6,
        "open_ended_acceptance_rate": 0.15,
    }
    theory = (1 - 0.841**5) / (1 - 0.841)
    r = C.speculation_row(f, "x")
    assert r.holds is True and f"{theory:.2f}" in r.measured
    assert C.speculation_row(dict(f, open_ended_speedup=0.8), "x").holds is False


def test_fixture_rows():
    res = BR.latest_results(FIXTURE)
    assert {"roofline", "memory", "prefix", "speculative", "cache"} <= set(res)
    assert all(b.model == "tiny" for b in res.values())
    rows = {r.key: r for r in C.rows_from_bench(res)}
    for key in ("memory_bound", "verify_cost", "cache", "paged", "prefix", "speculation"):
        assert rows[key].holds is not None, (key, rows[key].why)
        assert "bench" in rows[key].source and "tiny" in rows[key].source
    # no kvquant bench file in the fixture: the row reads the committed measurement (assets/)
    kq = BR.committed_kvquant()
    assert kq is not None and "kvquant.json" in rows["kv_quant"].source
    from engine.lab import recall_grid as RG

    if RG.is_grid(kq.get("recall_grid")):  # the recall grid to the model's context (scripts/kv_recall_grid.py)
        g = kq["recall_grid"]
        ref = RG.recall(g, "fp32")
        assert "fp32 " + "/".join(f"{ref[c]:.2f}" for c in RG.contexts(g)) + ";" in rows["kv_quant"].measured
        assert "recall grid to " in rows["kv_quant"].source
    else:
        base = kq["dtypes"]["fp32"]["recall_by_context"]
        assert "fp32 recall " + "/".join(f"{base[c]:.1f}" for c in sorted(base, key=int)) in rows["kv_quant"].measured
    assert rows["kv_quant"].holds is not None
    m = res["memory"].fields
    assert f"{100 * m['paged_waste']:.1f} %" in rows["paged"].measured


def test_merge_prefers_live():
    bench = [
        C.ClaimRow("batching", *C.CLAIMS["batching"], "—", None, "press Measure", "this page"),
        C.ClaimRow("cache", *C.CLAIMS["cache"], "1", True, "r", "b"),
    ]
    live = [C.batching_row({1: 0.04, 2: 0.05}, "live")]
    out = C.merge(bench, live)
    assert out[0].source == "live" and out[1].source == "b"


def _kvq(short: dict, recall: dict, base=(1.0, 1.0, 1.0, 0.0)) -> dict:
    ctx = ("512", "1024", "2048", "4096")
    out = {"fp32": {"recall_by_context": dict(zip(ctx, base)), "short_top1_agreement": 1.0}}
    for d in short:
        out[d] = {"recall_by_context": dict(zip(ctx, recall[d])), "short_top1_agreement": short[d]}
    return out


def test_kv_quant_row_rule_on_fixed_inputs():
    # int4 loses the 2k needle with 95 % of its short-prompt picks still fp32's: recall breaks first
    first = _kvq(
        {"int8": 0.99, "int4": 0.95, "int2": 0.40},
        {"int8": (1, 1, 1, 0), "int4": (1, 1, 0, 0), "int2": (0, 0, 0, 0)},
    )
    r = C.kv_quant_row(first, "x")
    assert r.holds is True
    assert "needle recall at 512/1k/2k/4k tokens; fp32 recall 1.0/1.0/1.0/0.0" in r.measured
    assert "int4 recall 1.0/1.0/0.0/0.0, short top-1 0.95" in r.measured
    assert "here int4 loses recall from 2048 tokens with short prompts intact (95%)" in r.why
    # 4096: fp32 recalls nothing there, so a format's 0 at 4096 is no loss
    keep = _kvq({"int8": 0.99, "int4": 0.93}, {"int8": (1, 1, 1, 0), "int4": (1, 1, 1, 0)})
    r = C.kv_quant_row(keep, "x")
    assert r.holds is False and "no format down to int4 loses a needle" in r.why
    # the only format that loses recall has lost short prompts too: they break together
    together = _kvq({"int4": 0.93, "int2": 0.40}, {"int4": (1, 1, 1, 0), "int2": (1, 0, 0, 0)})
    r = C.kv_quant_row(together, "x")
    assert r.holds is False and "int2 40%" in r.why and "break together" in r.why
    # ... and a format that keeps every needle while its short prompts fall: said so
    short_first = _kvq({"int4": 0.79, "int2": 0.12}, {"int4": (1, 1, 1, 0), "int2": (0, 0, 0, 0)})
    r = C.kv_quant_row(short_first, "x")
    assert r.holds is False
    assert "int4 keeps every needle with short prompts at 79%: short prompts degrade first" in r.why
    # the threshold is inclusive: exactly 90 % counts as intact
    edge = _kvq({"int4": 0.9}, {"int4": (1, 0, 1, 0)})
    assert (
        C.kv_quant_row(edge, "x").holds is True
        and KV.recall_breaks_at(edge["int4"]["recall_by_context"], edge["fp32"]["recall_by_context"]) == 1024
    )
    # no sweep in the result (an older kvquant file): not measured, never a verdict
    old = {"fp32": {"needle_recall": 1.0}, "int8": {"needle_recall": 1.0, "token_agreement": 0.73}}
    assert C.kv_quant_row(old, "x").holds is None and "recall_by_context" in C.kv_quant_row(old, "x").why
    blind = _kvq({"int4": 0.95}, {"int4": (0, 0, 0, 0)}, base=(0, 0, 0, 0))
    assert C.kv_quant_row(blind, "x").holds is None
    assert BR.committed_kvquant("/nonexistent.json") is None


def test_packets_row_rule():
    f = {
        "packets_chance": 0.125,
        "packets_none_accuracy": 1.0,
        "packets_none_length_accuracy": 0.8,
        "packets_none_length_chance": 0.18,
        "packets_none_bits_per_token": 2.9,
        "packets_obfuscation_accuracy": 0.08,
        "packets_obfuscation_bytes_ratio": 1.11,
        "packets_coalesce_accuracy": 1.0,
        "packets_coalesce_bytes_ratio": 0.34,
        "packets_fixed_accuracy": 0.1,
        "packets_fixed_bytes_ratio": 1.9,
    }
    r = C.packets_row(f, "x")
    assert r.holds is True
    assert "obfuscation field: 8 % at 1.11× the bytes" in r.measured
    assert "obfuscation field, fixed-size chunks" in r.why and "still above it with tokens coalesced" in r.why
    assert C.packets_row(dict(f, packets_none_accuracy=0.3), "x").holds is False  # below 50 %
    assert C.packets_row(dict(f, packets_none_length_accuracy=0.3), "x").holds is False  # < 2x chance
    assert C.packets_row({}, "x").holds is None


def test_packets_fixture_row():
    res = BR.latest_results(FIXTURE)
    row = {r.key: r for r in C.rows_from_bench(res)}["packets"]
    f = res["packets"].fields
    assert row.holds is not None and "bench 'packets'" in row.source
    assert f"answer picked {100 * f['packets_none_accuracy']:.0f} %" in row.measured


def _weights_fields(q8_tok: float, q4_tok: float, q4_lin: float) -> dict:
    f = {"cpu": "AMD EPYC", "cpu_simd": "AVX2", "weights_mem_bw_gb_s": 10.0}
    for k, tok, byt, lin in (
        ("fp32", 10.0, 540e6, 50.0),
        ("q8_0", q8_tok, 150e6, 18.0),
        ("q4_1", q4_tok, 96e6, q4_lin),
    ):
        f.update(
            {
                f"weights_{k}_tok_s": tok,
                f"weights_{k}_bytes_per_step": byt,
                f"weights_{k}_weights_ms": lin,
                f"weights_{k}_read_floor_ms": byt / 1e10 * 1e3,
                f"weights_{k}_step_ms": 1e3 / tok,
                f"weights_{k}_rest_ms": 5.0,
            }
        )
    return f


def test_weights_row_rule():
    # bytes 540 / 150 / 96 MB: 3.6x and 5.6x fewer than fp32, Q4_1 1.56x fewer than Q8_0
    r = C.weights_row(_weights_fields(q8_tok=33.0, q4_tok=52.0, q4_lin=9.0), "x")
    assert r.holds is True and "3.60× fewer bytes, 3.30× the speed (follows)" in r.why
    assert "What bounds it" not in r.why
    slow = C.weights_row(_weights_fields(q8_tok=30.0, q4_tok=31.0, q4_lin=24.0), "x")
    assert slow.holds is False and "Q4_1 vs Q8_0: 1.56× fewer bytes, 1.03× the speed (does not follow)" in slow.why
    # Q4_1's Linears take 24 ms where its 96 MB read at 10 GB/s takes 9.6 ms: the codes bound it
    assert "Q4_1: the Linears take 24.0 of 32.3 ms a step" in slow.why
    assert "converting the codes to floats, not the bytes, bounds them" in slow.why
    assert "AVX2" in slow.measured and "shared" in slow.measured
    assert C.weights_row({}, "x").holds is None
