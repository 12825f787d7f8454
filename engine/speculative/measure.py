"""Wall-clock speedup of speculative decoding over plain decoding, measured in this process."""
from __future__ import annotations

import time

from ..engine import LLMEngine


def speedup_vs_plain(config, prompt, params, repeats: int = 1) -> dict:
    """Wall-clock speedup of speculative decoding over plain decoding for the same request, in
    this process: runs `prompt` alone on a plain engine and on one with `config.speculative`
    (alternating, best of `repeats`), and reports both times, whether the outputs are identical
    (they must be for greedy), and the speculative metrics for those runs."""
    if config.speculative is None:
        raise ValueError("speedup_vs_plain needs an EngineConfig with speculative set")
    plain = LLMEngine(config.replace(speculative=None))
    spec = LLMEngine(config)

    def once(eng):
        rid = eng.add_request(None, prompt, params)
        t = time.perf_counter()
        out = None
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.request_id == rid and o.finished:
                    out = o
        return out, time.perf_counter() - t

    tp, ts = [], []
    for _ in range(max(1, repeats)):
        po, a = once(plain)
        so, b = once(spec)
        tp.append(a)
        ts.append(b)
    n = len(so.outputs[0].token_ids)
    return {"plain_s": min(tp), "spec_s": min(ts), "speedup": min(tp) / min(ts), "tokens": n,
            "plain_tok_s": len(po.outputs[0].token_ids) / min(tp), "spec_tok_s": n / min(ts),
            "identical": po.outputs[0].token_ids == so.outputs[0].token_ids, "spec": spec.spec.summary()}
