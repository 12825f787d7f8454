"""One pass over the default model's packed Linears (30 layers' qkv, o, gate_up, down groups and
the lm_head) at 1 and 16 rows, GGUF blocks vs fp32 panels, alternating, best of 5 each; times in
this process's CPU time (meaningful on a machine shared with other work) and wall time.

    python scripts/weight_pass.py [threads]
"""

import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
from engine.model import linear  # noqa: E402
from engine.model.models import gguf_source, load_model  # noqa: E402


def main(threads: int = 1) -> None:
    model, _ = load_model("default")
    torch.set_num_threads(threads)
    packs = {
        "gguf": linear.pack_model(model, weight_format="gguf", gguf_path=gguf_source(model)),
        "fp32": linear.pack_model(model),
    }
    groups, width = {}, {}
    for fmt, pack in packs.items():
        seen = {}
        for mod, (g, _) in pack.members.items():
            seen[id(g)] = g
            width[id(g)] = mod.in_features
        groups[fmt] = list(seen.values())
    with torch.inference_mode():
        for rows in (1, 16):
            best = {}
            for _ in range(5):
                for fmt in packs:
                    xs = {k: torch.randn(rows, k) for k in set(width.values())}
                    t, c = time.perf_counter(), time.process_time()
                    for g in groups[fmt]:
                        g.matmul(xs[width[id(g)]])
                    w, c = time.perf_counter() - t, time.process_time() - c
                    b = best.setdefault(fmt, [1e9, 1e9])
                    best[fmt] = [min(b[0], c), min(b[1], w)]
            print(
                f"{rows} rows, {threads} thread(s): "
                + ", ".join(f"{f} {v[0] * 1e3:.1f} ms CPU / {v[1] * 1e3:.1f} ms wall" for f, v in best.items())
                + f"; fp32 / gguf CPU {best['fp32'][0] / best['gguf'][0]:.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
