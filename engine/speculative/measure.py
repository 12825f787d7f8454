"""Wall-clock speedup of speculative decoding over plain decoding, measured in this process
through engine/measure.py (the one home for A/B timings: alternated sides, median, spread)."""

from __future__ import annotations

import time

from .. import measure
from ..engine import LLMEngine


def speedup_vs_plain(config, prompt, params, repeats: int = 1) -> dict:
    """Wall-clock speedup of speculative decoding over plain decoding for the same request, in
    this process: runs `prompt` alone on a plain engine and on one with `config.speculative`,
    alternating which goes first, `repeats` rounds (engine/measure.compare), and reports both
    median times, the speedup (plain median / speculative median), whether the outputs are
    identical (they must be for greedy), the speculative metrics for those runs, and the
    measure.Comparison itself ("comparison": spread, rounds, order)."""
    if config.speculative is None:
        raise ValueError("speedup_vs_plain needs an EngineConfig with speculative set")
    plain = LLMEngine(config.replace(speculative=None))
    spec = LLMEngine(config)
    outs: dict[str, object] = {}

    def once(name, eng):
        def run(_round):
            rid = eng.add_request(None, prompt, params)
            t = time.perf_counter()
            out = None
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if o.request_id == rid and o.finished:
                        out = o
            dt = time.perf_counter() - t
            outs[name] = out
            return measure.Sample(dt)

        return run

    cmp_ = measure.compare(
        once("plain", plain), once("spec", spec), names=("plain", "spec"), min_rounds=max(1, int(repeats))
    )
    po, so = outs["plain"], outs["spec"]
    n = len(so.outputs[0].token_ids)
    tp, ts = cmp_.a.median, cmp_.b.median
    return {
        "plain_s": tp,
        "spec_s": ts,
        "speedup": tp / ts,
        "tokens": n,
        "plain_tok_s": len(po.outputs[0].token_ids) / tp,
        "spec_tok_s": n / ts,
        "identical": po.outputs[0].token_ids == so.outputs[0].token_ids,
        "spec": spec.spec.summary(),
        "comparison": cmp_,
    }
