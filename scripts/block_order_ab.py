"""How the order of a long sequence's blocks changes the decode kernel's read rate, in one process.

    python scripts/block_order_ab.py [--length 8000] [--reps 15] [--layers 30]

The block table is what engine/core/block_manager.BlockManager hands `bench scaling`'s longest
prompt: a pool of blocks_for(length) blocks, then the suite's warm-up (32 tokens + 4) and its
128 / 512 / 2,048-token requests (+ 32 new tokens each, freed in turn), then the long prompt in
prefill chunks of 512 tokens. Three tables of the same pool are timed, alternating, over 30
layers' fp32 pools (the default model's 3 KV heads x 64 dims, blocks of 16):
- "manager": the table the block manager gives (each allocation's blocks in id order);
- "queue": the same blocks in the order the free queue gave them up (before 76580ba);
- "fresh": a fresh pool's order (0, 1, 2, ...).
Prints GB/s of K/V read (best and median of --reps sweeps) per table and its ascending runs.
KVSCOPE_ISA=avx2 times the AVX2 build.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from decode_attention_ab import BS, HKV, D, H, build  # noqa: E402

from engine.bench.common import blocks_for  # noqa: E402
from engine.core import block_manager as BM  # noqa: E402

CHUNK = 512  # EngineConfig.max_num_batched_tokens's default


def tables(length: int) -> tuple[int, dict[str, list[int]]]:
    """(pool blocks, {name: the long prompt's block table})."""
    nb = blocks_for([length], 32) + 8
    bm = BM.BlockManager(nb, BS, enable_prefix_caching=False)
    popped: list[int] = []
    pop = bm._pop_free
    bm._pop_free = lambda *a, **k: popped.append(pop(*a, **k)) or popped[-1]  # the queue's order

    def run(rid: str, prompt: int, new: int) -> None:
        for total in [*range(CHUNK, prompt, CHUNK), prompt, *range(prompt + 1, prompt + new)]:
            bm.allocate(rid, total)
            bm.commit(rid, total)

    for i, (p, new) in enumerate(((32, 4), (128, 32), (512, 32), (2048, 32))):
        run(f"r{i}", p, new)
        bm.free(f"r{i}")
    popped.clear()
    run("long", length, 1)
    n = -(-length // BS)
    return nb, {"manager": bm.table("long")[:n], "queue": popped[:n], "fresh": list(range(n))}


def runs(t: list[int]) -> int:
    return 1 + sum(1 for a, b in zip(t, t[1:]) if b != a + 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=8000)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--layers", type=int, default=30)
    a = ap.parse_args()
    nb, tabs = tables(a.length)
    lib = build(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine", "model", "csrc"))
    g = torch.Generator().manual_seed(0)
    pools = [
        (torch.randn(nb, BS, HKV, D, generator=g), torch.randn(nb, BS, HKV, D, generator=g)) for _ in range(a.layers)
    ]
    q = torch.randn(1, H, D, generator=g)
    out = torch.empty_like(q)
    rows, lens = torch.tensor([0], dtype=torch.int32), torch.tensor([a.length], dtype=torch.int32)
    tt = {k: torch.tensor(v, dtype=torch.int32) for k, v in tabs.items()}
    width = len(tabs["fresh"])
    times: dict[str, list[float]] = {k: [] for k in tt}
    for _ in range(a.reps):
        for k, tb in tt.items():
            t = time.perf_counter()
            for kp, vp in pools:
                rc = lib.kvscope_paged_decode_kv(
                    q.data_ptr(), out.data_ptr(), kp.data_ptr(), vp.data_ptr(), rows.data_ptr(), lens.data_ptr(),
                    tb.data_ptr(), 1, width, BS, H, HKV, D, D**-0.5, a.length, 1, 0,
                )  # fmt: skip
                assert rc == 0
            times[k].append(time.perf_counter() - t)
    nbytes = a.layers * a.length * HKV * D * 4 * 2
    print(f"{a.length} positions, {a.layers} layers, pool of {nb} blocks, 1 thread, load {os.getloadavg()[0]:.2f}")
    for k, v in times.items():
        best, med = nbytes / min(v) / 1e9, nbytes / statistics.median(v) / 1e9
        print(f"  {k:8s} {runs(tabs[k]):4d} ascending runs: best {best:5.1f} GB/s, median {med:5.1f}")


if __name__ == "__main__":
    main()
