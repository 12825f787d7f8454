"""The claims measured now on the loaded engine (the Claims page's Measure button): memory-bound
decode, verification cost and batching, timed on the shared EngineThread with its lock held or
from its SCHEDULE events. The rows come from the row functions in engine.claims (one rule per
claim); this module owns only the measuring.
"""

from __future__ import annotations

import datetime as _dt
import statistics
import time
from typing import Callable

from engine.bench import roofline as RF
from engine.lab.claims import (
    BATCH_SIZES,
    VERIFY_KS,
    batching_row,
    memory_bound_row,
    verify_cost_row,
)


def hold_engine(th, fn: Callable):
    """Run `fn()` with the shared engine paused between steps (its lock held), so a timing is not
    shared with other sessions' forward passes. The one place the Claims page touches the engine
    for timing: point it at a controlled-measurement helper when one exists."""
    with th.lock:
        return fn()


def _wait_idle(th, timeout_s: float = 120.0) -> bool:
    """Wait (bounded) until the shared engine has no unfinished request, so a batch of B is B."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with th.lock:
            if not th.engine.has_unfinished_requests():
                return True
        time.sleep(0.05)
    return False


def decode_step_times(
    th,
    batch_sizes=BATCH_SIZES,
    prompt_tokens: int = 48,
    new_tokens: int = 12,
    progress: Callable[[float, str], None] | None = None,
) -> tuple[dict[int, float], bool]:
    """Median forward time of the decode-only passes holding exactly this run's B requests, for
    each batch size B, from the engine's SCHEDULE events. Returns (times, contended) where
    contended says another request shared some of the passes (those passes are not counted)."""
    from engine.config import SamplingParams

    times: dict[int, float] = {}
    contended = False
    tok = th.tokenizer
    base = tok.encode("The release freeze starts tonight, so every review has to land before then. " * 8)
    for i, b in enumerate(batch_sizes):
        if progress:
            progress(i / len(batch_sizes), f"batch of {b}")
        _wait_idle(th)
        seq0 = th.events.last_seq
        tag = f"claims-{time.monotonic_ns() % 10**9}-b{b}"
        hs = [
            th.submit(
                base[j : j + prompt_tokens],
                SamplingParams(max_tokens=new_tokens, ignore_eos=True, speculative=False),
                request_id=f"{tag}-{j}",
            )
            for j in range(b)
        ]
        for h in hs:
            h.result(timeout=600)
        ids = {h.request_id for h in hs}
        fwd = []
        for e in th.events.since(seq0, kinds=("schedule",)):
            rows = e.data.get("rows") or []
            mine = {r[0] for r in rows if r[0] in ids}
            if len(rows) != len(mine) and mine:
                contended = True
            if mine == ids and len(rows) == b and all(r[1] == "decode" for r in rows):
                fwd.append(float(e.data.get("forward_s") or 0))
        if fwd:
            times[b] = statistics.median(fwd)
    return times, contended


def measure_live(th, progress: Callable[[float, str], None] | None = None) -> dict:
    """Measure the live-measurable claims on the loaded engine `th` (an EngineThread). Returns the
    raw numbers plus the rows built from them."""
    from engine.lab.experiments import RUN_LOCK

    with RUN_LOCK:  # one measurement at a time per server (they compete for the same cores)
        return _measure_live(th, progress)


def _measure_live(th, progress) -> dict:
    import torch

    from engine.bench import peers

    say = progress or (lambda f, s: None)
    eng = th.engine
    if not hasattr(eng, "runner"):
        raise RuntimeError(
            "the live measurement times the model in this process, and the engine core runs in a "
            "process of its own (KVSCOPE_ENGINE_PROCESS=1); the bench rows are shown"
        )
    model = eng.runner.model
    shape = RF.ModelShape.from_config(model.config)
    dtype = next(model.parameters()).dtype
    dbytes = torch.tensor([], dtype=dtype).element_size()
    say(0.0, "memory bandwidth (torch.sum over 256 MiB)")
    bw = hold_engine(th, lambda: RF.measure_read_bandwidth(mbytes=256, dtype=dtype))
    say(0.1, "matmul rate (256 rows)")
    t_mm = hold_engine(th, lambda: RF.measure_linear(256, shape.hidden, shape.intermediate, dtype=dtype))
    gflops = 2 * 256 * shape.hidden * shape.intermediate / t_mm / 1e9
    steps, contended = decode_step_times(th, progress=lambda f, s: say(0.2 + 0.5 * f, f"decode steps: {s}"))
    say(0.75, "verification cost, k = 1..8")
    prompt = th.tokenizer.encode("Review the retry logic in the storage client before the freeze. " * 6)
    vc = hold_engine(th, lambda: peers.verify_cost_ratios(model, prompt, ks=VERIFY_KS, reps=3))
    say(1.0, "done")
    ctx = 48 + 6  # the decode runs' mean context
    floor_s = 1 / RF.memory_roof_tok_s(shape, bw, dbytes, ctx)
    compute_s = shape.flops_per_generated_token(ctx) / (gflops * 1e9)
    when = _dt.datetime.now(_dt.timezone.utc)
    src = f"measured on this page, {when:%Y-%m-%d %H:%M:%S} UTC, model {eng.config.model}" + (
        " (other requests shared some passes; those were left out)" if contended else ""
    )
    ratios = {k: vc[f"verify_cost_ratio_k{k}"] for k in VERIFY_KS if f"verify_cost_ratio_k{k}" in vc}
    rows = [
        memory_bound_row(steps.get(1), floor_s, compute_s, bw, src),
        verify_cost_row(ratios, src),
        batching_row(steps, src),
    ]
    return {
        "when": when.isoformat(),
        "bandwidth_gb_s": bw,
        "matmul_gflops_m256": gflops,
        "decode_step_s": steps,
        "verify_cost_ratio": ratios,
        "contended": contended,
        "rows": rows,
    }
