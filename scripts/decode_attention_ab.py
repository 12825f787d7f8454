"""Kernel A/B: kvscope_paged_decode_kv of two or more builds of engine/model/csrc, alternating in one process.

    python scripts/decode_attention_ab.py OLD_CSRC_DIR NEW_CSRC_DIR [MORE_DIRS...]
        [--lengths 512,2048,8000] [--threads 1] [--reps 9] [--sequential] [--layers 30] [--seqs 1]

A batch-1 decode of the default model's shape (9 query heads, 3 KV heads, head dim 64, blocks of
16) over 30 layers' fp32 pools (--layers; in huge-page memory, as the engine's), one pool pair per
layer, each layer's blocks in a random order
(--sequential: in order, as a fresh pool hands them out); --seqs N: N sequences of that length
in each layer's pool, one step's batch (W16 is 16 of ~230). Each build's best sweep over the
layers is printed as GB/s of K/V read (L x layers x 2 x 3 x 64 x 4 bytes), beside torch.sum over the
same pools, with the largest difference from the first build's output. Each directory's paged_attention.c
is compiled with cpu_kernels.CFLAGS (+ KVSCOPE_ISA's flags) into /tmp. At 1 thread the clock is
the thread's CPU time (time.thread_time: time the scheduler gives other processes on a shared
machine is not counted); at more threads it is wall time. An old build from git:
`mkdir /tmp/old && git show REF:engine/model/csrc/paged_attention.c > /tmp/old/paged_attention.c
&& cp engine/model/csrc/kvscope.h /tmp/old/`.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.model import cpu_kernels, kv_quant  # noqa: E402

BS, H, HKV, D = 16, 9, 3, 64


def in_pool_memory(t: torch.Tensor) -> torch.Tensor:
    """t copied into a pool allocated as the engine allocates its KV pools (kv_quant.allocate)."""
    return kv_quant.allocate("fp32", *t.shape, "cpu").copy_(t)


def build(csrc: str) -> ctypes.CDLL:
    src = os.path.join(csrc, "paged_attention.c")
    flags = cpu_kernels.CFLAGS + cpu_kernels.isa_flags()
    blob = b"".join(open(os.path.join(csrc, f), "rb").read() for f in ("paged_attention.c", "kvscope.h"))
    out = f"/tmp/decode_ab_{hashlib.sha256(blob + ' '.join(flags).encode()).hexdigest()[:12]}.so"
    if not os.path.exists(out):
        subprocess.run(["gcc", *flags, "-o", out, src], check=True)
    lib = ctypes.CDLL(out)
    P, I = ctypes.c_void_p, ctypes.c_int
    lib.kvscope_paged_decode_kv.argtypes = [P, P, P, P, P, P, P, I, I, I, I, I, I, ctypes.c_float, I, I, I]
    lib.kvscope_paged_decode_kv.restype = I
    return lib


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--lengths", default="512,2048,8000")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--sequential", action="store_true")
    ap.add_argument("--layers", type=int, default=30, help="pool pairs swept (1: one layer's pools, in cache)")
    ap.add_argument("--seqs", type=int, default=1, help="sequences of that length per layer (a batch's step)")
    a = ap.parse_args()
    libs = [build(d) for d in a.dirs]
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    g = torch.Generator().manual_seed(0)
    print(f"load {os.getloadavg()[0]:.2f}, {a.threads} thread(s), ISA flags {cpu_kernels.isa_flags() or 'native'}")
    for n in (int(x) for x in a.lengths.split(",")):
        ns = a.seqs
        per = -(-n // BS)
        nb = per * ns
        pools = [tuple(in_pool_memory(torch.randn(nb, BS, HKV, D, generator=g)) for _ in "kv") for _ in range(a.layers)]
        tables = [
            (torch.arange(nb) if a.sequential else torch.randperm(nb, generator=g)).to(torch.int32).contiguous()
            for _ in range(a.layers)
        ]
        q = torch.randn(ns, H, D, generator=g)
        rows, lens = torch.arange(ns, dtype=torch.int32), torch.full((ns,), n, dtype=torch.int32)
        outs = [torch.empty_like(q) for _ in libs]
        best = [float("inf")] * len(libs)
        for _ in range(a.reps):
            for i, lib in enumerate(libs):
                t = clock()
                for (k, v), tb in zip(pools, tables):
                    rc = lib.kvscope_paged_decode_kv(
                        q.data_ptr(), outs[i].data_ptr(), k.data_ptr(), v.data_ptr(), rows.data_ptr(),
                        lens.data_ptr(), tb.data_ptr(), ns, per, BS, H, HKV, D, D**-0.5, n, a.threads, 0,
                    )  # fmt: skip
                    assert rc == 0
                best[i] = min(best[i], clock() - t)
        t_sum = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for k, v in pools:
                k.sum(), v.sum()
            t_sum = min(t_sum, time.perf_counter() - t)
        nbytes = a.layers * ns * n * HKV * D * 4 * 2
        cols = "  ".join(
            f"{os.path.basename(os.path.normpath(d))} {nbytes / b / 1e9:.2f}" for d, b in zip(a.dirs, best)
        )
        diff = max((o - outs[0]).abs().max().item() for o in outs)
        print(f"{n:>6} positions: {cols} GB/s  (torch.sum {nbytes / t_sum / 1e9:.2f}; max diff {diff:.1e})", flush=True)


if __name__ == "__main__":
    main()
