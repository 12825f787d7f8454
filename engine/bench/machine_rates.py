"""The machine's measured rates, in this process: matmul GFLOP/s on the model's own Linear shapes
per kernel (torch's F.linear, the engine's packed fp32 Linears, the engine's Q4_1 kernel, which is
AMX's tiles where they run), the best of them per row count, memory read bandwidth, and the thread
count a decode-like pass runs fastest at. `shape` is a roofline.ModelShape (its Linear shapes and
FLOPs); the roofs built from these rates are roofline.py's."""

from __future__ import annotations

import time


def _best_time(fn, min_reps: int = 3, min_time: float = 0.15, max_reps: int = 200) -> float:
    fn()  # warm-up (allocations, kernel selection)
    times = []
    t_start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - t_start < min_time):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure_linear(M: int, K: int, N: int, dtype=None, min_time: float = 0.15) -> float:
    """Best-of seconds for F.linear([M x K], [N x K]) — the shape an nn.Linear runs."""
    import torch
    import torch.nn.functional as F

    dtype = dtype or torch.float32
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    with torch.inference_mode():
        return _best_time(lambda: F.linear(x, w), min_time=min_time)


def _packed_linear():
    """engine/model/linear.py where its packed-Linear kernel runs here, else None."""
    try:
        from engine.model import linear as L
    except ImportError:
        return None
    return L if L.best_kernel() is not None else None


def measure_model_matmuls(
    shape, rows=(1, 16, 64, 256), dtype=None, min_time: float = 0.3, on_progress=None, kernel: str = "torch"
) -> dict:
    """Runs the model's real linear layers at M rows: every layer has its own weights (so batch-1
    passes stream them from memory as a real decode step does, instead of re-reading one matrix
    from cache), then the lm_head. Returns, per M, GFLOP/s of the decoder body, of the lm_head and
    of the whole token-slab, and the slab time in ms (best of several passes).

    kernel="torch": one F.linear per projection (what transformers runs); kernel="packed": the
    engine's CPU path (engine/model/linear.py: packed weights, q/k/v and gate/up each one matmul; same
    FLOPs); kernel="q4_1": the engine's Q4_1 kernel (csrc/quant_linear.c, or AMX's tiles where they
    run) on random Q4_1 blocks of each projection's shape (same FLOPs, 5 bits a weight). Raises
    ValueError when "packed" / "q4_1" is not available here."""
    import torch
    import torch.nn.functional as F

    dtype = dtype or torch.float32
    g = torch.Generator().manual_seed(0)
    lin = shape.layer_linears()
    if kernel == "packed":
        L = _packed_linear()
        if L is None or dtype != torch.float32:
            raise ValueError("the packed-Linear kernel needs float32 and the C kernel or oneDNN")
        pack, apply = (lambda w: L.matmul_for([w])), (lambda x, mm: mm(x))
        names = [n for n, _, _ in lin]
        # the projections the engine merges (engine/model/linear.py's rule), the rest one matmul each
        groups = [list(m) for _, m in L.MERGED_GROUPS if set(m) <= set(names)]
        groups += [[n] for n in names if not any(n in g for g in groups)]
        groups.sort(key=lambda g: names.index(g[0]))  # in the layer's order
        by = {n: (k, nn) for n, k, nn in lin}
        shapes = [(by[grp[0]][0], sum(by[x][1] for x in grp)) for grp in groups]
    else:
        apply = F.linear
        shapes = [(k, n) for _, k, n in lin]
    _, K, N = shape.lm_head()
    if kernel == "q4_1":
        lib = _quant_lib(dtype)
        apply = lambda x, q: q(x)  # noqa: E731
        layers = [[_random_q4_1(lib, k, n, seed=i) for k, n in shapes] for i in range(shape.layers)]
        head = _random_q4_1(lib, K, N, seed=-1)
    else:
        layers = [[(torch.randn(N, K, generator=g) * 0.02).to(dtype) for K, N in shapes] for _ in range(shape.layers)]
        head = (torch.randn(N, K, generator=g) * 0.02).to(dtype)
    if kernel == "packed":
        layers = [[pack(w) for w in ws] for ws in layers]
        head = pack(head)
    ks = [k for k, _ in shapes]
    out = {}
    with torch.inference_mode():
        for M in rows:
            xs = {k: torch.randn(M, k, generator=g).to(dtype) for k in set(ks) | {shape.hidden}}

            def body():
                for ws in layers:
                    for k, w in zip(ks, ws):
                        apply(xs[k], w)  # noqa: B023 (called within this iteration)

            xh = xs[shape.hidden]
            t_body = _best_time(body, min_reps=2, min_time=min_time, max_reps=50)
            t_head = _best_time(lambda: apply(xh, head), min_reps=2, min_time=min_time / 3, max_reps=50)  # noqa: B023
            f_body = M * shape.flops_body()
            f_head = M * shape.flops_lm_head()
            out[M] = {
                "body_gflops": f_body / t_body / 1e9,
                "lm_head_gflops": f_head / t_head / 1e9,
                "all_gflops": (f_body + f_head) / (t_body + t_head) / 1e9,
                "slab_ms": (t_body + t_head) * 1e3,
            }
            if on_progress:
                on_progress(M)
    return out


