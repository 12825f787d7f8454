"""The threads suite: matmul scaling with torch threads (with one core busy when asked)."""

from __future__ import annotations

import os
import subprocess
import sys

from engine.bench import common as C
from engine.bench import machine_rates as MR
from engine.bench import roofline as R
from engine.bench.common import SuiteResult

_SPIN = "import time\nend = time.time() + {secs}\nwhile time.time() < end:\n    pass\n"


def suite_threads(ctx: C.BenchContext) -> SuiteResult:
    """Matmul pass time at 1 thread vs all cores, on the machine as it is now and with one core
    kept busy by a spinning child process (what happens on a shared box), at decode-like rows."""
    import torch

    res = SuiteResult()
    model, _ = ctx.hf()
    shape = R.shape_of(model)
    dt = getattr(torch, ctx.dtype())
    ncpu = os.cpu_count() or 1
    counts = sorted({1, ncpu})
    rows = (1, 16, 64)
    old = torch.get_num_threads()
    table = {}
    try:
        for busy in (False, True):
            spinner = None
            ctx.start("one core kept busy" if busy else "machine as it is")
            if busy:
                spinner = subprocess.Popen([sys.executable, "-c", _SPIN.format(secs=120)])
            try:
                for th in counts:
                    torch.set_num_threads(th)
                    mm = MR.measure_model_matmuls(shape, rows=rows, dtype=dt, min_time=0.2)
                    for m in rows:
                        table[(busy, th, m)] = mm[m]["slab_ms"]
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
            ctx.done("one core kept busy" if busy else "machine as it is")
    finally:
        torch.set_num_threads(old)
    for (busy, th, m), ms in sorted(table.items()):
        res.add(
            f"slab_ms_{'busy' if busy else 'now'}_t{th}_m{m}",
            ms,
            "one pass of all linears + lm_head" + (" + a spinning process" if busy else ""),
        )
    if ncpu > 1:
        for busy in (False, True):
            tag = "busy" if busy else "now"
            res.add(
                f"threads_speedup_{tag}_m16",
                table[(busy, 1, 16)] / table[(busy, ncpu, 16)],
                f"1-thread time / {ncpu}-thread time at 16 rows" + (" with one core busy" if busy else ""),
            )
    res.add("load_avg_1m", round(os.getloadavg()[0], 2), "other processes on the machine during the run")
    return res
