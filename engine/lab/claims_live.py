"""The claims measured now on the loaded engine (the Claims page's Measure button): memory-bound
decode, verification cost and batching, timed on the shared EngineThread with its lock held or
from its SCHEDULE events. With the engine core in its own process (the default) the same
measurement runs in the lab process (engine/lab/lab_proc.py) on a private engine with the shared
engine's settings, while the shared core takes no step (EngineClient.hold, at most HOLD_S).
The rows come from the row functions in engine.claims (one rule per claim); this module owns
only the measuring.
"""

from __future__ import annotations

import datetime as _dt
import statistics
import time
from typing import Callable

from engine.bench import machine_rates as MR
from engine.bench import roofline as RF
from engine.lab.claims import (
    BATCH_SIZES,
    VERIFY_KS,
    batching_row,
    memory_bound_row,
    verify_cost_row,
)

HOLD_S = 300.0  # the longest the shared core is held for one process-mode measurement


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
        if hasattr(th, "hold"):  # EngineClient: the core runs elsewhere; measure in the lab process
            from engine.lab import lab_proc

            th.hold(HOLD_S)
            try:
                return lab_proc.LAB.run(measure_private, th.config, progress=progress or (lambda f, s: None))
            finally:
                try:
                    th.hold(0)
                except Exception:  # noqa: BLE001 - a core that died meanwhile holds nothing
                    pass
        return _measure_live(th, progress)


def measure_private(config, progress: Callable[[float, str], None] | None = None) -> dict:
    """measure_live on a private in-thread engine built from `config` (its pool sized for the
    largest batch), in this process: the lab process's half of a process-mode measurement."""
    from engine.core.engine import LLMEngine
    from engine.core.thread import EngineThread
    from engine.model.kv_layout import cdiv

    blocks = max(BATCH_SIZES) * (cdiv(48 + 12 + 8, config.block_size) + 1) + 8
    th = EngineThread(LLMEngine(config.replace(num_kv_blocks=blocks, kv_cache_bytes=None, enable_prefix_caching=False)))
    try:
        return _measure_live(
            th, progress, where="a private engine with the shared engine's settings, in a process of its own"
        )
    finally:
        th.shutdown()


def _measure_live(th, progress, where: str = "") -> dict:
    import torch

    from engine.speculative import verify_cost

    say = progress or (lambda f, s: None)
    eng = th.engine
    model = eng.runner.model
    shape = RF.ModelShape.from_config(model.config)
    dtype = next(model.parameters()).dtype
    dbytes = torch.tensor([], dtype=dtype).element_size()
    say(0.0, "memory bandwidth (torch.sum over 256 MiB)")
    bw = hold_engine(th, lambda: MR.measure_read_bandwidth(mbytes=256, dtype=dtype))
    say(0.1, "matmul rate (256 rows)")
    t_mm = hold_engine(th, lambda: MR.measure_linear(256, shape.hidden, shape.intermediate, dtype=dtype))
    gflops = 2 * 256 * shape.hidden * shape.intermediate / t_mm / 1e9
    steps, contended = decode_step_times(th, progress=lambda f, s: say(0.2 + 0.5 * f, f"decode steps: {s}"))
    say(0.75, "verification cost, k = 1..8 (the engine's own target pass)")
    vc = hold_engine(th, lambda: verify_cost.engine_verify_cost_ratios(eng, ks=VERIFY_KS, reps=5))
    say(1.0, "done")
    ctx = 48 + 6  # the decode runs' mean context
    floor_s = 1 / RF.memory_roof_tok_s(shape, bw, dbytes, ctx)
    compute_s = shape.flops_per_generated_token(ctx) / (gflops * 1e9)
    when = _dt.datetime.now(_dt.timezone.utc)
    src = (
        f"measured on this page, {when:%Y-%m-%d %H:%M:%S} UTC, model {eng.config.model}"
        + (f" ({where})" if where else "")
        + (" (other requests shared some passes; those were left out)" if contended else "")
    )
    ratios = {k: vc[f"verify_cost_ratio_k{k}"] for k in VERIFY_KS if f"verify_cost_ratio_k{k}" in vc}
    rows = [
        memory_bound_row(steps.get(1), floor_s, compute_s, bw, src),
        verify_cost_row(ratios, src, row_compute_s=compute_s, step_s=steps.get(1)),
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
