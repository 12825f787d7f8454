"""`python -m engine soak`: the soak run's entry points, `soak()` (the workload, the unconstrained
reference once, one constrained run per preemption mode) and the command line (`main`). What a run
does and checks: engine/lab/soak.py."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from engine.lab.soak import (
    FREE_TIER_PERCENTILE,
    PROFILES,
    SoakReport,
    build_requests,
    reference_run,
    run_soak,
)


def soak(
    n_requests: int = 1000,
    model: str = "tiny",
    modes=("recompute", "swap"),
    seed: int = 0,
    profile: str = "small",
    block_size: int = 8,
    budget_fraction: float = 0.1,
    max_model_len: int = 512,
    device: str = "auto",
    abort_prob: float = 0.03,
    evict_prob: float = 0.05,
    num_threads: int | None = None,
    log=None,
) -> list[SoakReport]:
    """Build the workload, run the unconstrained reference once, then one constrained soak per mode."""
    if not 0 < budget_fraction <= 1:
        raise ValueError(f"budget_fraction must be in (0, 1], got {budget_fraction!r}")
    for m in modes:
        if m not in ("recompute", "swap"):
            raise ValueError(f"mode must be 'recompute', 'swap' or 'both', got {m!r}")
    requests = build_requests(n_requests, seed, profile)
    t0 = time.perf_counter()
    ref, peak, largest, counts, ref_eng = reference_run(
        requests, model, block_size, max_model_len, device, num_threads=num_threads
    )
    bytes_per_block = ref_eng.bytes_per_block
    del ref_eng
    ref_s = time.perf_counter() - t0
    budget = max(int(-(-peak * budget_fraction // 1)), largest + 1)
    swap_blocks = max(2, budget // 4)  # small: large victims fall back to recompute
    free_totals = sorted(counts[r.request_id] + r.max_tokens for r in requests if r.tier == "free")
    free_cap = free_totals[int(FREE_TIER_PERCENTILE * (len(free_totals) - 1))] if free_totals else None
    if log is not None:
        log(
            f"{len(requests)} requests; unconstrained peak {peak} blocks; budget {budget} blocks; "
            f"swap space {swap_blocks} blocks; free-tier context cap {free_cap} tokens; reference run {ref_s:.1f} s"
        )
    reports = []
    for m in modes:
        rep = run_soak(
            requests,
            ref,
            model=model,
            mode=m,
            seed=seed,
            block_size=block_size,
            budget_blocks=budget,
            swap_blocks=swap_blocks,
            bytes_per_block=bytes_per_block,
            max_model_len=max_model_len,
            device=device,
            abort_prob=abort_prob,
            evict_prob=evict_prob,
            num_threads=num_threads,
            free_tier_cap=free_cap,
            log=log,
        )
        rep.peak_demand_blocks = peak
        rep.max_request_blocks = largest
        rep.reference_seconds = ref_s
        if len(ref) != len(requests):
            rep.problems.append(f"the unconstrained run finished only {len(ref)} of {len(requests)} requests")
        reports.append(rep)
    return reports


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000, help="number of requests (default 1000)")
    ap.add_argument(
        "--model",
        default=os.environ.get("KVSCOPE_MODEL", "default"),
        help="'default' (SmolLM2-135M), 'tiny', a local path or hub id",
    )
    ap.add_argument("--mode", choices=("recompute", "swap", "both"), default="both", help="preemption mode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--profile",
        choices=tuple(PROFILES),
        default="small",
        help="prompt/output lengths: small (short), medium, full (scenario defaults)",
    )
    ap.add_argument("--block-size", type=int, default=None, help="default 8 for tiny, 16 otherwise")
    ap.add_argument("--budget-fraction", type=float, default=0.1, help="KV budget as a fraction of the peak demand")
    ap.add_argument("--max-model-len", type=int, default=None, help="default 512 (small), 2048 otherwise")
    ap.add_argument("--abort-prob", type=float, default=0.03, help="chance per step of a random client abort")
    ap.add_argument("--evict-prob", type=float, default=0.05, help="chance per step of a manual eviction")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--json", metavar="PATH", help="also write the reports as JSON to PATH")
    a = ap.parse_args(argv)
    modes = ("recompute", "swap") if a.mode == "both" else (a.mode,)
    bs = a.block_size or (8 if a.model == "tiny" else 16)
    mml = a.max_model_len or (512 if a.profile == "small" else 2048)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    try:
        reports = soak(
            a.requests,
            a.model,
            modes,
            a.seed,
            a.profile,
            bs,
            a.budget_fraction,
            mml,
            a.device,
            a.abort_prob,
            a.evict_prob,
            a.threads,
            log=log,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in reports:
        print(r.summary())
    if a.json:
        with open(a.json, "w") as f:
            json.dump([r.to_dict() for r in reports], f, indent=1)
    return 0 if all(not r.problems for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