def _quant_lib(dtype):
    import torch

    from engine.model import cpu_kernels

    lib = cpu_kernels.load()
    if lib is None or dtype != torch.float32:
        raise ValueError("the Q4_1 kernel needs float32 and the C kernels")
    return lib


def _random_q4_1(lib, k: int, n: int, seed: int):
    """x -> x W^T with W [n, k] random Q4_1 blocks (fp16 scales and mins near a trained model's)."""
    import numpy as np

    from engine.model import cpu_kernels

    rng = np.random.default_rng(seed + 1000)
    nb = n * k // 32
    d = (rng.random((nb, 1)) * 0.004 + 0.001).astype(np.float16).view(np.uint8)
    m = (-rng.random((nb, 1)) * 0.03).astype(np.float16).view(np.uint8)
    blocks = np.concatenate([d, m, rng.integers(0, 256, (nb, 16), dtype=np.uint8)], axis=1).reshape(n, -1)
    panels = cpu_kernels.qpack(lib, cpu_kernels.QUANT_TYPES["Q4_1"], blocks, n, k)
    return lambda x: cpu_kernels.qlinear(lib, cpu_kernels.QUANT_TYPES["Q4_1"], x, panels, n)


def measure_best_matmuls(shape, rows, dtype=None, min_time: float = 0.3) -> tuple[dict, dict]:
    """The machine's matmul rate at each M with the best kernel available in this process: the
    stock F.linear and, where it runs, the engine's packed path; per M the faster one. Returns
    (best per M with "kernel" named, {kernel: per-M results})."""
    by_kernel = {"torch": measure_model_matmuls(shape, rows=rows, dtype=dtype, min_time=min_time)}
    try:
        by_kernel["packed"] = measure_model_matmuls(shape, rows=rows, dtype=dtype, min_time=min_time, kernel="packed")
    except ValueError:
        pass
    best = {}
    for m in rows:
        name = max(by_kernel, key=lambda k: by_kernel[k][m]["all_gflops"])
        best[m] = dict(by_kernel[name][m], kernel=name)
    return best, by_kernel


def measure_read_bandwidth(mbytes: int = 512, dtype=None) -> float:
    """GB/s (1e9 B/s) reading a large tensor (in the engine's weight / KV memory) once, best of a few."""
    import torch

    from engine.model import huge_pages

    dtype = dtype or torch.float32
    n = mbytes * 1024 * 1024 // dtype.itemsize
    x = huge_pages.empty(n, dtype).fill_(1)
    nbytes = x.numel() * x.element_size()
    with torch.inference_mode():
        t = _best_time(lambda: x.sum(), min_reps=4, min_time=0.5, max_reps=20)
    return nbytes / t / 1e9


def probe_threads(shape, candidates=None, rounds: int = 3, layers: int = 6, dtype=None) -> dict:
    """Picks torch's intra-op thread count for this run by measurement: times a decode-like pass
    (the model's linears for `layers` layers at 1 and 16 rows) at each candidate count, alternating
    candidates for `rounds` rounds, best time per candidate. On a shared machine, a 2-thread
    OpenMP region waits for its slowest thread, so when another process holds a core more threads
    can be several times slower than one. Returns {"threads": best, "ms": {n: best ms}}."""
    import os

    import torch
    import torch.nn.functional as F

    dtype = dtype or torch.float32
    ncpu = os.cpu_count() or 1
    candidates = sorted(set(candidates or (1, ncpu, torch.get_num_threads())))
    g = torch.Generator().manual_seed(0)
    ws = [
        [(torch.randn(N, K, generator=g) * 0.02).to(dtype) for _, K, N in shape.layer_linears()] for _ in range(layers)
    ]
    ks = [K for _, K, _ in shape.layer_linears()]
    xs = {(m, k): torch.randn(m, k, generator=g).to(dtype) for m in (1, 16) for k in set(ks)}

    def one_pass():
        for m in (1, 16):
            for layer in ws:
                for k, w in zip(ks, layer):
                    F.linear(xs[(m, k)], w)

    old = torch.get_num_threads()
    best = {n: float("inf") for n in candidates}
    try:
        with torch.inference_mode():
            for _ in range(rounds):
                for n in candidates:
                    torch.set_num_threads(n)
                    one_pass()  # settle the pool at this size
                    t = time.perf_counter()
                    one_pass()
                    best[n] = min(best[n], time.perf_counter() - t)
    finally:
        torch.set_num_threads(old)
    pick = min(best, key=best.get)
    return {"threads": pick, "ms": {n: v * 1e3 for n, v in best.items()}}


# ---------------------------------------------------------------------------- batch-1 decode per weight format


# ---------------------------------------------------------------------------- roofline
