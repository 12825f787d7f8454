"""The Speculative page's own measurement of its defaults, outside the app: the default prompt
(ui/figures/drafters.EXAMPLE_PROMPT), the engine a fresh server starts with (the default model,
EngineConfig defaults), the n-gram drafter at k (default 4) with the fallback on, 64 new tokens,
greedy, engine/lab/experiments.compare_speculative with the page's 30 s budget. Prints one JSON line
per k, with the ceiling this machine puts on the speedup (engine/bench/speculative.spec_speedup_ceiling):
the plain run's measured time after its first token, against the rows the speculative run's target
passes fed (one per pass plus its drafts) at the peak matmul rate (measured here at the engine's
thread count), both runs' shared prefill at that rate too, everything else free.

    python scripts/spec_page_speedup.py [k ...]
"""

import json
import os
import sys

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
from engine.bench import machine_rates, roofline  # noqa: E402
from engine.bench import speculative as spec_bench  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.lab.experiments import compare_speculative  # noqa: E402
from engine.model import kernel_isa  # noqa: E402
from ui.figures import drafters  # noqa: E402

if __name__ == "__main__":
    base = EngineConfig(model="default")
    ks = [int(a) for a in sys.argv[1:]] or [4]
    for k in ks:
        spec = drafters.drafter_config("n-gram (prompt lookup)", k, fallback=True)
        r = compare_speculative(base, drafters.EXAMPLE_PROMPT, spec, 64, budget_s=30.0)
        c = r.comparison
        if k == ks[0]:  # the roof at the engine's thread count, after its first measurement
            import torch

            from engine.model.models import load_model

            model, _ = load_model("default")
            shape = roofline.shape_of(model)
            peak = machine_rates.measure_best_matmuls(shape, rows=(512,), min_time=0.3)[0][512]["all_gflops"]
        passes = r.spec.output_len / r.tokens_per_target_pass if r.tokens_per_target_pass else None
        # rows the passes after the first token fed: one per pass plus its drafts
        rows = round(passes) - 1 + r.spec.spec_num_draft_tokens if passes else None
        floors = spec_bench.spec_floors(shape, peak, r.spec.prompt_len, rows) if passes else None
        plain_decode = sorted(x.seconds - x.extra["ttft_s"] for x in c.samples_a)[len(c.samples_a) // 2]
        out = {
            "isa": kernel_isa.summary(),
            "k": k,
            "speedup_median": c.ratio.median,
            "after_first_token_median": r.decode_ratio.median if r.decode_ratio is not None else None,
            "plain_s_median": c.a.median,
            "spec_s_median": c.b.median,
            "rounds": c.rounds,
            "tokens_per_target_pass": r.tokens_per_target_pass,
            "prompt_tokens": r.spec.prompt_len,
            "peak_matmul_gflops": peak,
            "threads": torch.get_num_threads(),
            "output_tokens": r.spec.output_len,
            "target_passes": passes,
            "draft_tokens": r.spec.spec_num_draft_tokens,
            "prefill_floor_s": floors[0] if floors else None,
            "verify_floor_s": floors[1] if floors else None,
            "plain_after_first_s_median": plain_decode,
            "speedup_ceiling": spec_bench.spec_speedup_ceiling(*floors, plain_decode) if floors else None,
            "outputs_match": r.outputs_match,
            "fell_back": bool(r.fallback),
            "load_1min": os.getloadavg()[0],
        }
        print(json.dumps(out), flush=True)
    os._exit(0)
