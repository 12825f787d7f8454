"""`bench scaling` (engine/bench/scaling.py, scaling_points.py) and its figure: the grids, every
point's limit from roofline.py's formulas, the stored result's schema and table, the goals, the
figure. No timing is asserted: the end-to-end test runs the tiny model through the suite and
checks the shape of what it stores."""

from __future__ import annotations

import json
import math

import pytest

from engine.bench import cli
from engine.bench import common as C
from engine.bench import roofline as R
from engine.bench import scaling as S
from engine.bench import scaling_points as SP

SMOL = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
)
ROOFS = {"peak_matmul_gflops": 150.0, "mem_bw_gb_s": 20.0, "weight_bytes_read_per_step": 97_000_000}


def test_grids_grow_to_8k_and_64_and_fit_the_model():
    full, quick = SP.grid(), SP.grid(quick=True)
    assert full["lengths"][0] == 128 and full["lengths"][-1] >= 8000
    assert full["concurrency"][0] == 1 and full["concurrency"][-1] == 64
    assert SP.max_len_needed(full) <= 8192  # SmolLM2's own limit
    for g in (full, quick, SP.grid(smoke=True)):
        assert g["lengths"] == sorted(set(g["lengths"])) and g["concurrency"] == sorted(set(g["concurrency"]))
    assert sum(quick["lengths"]) < sum(full["lengths"]) and max(quick["concurrency"]) < 64


def test_limits_come_from_the_roofline_formulas():
    shape = R.ModelShape.from_config(SMOL)
    g = SP.grid()
    lims = S.limits_for(shape, g, ROOFS, 4)
    assert len(lims) == 2 * len(g["lengths"]) + len(g["concurrency"])
    pre = [SP.limit(lims, "prefill", L) for L in g["lengths"]]
    dec = [SP.limit(lims, "decode", L) for L in g["lengths"]]
    for L, v in zip(g["lengths"], pre):
        assert v == pytest.approx(R.workload_flops(shape, [L], 1) / 150e9)
    for L, v in zip(g["lengths"], dec):
        ctx = L + g["new_tokens"] / 2
        assert v == pytest.approx(20e9 / (97_000_000 + shape.kv_token_bytes(4) * ctx))
    assert pre == sorted(pre) and dec == sorted(dec, reverse=True)  # costlier as the work grows
    p, new = g["conc_prompt_len"], g["conc_new_tokens"]
    for n in g["concurrency"]:
        v = SP.limit(lims, "concurrency", n)
        comp = R.compute_roof(shape, 150.0, [p] * n, new)["compute_roof_tok_s"]
        mem = R.memory_roof_tok_s(shape, 20.0, 4, p + new / 2, weight_bytes=97_000_000, batch=n)
        assert v == pytest.approx(min(comp, mem))


def test_memory_roof_batch_and_weight_bytes():
    s = R.ModelShape.from_config(SMOL)
    # the default is the old batch-1, fp32-weights roof
    assert R.memory_roof_tok_s(s, 10.0, 4, 100) == pytest.approx(10e9 / (s.weight_bytes(4) + 100 * 46_080))
    # a batch of 8 reads the weights once and each sequence's K/V
    assert R.memory_roof_tok_s(s, 10.0, 4, 100, weight_bytes=1000, batch=8) == pytest.approx(
        8 * 10e9 / (1000 + 8 * 100 * 46_080)
    )


def test_windows_skip_a_first_block_already_taken():
    base = list(range(10_000))
    taken = set()
    ps, nxt = S.take_windows(base, [128, 512, 2048], taken)
    assert [len(p) for p in ps] == [128, 512, 2048] and [p[0] for p in ps] == [1, 2, 3] and nxt == 4
    assert len(taken) == 3
    # text that repeats itself: a window beginning like an earlier one is skipped
    rep = [7] * 40 + list(range(100, 400))
    ws, _ = S.take_windows(rep, [20, 20, 20], {tuple(range(100, 116))}, start=0)
    assert ws[0][:3] == [7, 7, 7] and ws[1][:1] == [7] and ws[1][:16] != ws[0][:16]
    assert len({tuple(w[:16]) for w in ws}) == 3 and all(w[:16] != list(range(100, 116)) for w in ws)
    with pytest.raises(ValueError, match="no window of 500 tokens"):
        S.take_windows(list(range(100)), [500], set())


