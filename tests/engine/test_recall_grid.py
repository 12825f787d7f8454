"""engine/lab/recall_grid.py and the kv_quant Claims row on a recall grid: pure functions of
stored numbers (the grid's hits per format, context and depth; short-prompt top-1 agreement)."""

from __future__ import annotations

from engine.lab import bench_results as BR
from engine.lab import claims as C
from engine.lab import recall_grid as RG

CTX = ("1024", "2048", "4096", "8192")
T, F = True, False


def grid(**hits) -> dict:
    """hits: dtype -> one (hit at 0.1, 0.5, 0.9) triple per context of CTX."""
    return {
        "contexts": [int(c) for c in CTX],
        "depths": [0.1, 0.5, 0.9],
        "dtypes": list(hits),
        "hit": {d: dict(zip(CTX, [list(t) for t in rows])) for d, rows in hits.items()},
    }


ALL = ((T, T, T),) * 4
FP32_8K_MISS = ((T, T, T), (T, T, T), (T, T, T), (F, T, T))  # the model itself loses 8k depth 0.1


def test_recall_misses_and_breaks_count_only_needles_fp32_finds():
    g = grid(fp32=FP32_8K_MISS, int8=((T, T, T), (T, T, T), (T, T, T), (F, F, T)), int4=ALL)
    assert RG.is_grid(g) and RG.contexts(g) == list(CTX) and RG.longest(g) == 8192
    assert RG.recall(g, "int8") == {"1024": 1.0, "2048": 1.0, "4096": 1.0, "8192": 1 / 3}
    assert RG.misses(g, "int8") == [(8192, 0.5)]  # 8k depth 0.1: fp32 misses it too, no loss
    assert RG.breaks_at(g, "int8") == (8192, [0.5])
    assert RG.breaks_at(g, "int4") is None
    assert RG.summary(g, "int8") == "loses a needle from 8k tokens (depth 0.5)"
    assert RG.summary(g, "int4") == "keeps every needle fp32 recalls, to 8k tokens"
    assert not RG.is_grid({"hit": {"int8": {}}, "depths": [0.1]}) and not RG.is_grid(None)
    # formats run only the needles fp32 recalls: null elsewhere, counted as not recalled
    n = grid(fp32=FP32_8K_MISS, int8=((T, T, T), (T, T, T), (T, T, T), (None, T, F)))
    assert RG.recall(n, "int8")["8192"] == RG.recall(n, "fp32")["8192"] - 1 / 3
    assert RG.misses(n, "int8") == [(8192, 0.9)]
    # a grid cut short (the run stopped after 4k): only measured contexts count
    cut = grid(fp32=ALL[:3], int4=((T, T, T), (T, F, T), (F, F, T)))
    assert RG.longest(cut) == 4096 and RG.breaks_at(cut, "int4") == (2048, [0.5])


def short(**top1) -> dict:
    return {"fp32": {"short_top1_agreement": 1.0}, **{d: {"short_top1_agreement": v} for d, v in top1.items()}}


def test_kv_quant_row_on_the_grid_recall_breaks_first():
    g = grid(
        fp32=ALL,
        int8=((T, T, T), (T, T, T), (T, T, T), (T, F, T)),
        int4=((T, T, T), (T, F, T), (F, F, T), (F, F, F)),
        int2=((F, F, F),) * 4,
    )
    r = C.kv_quant_row(short(int8=0.96, int4=0.79, int2=0.12), "src", g)
    assert r.holds is True
    assert r.measured == (
        "share of needles (depths 0.1/0.5/0.9) recalled at 1k/2k/4k/8k tokens: fp32 1.00/1.00/1.00/1.00; "
        "int8 1.00/1.00/1.00/0.67, short top-1 0.96; int4 1.00/0.67/0.33/0.00, short top-1 0.79; "
        "int2 0.00/0.00/0.00/0.00, short top-1 0.12"
    )
    assert r.why.startswith("holds if a format loses a needle fp32 recalls (prompts up to 8k tokens) while ≥ 90%")
    assert (
        "here int8 loses a needle from 8k tokens (depth 0.5), short prompts 96%; int4 loses a needle from 2k "
        "tokens (depth 0.5), short prompts 79%; int2 loses needles from 1k tokens (depths 0.1/0.5/0.9), short "
        "prompts 12% — int8's recall breaks with its short prompts intact: recall breaks first"
    ) in r.why


def test_kv_quant_row_on_the_grid_other_verdicts():
    # int8 keeps every needle to 8k; int4 and int2 lose needles but short prompts too: together
    g = grid(fp32=ALL, int8=ALL, int4=((T, T, T), (T, F, T), (T, T, T), (T, T, T)), int2=((F, F, F),) * 4)
    r = C.kv_quant_row(short(int8=0.96, int4=0.79, int2=0.12), "src", g)
    assert r.holds is False
    assert "int8 keeps every needle fp32 recalls, to 8k tokens, short prompts 96%" in r.why
    assert r.why.endswith(
        "every format that loses a needle has lost short prompts too (int4 79%, int2 12%): recall does not break first"
    )
    # none loses a needle; int4 keeps them all with short prompts at 79 %: short prompts degrade first
    r = C.kv_quant_row(short(int8=0.96, int4=0.79), "src", grid(fp32=ALL, int8=ALL, int4=ALL))
    assert r.holds is False
    assert r.why.endswith(
        "no format loses a needle fp32 recalls; "
        "int4 keeps every needle with short prompts degraded: short prompts first"
    )
    # exactly 90 % counts as intact
    edge = grid(fp32=ALL, int4=((T, T, T), (T, T, F), (T, T, T), (T, T, T)))
    assert C.kv_quant_row(short(int4=0.9), "src", edge).holds is True
    # fp32 recalls nothing: no verdict
    blind = grid(fp32=((F, F, F),) * 4, int4=((F, F, F),) * 4)
    assert C.kv_quant_row(short(int4=0.95), "src", blind).holds is None
    # no short-prompt agreement for any format in the grid: not measured
    assert C.kv_quant_row({"fp32": {}}, "src", grid(fp32=ALL, int4=ALL)).holds is None


def test_committed_grid_reaches_the_row():
    kq = BR.committed_kvquant()
    assert kq is not None
    g = kq.get("recall_grid")
    if not RG.is_grid(g):  # the committed file predates the grid: the sweep's row, as before
        return
    r = C.kv_quant_row(kq["dtypes"], "src", g)
    assert r.measured.startswith("share of needles (depths ")
    assert r.holds is not None


def test_bench_kvquant_keeps_the_stored_grid(tmp_path):
    """`bench kvquant` rewrites kvquant.json; the grid, measured apart, stays in it."""
    import json

    from engine.bench import kvquant as KQ

    p = tmp_path / "kvquant.json"
    g = grid(fp32=ALL, int4=ALL)
    p.write_text(json.dumps({"dtypes": {"fp32": {"old": 1}}, "recall_grid": g}))
    KQ.write_asset({"fp32": {"new": 1}}, {}, quick=True, model="default", path=str(p))
    data = json.loads(p.read_text())
    assert data["dtypes"] == {"fp32": {"new": 1}} and data["recall_grid"] == g
    p.write_text("{}")  # no grid before: none after
    KQ.write_asset({"fp32": {}}, {}, quick=True, model="default", path=str(p))
    assert "recall_grid" not in json.loads(p.read_text())
