"""The engine's own target-pass cost: one sequence's k+1 rows vs 1 row through runner.forward (the
C decode path), as the speculative decoder's start-up calibration does, but best of N alternating
rounds. Prints one JSON line. (The Claims row `verify_cost` times the transformers model instead.)

    python scripts/engine_verify_cost.py [threads]      # REPS=15 rounds by default
"""

import json
import os
import sys
import time

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
from engine.config import SpeculativeConfig  # noqa: E402
from engine.core.llm import LLM  # noqa: E402
from engine.model import kernel_isa  # noqa: E402
from engine.model.kv_layout import cdiv  # noqa: E402
from engine.model.runner import BatchRow  # noqa: E402

if __name__ == "__main__":
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    llm = LLM(model="default", num_threads=threads, speculative=spec)
    eng = getattr(llm.engine, "engine", llm.engine)
    bm, runner = eng.spec.bm, eng.spec.ctx.runner
    ctx = 64
    n = cdiv(ctx + 9, bm.block_size)
    bm.allocate("vc#draft", n * bm.block_size)  # a draft-suffixed id: never a request's
    table = bm.table("vc#draft")[:n]
    toks = [(i * 7919) % 30000 + 10 for i in range(ctx + 9)]
    runner.forward([BatchRow("vc", 0, toks[:ctx], table, ctx - 1)])
    best = {m: float("inf") for m in (1, 2, 5, 9)}
    for _ in range(int(os.environ.get("REPS", "15"))):
        for m in best:
            t = time.perf_counter()
            runner.forward([BatchRow("vc", ctx, toks[ctx : ctx + m], table, 0)])
            best[m] = min(best[m], time.perf_counter() - t)
    out = {"isa": kernel_isa.summary(), "threads": threads, "pass_1_ms": best[1] * 1e3}
    out.update({f"verify_cost_ratio_k{m - 1}": best[m] / best[1] for m in (2, 5, 9)})
    print(json.dumps(out))
    os._exit(0)  # skip the engine's teardown: only the timing is wanted