def test_every_round_measures_prompts_of_its_own():
    """With rounds, each point is measured once per round on a prompt no other round (and no other
    point) shares a first block with, so no engine's prefix cache serves a later round."""
    from engine.model.models import load_tokenizer

    tok = load_tokenizer("default")
    g = SP.with_overrides(SP.grid(quick=True), rounds="3")
    assert g["rounds"] == 3 and SP.grid()["rounds"] == 1
    per_round = S.grid_prompts(tok, g)
    assert len(per_round) == 3
    for prompts, conc in per_round:
        assert [len(p) for p in prompts] == g["lengths"]
        assert {n: len(ps) for n, ps in conc.items()} == {n: n for n in g["concurrency"]}
        assert all(len(p) == g["conc_prompt_len"] for ps in conc.values() for p in ps)
    firsts = [tuple(p[:16]) for prompts, conc in per_round for p in prompts + [q for ps in conc.values() for q in ps]]
    assert len(firsts) == 3 * (len(g["lengths"]) + sum(g["concurrency"])) == len(set(firsts))
    # round 1's prompts are the one-round grid's
    assert S.grid_prompts(tok, SP.grid(quick=True))[0][0] == per_round[0][0]


@pytest.mark.parametrize("bad", ["0", "6", "two", "1.5"])
def test_rounds_out_of_range_name_the_field_and_the_limit(bad):
    with pytest.raises(ValueError, match=r"rounds must be an integer from 1 to 5"):
        SP.with_overrides(SP.grid(), rounds=bad)


def test_the_warm_up_leaves_no_measured_prompts_block_in_the_prefix_cache():
    """The kvscope engines' warm-up shares no block with a measured prompt (it once was the first 32
    tokens of the first one, so that point's TTFT skipped two cached blocks)."""
    from engine.model.models import load_tokenizer

    tok = load_tokenizer("default")
    g = SP.with_overrides(SP.grid(), rounds="3")  # the suite's own prompts for the full grid, 3 rounds
    measured = [
        p for prompts, conc in S.grid_prompts(tok, g) for p in prompts + [q for ps in conc.values() for q in ps]
    ]
    warm = S.WARM_UP_PROMPT
    for bs in (16, 32):  # any block size the bench runs
        assert all(p[:bs] != warm[:bs] for p in measured)


def _fields():
    """A stored result's fields, written by hand (units: TTFT s, rates tok/s)."""
    pts = [
        {"axis": "prefill", "x": 128, "engine": "kvscope", "value": 0.5},
        {"axis": "prefill", "x": 128, "engine": "kvscope", "value": 0.4},  # two rounds: the lower TTFT counts
        {"axis": "prefill", "x": 128, "engine": "llamacpp", "value": 0.8},
        {"axis": "prefill", "x": 128, "engine": "vllm", "value": 0.2},
        {"axis": "decode", "x": 128, "engine": "kvscope", "value": 40.0},
        {"axis": "decode", "x": 128, "engine": "llamacpp", "value": 50.0},
        {"axis": "decode", "x": 128, "engine": "vllm", "value": None},
        {"axis": "concurrency", "x": 1, "engine": "kvscope", "value": 30.0},
    ]
    lims = [
        {"axis": "prefill", "x": 128, "value": 0.1},
        {"axis": "decode", "x": 128, "value": 100.0},
        {"axis": "concurrency", "x": 1, "value": 60.0},
    ]
    return {"grid": {"lengths": [128], "concurrency": [1]}, "points": pts, "limits": lims, "isa": "AVX2+FMA"}


def test_table_ratios_are_speed_ratios():
    rows = {(r["axis"], r["x"]): r for r in SP.table(_fields())}
    pre = rows[("prefill", 128)]
    assert pre["kvscope"] == 0.4 and pre["best_peer"] == "vllm"
    assert pre["vs_best_peer"] == pytest.approx(0.2 / 0.4)  # TTFT: kvscope half as fast as vLLM
    assert pre["of_limit"] == pytest.approx(0.1 / 0.4)
    dec = rows[("decode", 128)]
    assert dec["best_peer"] == "llamacpp" and dec["vllm"] is None
    assert dec["vs_best_peer"] == pytest.approx(0.8) and dec["of_limit"] == pytest.approx(0.4)
    conc = rows[("concurrency", 1)]
    assert conc["vs_best_peer"] is None and conc["best_peer"] is None and conc["of_limit"] == pytest.approx(0.5)
    g = SP.goals(list(rows.values()), _fields())
    assert g["points_vs_best_peer"] == 2 and g["points_at_or_above_best_peer"] == 0
    assert g["worst_vs_best_peer"] == pytest.approx(0.5)
    assert g["prefill_128_of_limit"] == pytest.approx(0.25) and g["decode_128_of_limit"] == pytest.approx(0.4)
    md = SP.markdown_table(_fields()).splitlines()
    assert len(md) == 2 + 3 and md[2].startswith("| TTFT") and "0.50×" in md[2] and "–" in md[3]


