"""The engine's own verification cost, k = 1, 4, 8: engine/speculative/verify_cost.py (the one home
the Claims row, `bench speculative` and the speculative decoder's calibration use) on the default
model as the app loads it, best of REPS alternating rounds. Prints one JSON line per thread count.

    python scripts/engine_verify_cost.py [threads ...]      # REPS=15 rounds by default
"""

import json
import os
import sys

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
from engine.core.llm import LLM  # noqa: E402
from engine.model import kernel_isa  # noqa: E402
from engine.speculative import verify_cost  # noqa: E402

if __name__ == "__main__":
    for threads in [int(a) for a in sys.argv[1:]] or [2]:
        llm = LLM(model="default", num_threads=threads)
        eng = llm.engine
        out = {"isa": kernel_isa.summary(), "threads": threads, "weights": eng.snapshot().info.weight_format}
        out.update(verify_cost.engine_verify_cost_ratios(eng, ks=(1, 4, 8), reps=int(os.environ.get("REPS", "15"))))
        out["load_1min"] = os.getloadavg()[0]
        print(json.dumps(out), flush=True)
    os._exit(0)  # skip the engines' teardown: only the timing is wanted
