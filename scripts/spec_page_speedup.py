"""The Speculative page's own measurement of its defaults, outside the app: the default prompt
(ui/figures/drafters.EXAMPLE_PROMPT), the engine a fresh server starts with (the default model,
EngineConfig defaults), the n-gram drafter at k (default 4) with the fallback on, 64 new tokens,
greedy, engine/lab/experiments.compare_speculative with the page's 30 s budget. Prints one JSON line.

    python scripts/spec_page_speedup.py [k ...]
"""

import json
import os
import sys

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
from engine.config import EngineConfig  # noqa: E402
from engine.lab.experiments import compare_speculative  # noqa: E402
from engine.model import kernel_isa  # noqa: E402
from ui.figures import drafters  # noqa: E402

if __name__ == "__main__":
    base = EngineConfig(model="default")
    for k in [int(a) for a in sys.argv[1:]] or [4]:
        spec = drafters.drafter_config("n-gram (prompt lookup)", k, fallback=True)
        r = compare_speculative(base, drafters.EXAMPLE_PROMPT, spec, 64, budget_s=30.0)
        c = r.comparison
        out = {
            "isa": kernel_isa.summary(),
            "k": k,
            "speedup_median": c.ratio.median,
            "after_first_token_median": r.decode_ratio.median if r.decode_ratio is not None else None,
            "plain_s_median": c.a.median,
            "spec_s_median": c.b.median,
            "rounds": c.rounds,
            "tokens_per_target_pass": r.tokens_per_target_pass,
            "outputs_match": r.outputs_match,
            "fell_back": bool(r.fallback),
            "load_1min": os.getloadavg()[0],
        }
        print(json.dumps(out), flush=True)
    os._exit(0)