def test_caption_says_how_many_rounds_each_point_had():
    from ui.figures.scaling import caption

    one = caption(_fields(), "x.json")
    assert "times per engine" not in one
    f = _fields()
    f["grid"] = {**f["grid"], "rounds": 3}
    assert "Each point measured 3 times per engine, minutes apart; each engine's best is shown." in caption(f, "x")
    # runs merged (scripts/scaling_figure.py with several results): the fewest rounds any run had
    two = {**_fields(), "grid": {"lengths": [8000], "concurrency": [1], "rounds": 2}}
    m = SP.merge([f, two])
    assert m["grid"]["rounds"] == 2 and "Each point measured at least 2 times per engine" in caption(m, "x")
    assert SP.merge([_fields(), two])["grid"]["rounds"] == 1  # a result from before rounds had one


def test_figure_is_three_panels_from_the_fields():
    from ui.figures.scaling import scaling_figure

    fig = scaling_figure(_fields(), {"cpu": "AMD EPYC", "nproc": 2})
    names = [(t.name, t.xaxis) for t in fig.data]
    # prefill: 3 engines + limit; decode: 2 engines + limit (vLLM has no value); concurrency: 1 + limit
    assert len(fig.data) == 4 + 3 + 2
    assert {x for _, x in names} == {"x", "x2", "x3"}
    assert "AVX2+FMA" in fig.layout.title.text and "AMD EPYC" in fig.layout.title.text
    lim = [t for t in fig.data if t.name.startswith("machine limit")]
    assert [list(t.y) for t in lim] == [[0.1], [100.0], [60.0]]
    assert scaling_figure({}).data == ()  # no result: an empty figure, nothing made up


def test_kernel_isa_path_rule():
    from engine.model import kernel_isa as K

    avx512 = {"__AVX2__", "__FMA__", "__F16C__", "__AVX512F__", "__AVX512DQ__", "__AVX512BW__", "__AVX512VL__"}
    assert K.path_of(avx512) == "AVX-512"
    assert K.path_of(avx512 - {"__AVX512BW__"}) == "AVX2+FMA"
    assert K.path_of({"__SSE2__"}).startswith("portable")
    assert isinstance(K.summary(), str) and K.summary()


