"""The seeds' claims about inference, each checked against a measurement on this machine.

Two sources, never mixed within a row: the benchmark's JSON results (read by
engine.lab.bench_results, with their date), and measurements made now on a loaded engine
(`engine.lab.claims_live.measure_live`, which builds its rows with the same row functions). This
module owns the claims and the rule behind each verdict; every verdict comes from a rule on the
numbers, stated in the row; a claim with no number says why instead (never a made-up value).
Formulas live where the bench keeps them (engine.bench.roofline, engine.bench.suites).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.lab import claims_kv as KV
from engine.lab import recall_grid as RG
from engine.lab.bench_results import KVQUANT_JSON, BenchResult, committed_kvquant, missing, number
from engine.speculative.math import expected_tokens_per_pass

VERIFY_KS = tuple(range(1, 9))
BATCH_SIZES = (1, 2, 4, 8)
# thresholds, shown on the page with each verdict
VERIFY_ABOUT_ONE = 1.5  # a (k+1)-token pass "costs about one pass" if within 1.5x of a 1-token pass
BATCH_TOTAL_GAIN = 2.0  # total tok/s at the largest batch must be >= 2x batch 1
PAGED_WASTE_MAX, CONTIG_WASTE_MIN = 0.04, 0.6  # seed 004: under 4 % vs 60-80 %
PREFIX_TTFT_MAX_RATIO = 0.5  # a prefix hit must at least halve TTFT
SPEC_PASSAGE_MIN, SPEC_OPEN_MIN = 2.0, 0.95  # seed 004: 2-3x; never much below plain
SPEC_THEORY_TOL = 0.25  # measured tokens per pass within 25 % of (1 - a^(k+1)) / (1 - a)
PACKETS_LEAK_MIN, PACKETS_OVER_CHANCE = 0.5, 3.0  # undefended: answer picked >= 50 % and >= 3x chance
PACKETS_DEFENDED_MAX = 2.0  # a defence "hides the answer" at <= 2x chance
WEIGHTS_FOLLOW = 0.8  # speed "follows bytes" if the tok/s gain is >= 80 % of the byte cut
WEIGHTS_READ_BOUND = 2.0  # Linears slower than 2x their bytes' read time: not bound by the bytes
FLEET_PREFILL_SAVED_MIN = 0.5  # seed 004: prefix caching removes 50-90 % of prefill for cacheable content
FLEET_POLICIES = ("round_robin", "kv_aware", "cache_aware")  # bench fleet's policies, in its order


@dataclass(frozen=True, slots=True)
class ClaimRow:
    key: str
    claim: str  # the claim, in kvscope's words
    seeds: str  # which reference texts make it
    measured: str  # the numbers, formatted
    holds: bool | None  # None: not measured
    why: str  # the rule applied to the numbers, or why there is no number
    source: str  # bench file and date, or "measured on this page at ..."


# ------------------------------------------------------------------ one function per claim

CLAIMS = {
    "memory_bound": (
        "A decode step is bound by memory: it must read every weight (and the KV cache) once, "
        "and the arithmetic on them is small.",
        "001, 002, 004",
    ),
    "verify_cost": ("Verifying k+1 tokens in one target pass costs about the same as generating one.", "000, 001"),
    "batching": (
        "Batching amortises the weight reads: total tokens/s rises with batch size while each "
        "request's own speed falls.",
        "002, 004",
    ),
    "cache": (
        "Without a KV cache each new token recomputes the whole prefix, so its cost grows with the "
        "context; with the cache it stays nearly flat.",
        "000, 001",
    ),
    "paged": (
        "Paged blocks waste little memory (under ~4 %); reserving a contiguous slab per request at its "
        "maximum length wastes most of it (60-80 %).",
        "000, 002, 003, 004",
    ),
    "prefix": ("Sharing a cached prompt prefix cuts time to first token for requests that repeat it.", "002, 004"),
    "speculation": (
        "Speculative decoding speeds up decoding 2-3x when drafts are predictable, and tokens "
        "per pass follow (1 - a^(k+1)) / (1 - a); with unpredictable text it gains nothing.",
        "000, 001, 004",
    ),
    "kv_quant": (
        "Store keys and values in very few bits (4 and below) and the model starts missing facts far "
        "back in a long context while its answers to short prompts still barely change.",
        "003",
    ),
    "peers": ("On the same weights, kvscope keeps up with vLLM CPU at W16 and with llama.cpp at batch 1.", "—"),
    "weight_bytes": (
        "Quantizing weights to fewer bits cuts the bytes each decode step streams, and so raises "
        "batch-1 decode speed almost in proportion.",
        "002",
    ),
    "packets": (
        "The sizes of streamed packets leak token lengths through encryption, and with them, with some "
        "accuracy, the content of the answer.",
        "002",
    ),
    "fleet_prefix": (
        "Prefix caching removes 50-90 % of prefill work for cacheable prompts; across a fleet behind a "
        "gateway that holds only where each request reaches an instance that holds its prefix.",
        "004",
    ),
}


def _row(key, measured, holds, why, source) -> ClaimRow:
    claim, seeds = CLAIMS[key]
    return ClaimRow(key, claim, seeds, measured, holds, why, source)


def memory_bound_row(
    step_s: float | None, floor_s: float | None, compute_s: float | None, bw_gb_s: float | None, source: str
) -> ClaimRow:
    if step_s is None or floor_s is None or compute_s is None:
        return _row("memory_bound", "—", None, "missing: batch-1 decode step time, bandwidth or matmul rate", source)
    holds = floor_s >= compute_s
    return _row(
        "memory_bound",
        f"batch-1 decode step {step_s * 1e3:.1f} ms; reading weights + KV at {bw_gb_s:.1f} GB/s takes at "
        f"least {floor_s * 1e3:.1f} ms; its arithmetic at the best matmul rate {compute_s * 1e3:.1f} ms",
        holds,
        f"holds if the memory floor ≥ the compute floor: {floor_s * 1e3:.1f} ms "
        f"{'≥' if holds else '<'} {compute_s * 1e3:.1f} ms ({floor_s / compute_s:.1f}×). The floor "
        f"explains {100 * floor_s / step_s:.0f} % of the measured step; the rest is layer code around "
        "the matmuls.",
        source,
    )


def verify_cost_row(
    ratios: dict[int, float],
    source: str,
    missing: str = "",
    row_compute_s: float | None = None,
    step_s: float | None = None,
    floor_from: str = "",
) -> ClaimRow:
    """row_compute_s: one token's arithmetic at the best measured matmul rate; step_s: the measured
    one-row pass (floor_from: where those two come from, when not from `source`). With both, the row
    also gives the least ratio that arithmetic allows: k + 1 rows take at least k + 1 times one
    row's arithmetic, whatever the kernels."""
    if not ratios:
        return _row("verify_cost", "—", None, missing or "no verification timings", source)
    ks = sorted(ratios)
    k4 = ratios.get(4, ratios[ks[len(ks) // 2]])
    kref = 4 if 4 in ratios else ks[len(ks) // 2]
    holds = k4 <= VERIFY_ABOUT_ONE
    why = f"cost of one pass over k+1 tokens / one 1-token pass. Holds if ≤ {VERIFY_ABOUT_ONE}× at k={kref}: {k4:.2f}×."
    if row_compute_s and step_s:
        floor = verify_floor_ratio(kref, row_compute_s, step_s)
        why += (
            f" The arithmetic alone allows no less than {floor:.2f}× at k={kref}: {kref + 1} rows of "
            f"{row_compute_s * 1e3:.2f} ms each at the best measured matmul rate, against a "
            f"{step_s * 1e3:.2f} ms one-row pass"
            + (f" ({floor_from})" if floor_from else "")
            + (
                f", so above {VERIFY_ABOUT_ONE}× here however fast the kernels get."
                if floor > VERIFY_ABOUT_ONE
                else "."
            )
        )
    return _row("verify_cost", ", ".join(f"k={k}: {ratios[k]:.2f}×" for k in ks), holds, why, source)


def verify_floor_ratio(k: int, row_compute_s: float, step_s: float) -> float:
    """The least (k+1)-row pass / one-row pass ratio: k + 1 rows' arithmetic at the best measured
    matmul rate over the measured one-row pass (at least 1: the pass does all of one row's work)."""
    return max(1.0, (k + 1) * row_compute_s / step_s)


def batching_row(step_s: dict[int, float], source: str, missing: str = "") -> ClaimRow:
    if len(step_s) < 2 or 1 not in step_s:
        return _row("batching", "—", None, missing or "needs decode step times at batch 1 and larger", source)
    bmax = max(step_s)
    total = {b: b / s for b, s in step_s.items()}
    per = {b: 1 / s for b, s in step_s.items()}
    holds = total[bmax] >= BATCH_TOTAL_GAIN * total[1] and per[bmax] < per[1]
    return _row(
        "batching",
        "; ".join(
            f"B={b}: {step_s[b] * 1e3:.1f} ms/step, {total[b]:.1f} tok/s total, {per[b]:.1f} per request"
            for b in sorted(step_s)
        ),
        holds,
        f"holds if total tok/s at B={bmax} ≥ {BATCH_TOTAL_GAIN}× batch 1 ({total[bmax] / total[1]:.2f}×) "
        f"and each request is slower ({per[bmax]:.1f} vs {per[1]:.1f} tok/s).",
        source,
    )


def rows_from_bench(res: dict[str, BenchResult]) -> list[ClaimRow]:
    """Every claim from the bench's latest JSON; live-only claims say so."""
    rows = []
    r = res.get("roofline")
    if r is None:
        rows.append(_row("memory_bound", "—", None, missing("roofline"), "bench"))
    else:
        f = r.fields
        dec, roof, bw = number(f, "decode_bs1_tok_s"), number(f, "memory_roof_tok_s"), number(f, "mem_bw_gb_s")
        gf, peak = number(f, "gflop_per_generated_token"), number(f, "peak_matmul_gflops")
        rows.append(
            memory_bound_row(
                1 / dec if dec else None, 1 / roof if roof else None, gf / peak if gf and peak else None, bw, r.label
            )
        )
    s = res.get("speculative")
    if s is None:
        rows.append(_row("verify_cost", "—", None, missing("speculative"), "bench"))
    else:
        ratios = {k: v for k in VERIFY_KS if (v := number(s.fields, f"verify_cost_ratio_k{k}")) is not None}
        rf = r.fields if r is not None else {}
        dec, gf, peak = (number(rf, n) for n in ("decode_bs1_tok_s", "gflop_per_generated_token", "peak_matmul_gflops"))
        rows.append(
            verify_cost_row(
                ratios,
                s.label,
                row_compute_s=gf / peak if gf and peak else None,
                step_s=1 / dec if dec else None,
                floor_from="both from bench roofline" if r is not None else "",
            )
        )
    rows.append(
        _row(
            "batching",
            "—",
            None,
            "not in the bench JSON: press Measure to time decode steps at batch "
            f"sizes {', '.join(map(str, BATCH_SIZES))} on the loaded engine",
            "this page",
        )
    )
    c = res.get("cache")
    if c is None:
        rows.append(_row("cache", "—", None, missing("cache"), "bench"))
    else:
        pts = sorted(
            (int(m[1]), v)
            for k in c.fields
            if (m := re.match(r"nocache_over_cache_at_(\d+)$", k)) and (v := number(c.fields, k)) is not None
        )
        if len(pts) < 2:
            rows.append(_row("cache", "—", None, "the cache result has fewer than two context lengths", c.label))
        else:
            grows = all(b[1] > a[1] for a, b in zip(pts, pts[1:])) and pts[0][1] > 1
            rows.append(
                _row(
                    "cache",
                    ", ".join(f"at {n} tokens: no-cache {v:.1f}× the cached cost per token" for n, v in pts),
                    grows,
                    "holds if no-cache / cache > 1 and grows with the context: "
                    + " < ".join(f"{v:.1f}" for _, v in pts)
                    if grows
                    else "does not grow with the context here: " + ", ".join(f"{v:.1f}" for _, v in pts),
                    c.label,
                )
            )
    m = res.get("memory")
    pw, cw = (number(m.fields, "paged_waste"), number(m.fields, "contiguous_waste")) if m else (None, None)
    if m is None or pw is None or cw is None:
        rows.append(_row("paged", "—", None, missing("memory"), m.label if m else "bench"))
    else:
        holds = pw < PAGED_WASTE_MAX and cw >= CONTIG_WASTE_MIN
        rows.append(
            _row(
                "paged",
                f"paged waste {100 * pw:.1f} %, contiguous {100 * cw:.1f} % "
                f"(max concurrency {m.fields.get('paged_max_concurrency')} vs "
                f"{m.fields.get('contiguous_max_concurrency')})",
                holds,
                f"holds if paged < {100 * PAGED_WASTE_MAX:.0f} % and contiguous ≥ "
                f"{100 * CONTIG_WASTE_MIN:.0f} % "
                "(1 − filled / allocated slots, time-averaged over the release-freeze run).",
                m.label,
            )
        )
    p = res.get("prefix")
    cold, hit = (number(p.fields, "ttft_cold_s"), number(p.fields, "ttft_hit_s")) if p else (None, None)
    if p is None or not cold or hit is None:
        rows.append(_row("prefix", "—", None, missing("prefix"), p.label if p else "bench"))
    else:
        holds = hit / cold <= PREFIX_TTFT_MAX_RATIO
        rows.append(
            _row(
                "prefix",
                f"TTFT cold {cold * 1e3:.0f} ms, with the prefix cached {hit * 1e3:.0f} ms",
                holds,
                f"holds if hit / cold ≤ {PREFIX_TTFT_MAX_RATIO}: {hit / cold:.2f}.",
                p.label,
            )
        )
    if s is None:
        rows.append(_row("speculation", "—", None, missing("speculative"), "bench"))
    else:
        rows.append(speculation_row(s.fields, s.label))
    q = res.get("kvquant")
    if q is not None and isinstance(q.fields.get("by_dtype"), dict):
        rows.append(kv_quant_row(q.fields["by_dtype"], q.label))
    else:
        kq = committed_kvquant()
        if kq is None:
            rows.append(_row("kv_quant", "—", None, missing("kvquant"), "bench"))
        else:
            src = (
                f"{kq.get('command', 'bench kvquant')} (model {kq.get('model')}), {KVQUANT_JSON.name}, {kq.get('date')}"
            )
            grid = kq.get("recall_grid")
            if RG.is_grid(grid):
                src += f"; recall grid to {RG.longest(grid)} tokens: {grid.get('command', 'kv_recall_grid')}"
            rows.append(kv_quant_row(kq.get("dtypes", {}), src, grid))
    pe = res.get("peers")  # the peers are optional tools: scripts/peers.sh install, then bench peers
    if pe is None:
        rows.append(_row("peers", "—", None, missing("peers") + " after scripts/peers.sh install", "bench"))
    else:
        rows.append(peers_row(pe.fields, pe.label))
    wb = res.get("weights")
    missing_wb = _row("weight_bytes", "—", None, missing("weights"), "bench")
    rows.append(weights_row(wb.fields, wb.label) if wb else missing_wb)
    pk = res.get("packets")
    rows.append(packets_row(pk.fields, pk.label) if pk else _row("packets", "—", None, missing("packets"), "bench"))
    fl = res.get("fleet")
    if fl is None or not any(number(fl.fields, f"{p}_hit_rate") is not None for p in FLEET_POLICIES):
        rows.append(_row("fleet_prefix", "—", None, missing("fleet"), fl.label if fl else "bench"))
    else:
        rows.append(fleet_row(fl.fields, fl.label))
    return rows


WEIGHT_FORMATS_SHOWN = {"fp32": "fp32 copies", "q8_0": "Q8_0", "q4_1": "Q4_1"}


def weights_row(f: dict, source: str) -> ClaimRow:
    """Holds if each quantized format's batch-1 tok/s gain over the fp32 copies is at least
    WEIGHTS_FOLLOW of its byte cut, and Q4_1's over Q8_0 likewise. Where it is not, the row names
    what bounds the step: the Linears' time against reading their bytes at the measured bandwidth
    (slower than WEIGHTS_READ_BOUND x: converting codes, not bytes), and the time outside them."""
    tok = {k: number(f, f"weights_{k}_tok_s") for k in WEIGHT_FORMATS_SHOWN}
    byt = {k: number(f, f"weights_{k}_bytes_per_step") for k in WEIGHT_FORMATS_SHOWN}
    if not all(tok.values()) or not all(byt.values()):
        return _row("weight_bytes", "—", None, "the weights result lacks tok/s or bytes of fp32, Q8_0, Q4_1", source)
    bw = number(f, "weights_mem_bw_gb_s")
    measured = (
        "; ".join(
            f"{name} {tok[k]:.1f} tok/s reading {byt[k] / 1e6:.0f} MB a step"
            for k, name in WEIGHT_FORMATS_SHOWN.items()
        )
        + f" ({f.get('cpu', '?')}, {f.get('cpu_simd', '?')}, CPU shared with other work)"
    )
    pairs = (("q8_0", "fp32"), ("q4_1", "fp32"), ("q4_1", "q8_0"))
    verdicts, holds = [], True
    for a, b in pairs:
        gain, cut = tok[a] / tok[b], byt[b] / byt[a]
        ok = gain >= WEIGHTS_FOLLOW * cut
        holds = holds and ok
        verdicts.append(
            f"{WEIGHT_FORMATS_SHOWN[a]} vs {WEIGHT_FORMATS_SHOWN[b]}: {cut:.2f}× fewer bytes, {gain:.2f}× the speed "
            f"({'follows' if ok else 'does not follow'})"
        )
    why = (
        f"speed follows bytes if the tok/s gain is ≥ {100 * WEIGHTS_FOLLOW:.0f} % of the byte cut: "
        + "; ".join(verdicts)
        + "."
    )
    if not holds:
        bounds = []
        for k in WEIGHT_FORMATS_SHOWN:
            lin, floor = number(f, f"weights_{k}_weights_ms"), number(f, f"weights_{k}_read_floor_ms")
            step, rest = number(f, f"weights_{k}_step_ms"), number(f, f"weights_{k}_rest_ms")
            if lin is None or floor is None or not step:
                continue
            what = (
                "converting the codes to floats, not the bytes, bounds them"
                if lin > WEIGHTS_READ_BOUND * floor
                else "they run near the read time of their bytes"
            )
            bounds.append(
                f"{WEIGHT_FORMATS_SHOWN[k]}: the Linears take {lin:.1f} of {step:.1f} ms a step where reading their "
                f"bytes at {bw or 0:.1f} GB/s takes {floor:.1f} ms — {what}"
                + (f"; {rest:.1f} ms is outside the Linears and attention" if rest is not None else "")
            )
        if bounds:
            why += " What bounds it (one timed run, per-op split): " + "; ".join(bounds) + "."
    return _row("weight_bytes", measured, holds, why, source)


PACKET_DEFENCES = {"obfuscation": "obfuscation field", "coalesce": "tokens coalesced", "fixed": "fixed-size chunks"}


def packets_row(f: dict, source: str) -> ClaimRow:
    """Holds if, without a defence, an observer of TLS record lengths picks the streamed answer
    among the candidates at least PACKETS_LEAK_MIN and PACKETS_OVER_CHANCE x chance, and reads
    token lengths at >= 2x chance. Each defence's accuracy and byte cost are shown beside it."""
    acc, chance = number(f, "packets_none_accuracy"), number(f, "packets_chance")
    la, lc = number(f, "packets_none_length_accuracy"), number(f, "packets_none_length_chance")
    if acc is None or not chance or la is None or lc is None:
        return _row("packets", "—", None, "the packets result lacks the undefended accuracies", source)
    parts = [
        f"no defence: answer picked {100 * acc:.0f} % (chance {100 * chance:.0f} %), token lengths read "
        f"{100 * la:.0f} % (chance {100 * lc:.0f} %), "
        f"{number(f, 'packets_none_bits_per_token') or 0:.1f} bits per token"
    ]
    hidden, leaky = [], []
    for d, name in PACKET_DEFENCES.items():
        a, b = number(f, f"packets_{d}_accuracy"), number(f, f"packets_{d}_bytes_ratio")
        if a is None:
            continue
        parts.append(f"{name}: {100 * a:.0f} %" + (f" at {b:.2f}× the bytes" if b else ""))
        (hidden if a <= PACKETS_DEFENDED_MAX * chance else leaky).append(name)
    need = max(PACKETS_LEAK_MIN, PACKETS_OVER_CHANCE * chance)
    holds = acc >= need and la >= 2 * lc
    why = (
        f"holds if without a defence the answer is picked ≥ {100 * need:.0f} % (max of "
        f"{100 * PACKETS_LEAK_MIN:.0f} % and {PACKETS_OVER_CHANCE:.0f}× chance): {100 * acc:.0f} %, and token "
        f"lengths are read at ≥ 2× chance: {100 * la:.0f} % vs {100 * lc:.0f} %."
    )
    if hidden:
        why += f" At ≤ {PACKETS_DEFENDED_MAX:.0f}× chance with {', '.join(hidden)}"
    if leaky:
        why += f"; still above it with {', '.join(leaky)} (the groups' and the whole answer's lengths remain)"
    why += (
        ". The answers are streamed over TLS on 127.0.0.1 through a relay that sees only record lengths and "
        "times (the Prefix cache page runs the same measurement)."
    )
    return _row("packets", "; ".join(parts), holds, why, source)


def fleet_row(f: dict, source: str) -> ClaimRow:
    """bench fleet: the share of prompt tokens served from the serving instance's prefix cache
    (sum of cached_tokens / sum of prompt tokens) is the prefill removed, per routing policy."""
    rates = {p: number(f, f"{p}_hit_rate") for p in FLEET_POLICIES}
    rates = {p: v for p, v in rates.items() if v is not None}
    held = [p for p, v in rates.items() if v >= FLEET_PREFILL_SAVED_MIN]
    best = max(rates, key=rates.get)
    measured = ", ".join(f"{p} {100 * v:.0f} %" for p, v in rates.items()) + " of prompt tokens served from cache"
    if f.get("fleet_model"):
        measured += f" ({f['fleet_model']}, 3 servers behind vllm-router, release-freeze)"
    why = (
        f"holds if a policy's fleet hit rate (prefill removed) ≥ {100 * FLEET_PREFILL_SAVED_MIN:.0f} %: "
        + (f"held under {', '.join(held)}" if held else "held under no policy")
        + (f"; not under {', '.join(p for p in rates if p not in held)}" if len(held) < len(rates) else "")
        + f"; best {best}."
    )
    return _row("fleet_prefix", measured, bool(held), why, source)


def peers_row(f: dict, source: str) -> ClaimRow:
    w16, bs1 = number(f, "w16_kvscope_vs_vllm"), number(f, "decode_bs1_vs_llamacpp_t1")
    parts = [f"W16 kvscope / vLLM {w16:.2f}" if w16 else "W16 vs vLLM not measured"]
    parts.append(f"batch-1 kvscope / llama.cpp {bs1:.2f} (1 thread)" if bs1 else "llama.cpp not measured")
    if f.get("greedy_identical"):
        parts.append(f"greedy text identical {f['greedy_identical']}")
    known = [x for x in (w16, bs1) if x is not None]
    holds = all(x >= 1.0 for x in known) if len(known) == 2 else None
    return _row("peers", "; ".join(parts), holds, "holds if both ratios ≥ 1 (best vs best, alternating).", source)


def speculation_row(f: dict, source: str) -> ClaimRow:
    sp, so = number(f, "passage_edit_speedup"), number(f, "open_ended_speedup")
    a = number(f, "passage_edit_acceptance_rate")
    tpp = number(f, "passage_edit_tokens_per_target_pass")
    # the passes' mean draft length (4 at most: the n-gram drafter drafts fewer after a short match)
    k = number(f, "passage_edit_mean_draft_length") or 4
    theory = expected_tokens_per_pass(a, k) if a is not None else None
    if sp is None or so is None or tpp is None or theory is None:
        return _row("speculation", "—", None, "the speculative result lacks speedup / acceptance fields", source)
    near = abs(tpp - theory) <= SPEC_THEORY_TOL * theory
    holds = sp >= SPEC_PASSAGE_MIN and so >= SPEC_OPEN_MIN and near
    return _row(
        "speculation",
        f"passage edit: α {a:.2f}, {tpp:.2f} tokens per target pass (theory at k={k:.3g}: {theory:.2f}), "
        f"speedup {sp:.2f}×; open-ended: speedup {so:.2f}× "
        f"(α {number(f, 'open_ended_acceptance_rate') or 0:.2f})",
        holds,
        f"holds if passage-edit speedup ≥ {SPEC_PASSAGE_MIN}× ({sp:.2f}), open-ended ≥ {SPEC_OPEN_MIN}× "
        f"({so:.2f}) and tokens per pass within {100 * SPEC_THEORY_TOL:.0f} % of theory "
        f"({tpp:.2f} vs {theory:.2f}).",
        source,
    )


def merge(bench_rows: list[ClaimRow], live_rows: list[ClaimRow]) -> list[ClaimRow]:
    """Bench rows with any live row of the same claim in its place (live is newer)."""
    live = {r.key: r for r in live_rows if r.holds is not None}
    return [live.get(r.key, r) for r in bench_rows]


def kv_quant_row(by_dtype: dict, source: str, grid: dict | None = None) -> ClaimRow:
    """The quantized-KV claim (rule: engine.lab.claims_kv.verdict)."""
    return _row("kv_quant", *KV.verdict(by_dtype, grid), source)
