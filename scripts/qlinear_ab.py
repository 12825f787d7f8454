"""Kernel A/B: kvscope_qlinear of two builds of engine/model/csrc, alternating in one process.

    python scripts/qlinear_ab.py OLD_CSRC_DIR NEW_CSRC_DIR [MORE_DIRS...] [--threads 1] [--rows 1,5,8,16,64,256]
        [--type q4_1|q8_0] [--shapes gate_up,down,qkv,lm_head] [--model]

Each directory's .c files are compiled with cpu_kernels.CFLAGS (+ KVSCOPE_ISA's flags) into /tmp,
the row path tuned as the engine's is when it loads (KVSCOPE_QL_SCRATCH_ROWS as there), the same
random Q4_1 blocks (finite scales) are packed by each (into huge-page memory, as the engine's), and
the best of --reps calls of each is printed in microseconds with the ratio old / new (> 1: new
faster; "!" after it where the outputs are not bitwise OLD's) and the kernel path (further
directories: their times and ratios against OLD too). At 1 thread the clock is the thread's CPU
time (time.thread_time), so time the scheduler gives other processes on a shared machine is not
counted; at more threads it is wall time.

--model: instead of one matrix re-read from cache, the default model's whole step as the engine
runs it from memory: 30 layers' qkv / o / gate_up / down, each layer its own Q4_1 weights (97 MB
with the lm_head, more than the L3), then the Q8_0 lm_head; per build the best sweep, with the
seconds of each shape summed over the layers.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import hashlib
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.model import cpu_kernels, kernel_isa  # noqa: E402

SHAPES = {"gate_up": (3072, 576), "down": (576, 1536), "qkv": (960, 576), "lm_head": (49152, 576)}
LAYER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30
Q4_1, Q8_0 = 3, 8


def build(csrc: str) -> ctypes.CDLL:
    srcs = sorted(glob.glob(os.path.join(csrc, "*.c")))
    flags = cpu_kernels.CFLAGS + cpu_kernels.isa_flags()
    blob = b"".join(open(p, "rb").read() for p in sorted(glob.glob(os.path.join(csrc, "*")))) + " ".join(flags).encode()
    out = f"/tmp/qlinear_ab_{hashlib.sha256(blob).hexdigest()[:12]}.so"
    if not os.path.exists(out):
        subprocess.run(["gcc", *flags, "-o", out, *srcs], check=True)
    lib = ctypes.CDLL(out)
    P, I = ctypes.c_void_p, ctypes.c_int
    lib.kvscope_qpanel_bytes.argtypes = [I, I, I]
    lib.kvscope_qpanel_bytes.restype = ctypes.c_longlong
    lib.kvscope_qpack.argtypes = [I, P, ctypes.c_longlong, P, I, I, P]
    lib.kvscope_qlinear.argtypes = [I, P, I, I, P, I, P, P, I]
    lib.kvscope_qlinear_scratch_rows.argtypes = [I]
    cpu_kernels.tune_row_path(lib)  # the row path the engine would run on this CPU
    cpu_kernels.env_switches(lib)  # AMX tiles for Q4_1 (and from how many rows) as the engine would run them
    return lib


def q4_1_blocks(n: int, k: int, rng) -> np.ndarray:
    blk = rng.integers(0, 256, size=(n, k // 32, 20), dtype=np.uint8)
    blk[:, :, 0:2] = np.frombuffer(np.float16(0.02).tobytes(), np.uint8)
    blk[:, :, 2:4] = np.frombuffer(np.float16(-0.15).tobytes(), np.uint8)
    return np.ascontiguousarray(blk)


def q8_0_blocks(n: int, k: int, rng) -> np.ndarray:
    blk = rng.integers(0, 256, size=(n, k // 32, 34), dtype=np.uint8)
    blk[:, :, 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return np.ascontiguousarray(blk)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("more", nargs="*")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,5,8,16,64,256")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--type", choices=["q4_1", "q8_0"], default="q4_1", help="the weights' GGUF type")
    ap.add_argument("--shapes", default="gate_up,down,qkv", help=f"of {','.join(SHAPES)}")
    ap.add_argument("--model", action="store_true", help="the model's 30 layers + lm_head from memory")
    a = ap.parse_args()
    libs = {"old": build(a.old), "new": build(a.new)}
    libs.update({os.path.basename(os.path.normpath(d)): build(d) for d in a.more})
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    rng = np.random.default_rng(0)
    print(f"kernel_isa={kernel_isa.summary()} threads={a.threads} load={os.getloadavg()[0]:.2f} clock={clock.__name__}")
    if a.model:
        return model_sweeps(a, libs, clock, rng)
    qtype, make = (Q8_0, q8_0_blocks) if a.type == "q8_0" else (Q4_1, q4_1_blocks)
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        blocks = make(n, k, rng)
        packed = {tag: pack(lib, qtype, blocks, n, k) for tag, lib in libs.items()}
        line = []
        for m in [int(r) for r in a.rows.split(",")]:
            x = rng.standard_normal((m, k)).astype(np.float32)
            ys = {t: np.zeros((m, n), np.float32) for t in libs}
            best = {t: 1e30 for t in libs}
            reps = max(2, int(2e5 / (m * n * k / 1e3 + 50)))
            for _ in range(a.reps):
                for t, lib in libs.items():
                    args = (qtype, x.ctypes.data, m, k, packed[t].ctypes.data, n, None, ys[t].ctypes.data, a.threads)
                    lib.kvscope_qlinear(*args)
                    t0 = clock()
                    for _ in range(reps):
                        lib.kvscope_qlinear(*args)
                    best[t] = min(best[t], (clock() - t0) / reps * 1e6)
            # "!" after a ratio: that build's outputs differ from OLD's in some bit
            mark = {t: "" if np.array_equal(ys[t].view(np.uint32), ys["old"].view(np.uint32)) else "!" for t in libs}
            cells = [f"{best[t]:.0f} us ({best['old'] / best[t]:.2f}x{mark[t]})" for t in libs if t != "old"]
            line.append(f"M={m}: {best['old']:.0f} -> " + " / ".join(cells))
        print(f"{name} {n}x{k}: " + "; ".join(line), flush=True)


def pack(lib, qtype: int, blocks: np.ndarray, n: int, k: int) -> np.ndarray:
    """The blocks packed by this build, into memory as the engine packs its weights (cpu_kernels.qpack)."""
    return cpu_kernels.qpack(lib, qtype, blocks, n, k).numpy()


def model_sweeps(a, libs: dict, clock, rng) -> None:
    """--model: per row count, each build's best sweep over the layers' Linears and the lm_head."""
    mats = [(name, Q4_1, n, k, q4_1_blocks(n, k, rng)) for _ in range(LAYERS) for name, (n, k) in LAYER.items()]
    mats.append(("lm_head", Q8_0, *SHAPES["lm_head"], q8_0_blocks(*SHAPES["lm_head"], rng)))
    packed = {t: [pack(lib, qt, blk, n, k) for _, qt, n, k, blk in mats] for t, lib in libs.items()}
    flops = {name: 0 for name, *_ in mats}
    for name, _, n, k, _ in mats:
        flops[name] += 2 * n * k
    for m in [int(r) for r in a.rows.split(",")]:
        xs = {k: rng.standard_normal((m, k)).astype(np.float32) for k in (576, 1536)}
        ys = {t: [np.zeros((m, n), np.float32) for _, _, n, _, _ in mats] for t in libs}
        best = {t: (1e30, {}) for t in libs}
        for _ in range(a.reps):
            for t, lib in libs.items():
                per = dict.fromkeys(flops, 0.0)
                for (name, qt, n, k, _), pan, y in zip(mats, packed[t], ys[t]):
                    t0 = clock()
                    lib.kvscope_qlinear(qt, xs[k].ctypes.data, m, k, pan.ctypes.data, n, None, y.ctypes.data, a.threads)
                    per[name] += clock() - t0
                if sum(per.values()) < best[t][0]:
                    best[t] = (sum(per.values()), per)
        same = {
            t: all(np.array_equal(u.view(np.uint32), v.view(np.uint32)) for u, v in zip(ys[t], ys["old"])) for t in libs
        }
        cells = []
        for t in libs:
            tot, per = best[t]
            shapes = ", ".join(f"{name} {m * f / per[name] / 1e9:.0f}" for name, f in flops.items())
            ratio = "" if t == "old" else f" ({best['old'][0] / tot:.2f}x{'' if same[t] else '!'})"
            cells.append(f"{t} {tot * 1e3:.2f} ms{ratio} [GFLOP/s: {shapes}]")
        print(f"M={m}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