@pytest.mark.skipif(not C.engine_available(), reason="the kvscope engine is not importable")
def test_scaling_smoke_tiny_stores_every_point_and_limit(capsys, tmp_path, monkeypatch):
    """The suite on the tiny model (no peer runs it: no GGUF, and vLLM serves only the default
    model): kvscope has a positive value at every grid point, every point has its limit, each
    peer says why it was not measured, and the stored result reads back into the table."""
    monkeypatch.delenv("KVSCOPE_BENCH_LOCK", raising=False)
    rc = cli.main(
        ["scaling", "--smoke", "--model", "tiny", "--json", "--no-plots", "--threads", "1", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert rc == 0, out[-2000:]
    assert "isa: " in out
    stored = json.loads((tmp_path / "scaling-latest.json").read_text())
    f = stored["fields"]
    assert set(f) >= {"grid", "roofs", "points", "limits", "peers", "isa", "threads", "segments", "goals"}
    assert f["grid"] == SP.grid(smoke=True)
    rows = SP.table(f)
    assert len(rows) == 2 * len(f["grid"]["lengths"]) + len(f["grid"]["concurrency"])
    for r in rows:
        assert r["kvscope"] is not None and r["kvscope"] > 0 and math.isfinite(r["kvscope"]), r
        assert r["limit"] is not None and r["limit"] > 0, r
        assert r["llamacpp"] is None and r["vllm"] is None
    assert set(f["peers"]) == {"llamacpp", "vllm"} and all(f["peers"].values())
    assert all("load_1m" in s for s in f["segments"])
    assert f["roofs"]["weight_bytes_read_per_step"] > 0 and f["roofs"]["peak_matmul_gflops"] > 0


def _smoke_fields(capsys, tmp_path) -> dict:
    """`bench scaling --smoke` on the tiny model at 1 thread; the stored result's fields."""
    rc = cli.main(
        ["scaling", "--smoke", "--model", "tiny", "--json", "--no-plots", "--threads", "1", "--out", str(tmp_path)]
    )
    assert rc == 0, capsys.readouterr().out[-2000:]
    return json.loads((tmp_path / "scaling-latest.json").read_text())["fields"]


def test_engines_take_turns_point_by_point_and_a_failing_peer_keeps_its_points(capsys, tmp_path, monkeypatch):
    """With both peers up (stand-ins here: vLLM's client and llama.cpp's subprocess replaced),
    every length and every concurrency level is measured on each engine in turn, the order
    reversed at every other point; a peer that fails midway keeps the points it measured, says
    why, and the other engines go on."""
    monkeypatch.delenv("KVSCOPE_BENCH_LOCK", raising=False)
    closed = []

    class FakeServer:
        def __exit__(self, *a):
            closed.append(True)

    fake = {"base": "http://fake", "model": "default"}
    monkeypatch.setattr(S, "_start_vllm", lambda *a: (fake, FakeServer()))
    monkeypatch.setattr(S, "_llamacpp_gguf", lambda *a: "/fake.gguf")
    monkeypatch.setattr(S, "_http_point", lambda base, p, new: (0.5, 20.0))
    from engine.bench.vs_peers import http_client, http_tok_s

    def conc(b, ps, n):  # vLLM's stand-in; kvscope's server measured as the suite does
        return 30.0 if b is fake else http_tok_s(http_client({**b, "prompts": ps, "new": n}))

    monkeypatch.setattr(S, "_http_concurrency", conc)
    calls = []

    def llamacpp(gguf, p, new, threads, max_len):
        calls.append(len(p))
        if len(calls) == 2:
            raise RuntimeError("llama.cpp crashed")
        return 0.25, 40.0, 1.0, "0.0-test"

    monkeypatch.setattr(S, "_llamacpp_job", llamacpp)
    f = _smoke_fields(capsys, tmp_path)
    g = f["grid"]
    names = [s["name"] for s in f["segments"] if ": length" in s["name"] or ": concurrency" in s["name"]]
    L = g["lengths"]
    expect = [f"{e}: length {L[0]}" for e in ("kvscope", "vLLM CPU", "llama.cpp")]
    expect += [f"{e}: length {L[1]}" for e in ("llama.cpp", "vLLM CPU", "kvscope")]  # reversed; then it fails
    expect += [f"{e}: length {x}" for i, x in enumerate(L[2:], 2) for e in ("kvscope", "vLLM CPU")[:: 1 - 2 * (i % 2)]]
    expect += [
        f"{e}: concurrency {n}"
        for i, n in enumerate(g["concurrency"])
        for e in ("kvscope", "vLLM CPU")[:: 1 - 2 * (i % 2)]
    ]
    assert names == expect
    pts = {(p["axis"], p["x"], p["engine"]): p["value"] for p in f["points"]}
    assert pts[("prefill", L[0], "llamacpp")] == 0.25 and pts[("decode", L[0], "llamacpp")] == 40.0
    assert not any(e == "llamacpp" and x != L[0] for _, x, e in pts)
    assert all(pts[(a, x, "vllm")] == v for a, x, v in [("prefill", L[-1], 0.5), ("decode", L[0], 20.0)])
    assert all(pts[("concurrency", n, "vllm")] == 30.0 for n in g["concurrency"])
    assert all(pts[("concurrency", n, "kvscope")] > 0 for n in g["concurrency"])
    assert f["peers"]["llamacpp"] == "failed: RuntimeError: llama.cpp crashed"
    assert f["peers"]["vllm"].startswith("ok") and closed == [True]


def test_rounds_measure_every_point_again_each_engine_alike(capsys, tmp_path, monkeypatch):
    """KVSCOPE_SCALING_ROUNDS=2: the whole grid twice, each engine once per point and round, the
    engines' order at a point flipped from one round to the next; every prompt new to every
    engine (no two share a first block); the table keeps each engine's best."""
    monkeypatch.delenv("KVSCOPE_BENCH_LOCK", raising=False)
    monkeypatch.setenv("KVSCOPE_SCALING_ROUNDS", "2")

    class FakeServer:
        def __exit__(self, *a):
            pass

    fake = {"base": "http://fake", "model": "default"}
    seen = []  # (engine, first block) of every measured prompt
    ttft = iter([0.6, 0.5, 0.7, 0.4] * 8)  # vLLM's stand-in: its rounds differ

    def vllm_point(base, p, new):
        seen.append(("vllm", tuple(p[:16])))
        return next(ttft), 20.0

    def llamacpp(gguf, p, new, threads, max_len):
        seen.append(("llamacpp", tuple(p[:16])))
        return 0.25, 40.0, 1.0, "0.0-test"

    monkeypatch.setattr(S, "_start_vllm", lambda *a: (fake, FakeServer()))
    monkeypatch.setattr(S, "_llamacpp_gguf", lambda *a: "/fake.gguf")
    monkeypatch.setattr(S, "_http_point", vllm_point)
    monkeypatch.setattr(S, "_llamacpp_job", llamacpp)
    from engine.bench.vs_peers import http_client, http_tok_s

    def conc(b, ps, n):  # vLLM's stand-in; kvscope's server measured as the suite does
        if b is not fake:
            return http_tok_s(http_client({**b, "prompts": ps, "new": n}))
        seen.extend(("vllm", tuple(p[:16])) for p in ps)
        return 30.0

    monkeypatch.setattr(S, "_http_concurrency", conc)
    f = _smoke_fields(capsys, tmp_path)
    g = f["grid"]
    assert g["rounds"] == 2 and g["lengths"] == SP.grid(smoke=True)["lengths"]
    L = g["lengths"]
    names = [s["name"] for s in f["segments"] if ": length" in s["name"]]
    order = ("kvscope", "vLLM CPU", "llama.cpp")
    expect = [
        f"{e}: length {x} (round {r + 1} of 2)"
        for r in range(2)
        for i, x in enumerate(L)
        for e in order[:: 1 - 2 * ((i + r) % 2)]
    ]
    assert names == expect
    for axis, xs in (("prefill", L), ("decode", L), ("concurrency", g["concurrency"])):
        for x in xs:
            for e in ("kvscope", "vllm") + (("llamacpp",) if axis != "concurrency" or x == 1 else ()):
                rounds = sorted(p["round"] for p in f["points"] if (p["axis"], p["x"], p["engine"]) == (axis, x, e))
                assert rounds == [0, 1], (axis, x, e)
    assert len(seen) == len(set(seen))  # no prompt measured twice on an engine
    assert len({b for _, b in seen if _ == "vllm"}) == 2 * (len(L) + sum(g["concurrency"]))
    # each vLLM length point: the lower of its two rounds' TTFTs
    rows = {(r["axis"], r["x"]): r for r in SP.table(f)}
    vals = {(p["x"], p["round"]): p["value"] for p in f["points"] if (p["axis"], p["engine"]) == ("prefill", "vllm")}
    for x in L:
        assert rows[("prefill", x)]["vllm"] == min(vals[(x, 0)], vals[(x, 1)])


def test_merge_unites_runs_point_by_point():
    a = _fields()
    b = {
        "grid": {"lengths": [8000], "concurrency": [1]},
        "points": [{"axis": "prefill", "x": 8000, "engine": "kvscope", "value": 90.0}],
        "limits": [{"axis": "prefill", "x": 8000, "value": 30.0}, {"axis": "concurrency", "x": 1, "value": 99.0}],
        "peers": {"vllm": "not run"},
        "isa": "AVX2+FMA",
    }
    m = SP.merge([a, b])
    assert m["grid"]["lengths"] == [128, 8000] and m["grid"]["concurrency"] == [1]
    rows = {(r["axis"], r["x"]): r for r in SP.table(m)}
    assert rows[("prefill", 8000)]["of_limit"] == pytest.approx(30 / 90)
    assert rows[("concurrency", 1)]["limit"] == 60.0  # the first run's limit for a point both hold
    assert m["peers"] == {"vllm": "not run"} and SP.merge([a]) is a
