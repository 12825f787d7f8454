"""Kernel A/B: kvscope_paged_prefill (the tiled causal prefill attention) of two builds of
engine/model/csrc, alternating in one process.

    python scripts/prefill_attention_ab.py OLD_CSRC_DIR NEW_CSRC_DIR [--lengths 512,2048,8000]
        [--chunk 0] [--reps 5] [--heads 9,3,64]

Each directory is compiled as scripts/qlinear_ab.py does (cpu_kernels.CFLAGS + KVSCOPE_ISA's flags).
One layer's attention: a prompt of each length (in chunks of --chunk rows, 0 = one call, as the
engine's chunked prefill calls it) over random fp32 K/V in blocks of 16, the default model's heads
(9 query, 3 KV, head dim 64) unless --heads says otherwise, 1 thread. Prints the best of --reps
calls of each build in ms (thread CPU time), its rate over the causal FLOPs (4 x n^2/2 x D x H),
and old / new (> 1: new faster; "!" where the outputs are not bitwise OLD's).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from qlinear_ab import build  # noqa: E402

from engine.model import cpu_kernels, kernel_isa  # noqa: E402


def prefill_lib(csrc: str) -> ctypes.CDLL:
    lib = build(csrc)
    P, I = ctypes.c_void_p, ctypes.c_int
    lib.kvscope_paged_prefill.argtypes = [P, P, P, P, I, I, I, P, I, I, I, I, ctypes.c_float, I]
    lib.kvscope_paged_prefill.restype = I
    return lib


def run(lib, out, q, k_pool, v_pool, table, chunk: int) -> float:
    n = q.shape[0]
    t = time.thread_time()
    for s in range(0, n, chunk or n):
        c = min(chunk or n, n - s)
        cpu_kernels.paged_prefill_attention(lib, out, q, k_pool, v_pool, s, c, s, table, q.shape[2] ** -0.5, 1)
    return time.thread_time() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs=2)
    ap.add_argument("--lengths", default="512,2048,8000")
    ap.add_argument("--chunk", type=int, default=0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--heads", default="9,3,64")
    a = ap.parse_args()
    h, hkv, d = (int(x) for x in a.heads.split(","))
    libs = [prefill_lib(p) for p in a.dirs]
    print(f"ISA path: {kernel_isa.summary()}; heads {h} / {hkv} KV, head dim {d}; chunk {a.chunk or 'whole'}")
    g = torch.Generator().manual_seed(0)
    for n in (int(x) for x in a.lengths.split(",")):
        nb = -(-n // 16)
        q = torch.randn(n, h, d, generator=g)
        k_pool, v_pool = torch.randn(nb, 16, hkv, d, generator=g), torch.randn(nb, 16, hkv, d, generator=g)
        table = torch.randperm(nb, generator=g).to(torch.int32)
        outs = [torch.empty_like(q) for _ in libs]
        best = [float("inf")] * len(libs)
        for _ in range(a.reps):
            for i, lib in enumerate(libs):
                best[i] = min(best[i], run(lib, outs[i], q, k_pool, v_pool, table, a.chunk))
        flop = 4 * n * n / 2 * d * h
        same = "" if torch.equal(outs[0], outs[1]) else " !"
        cells = "  ".join(f"{b * 1e3:9.1f} ms {flop / b / 1e9:6.1f} GFLOP/s" for b in best)
        print(f"{n:6d} positions: {cells}  old/new {best[0] / best[1]:.3f}{same}")


if __name__ == "__main__":
    main()
