"""Batch-1 decode at a long context, end to end: one request of --context random tokens prefilled
once (at --prefill-threads), then its decode steps timed at --threads; prints one JSON line: tok/s
(wall, and this thread's CPU time), the C stack's per-op ms per step (engine/model/csrc/layer.c's
timer), the read bandwidth measured after (machine_rates.measure_read_bandwidth, at --threads) and the
memory roof: the default model's weights as read (96.6 MB) plus its fp32 K/V at the mean context
(30 layers x 2 x 3 KV heads x 64 x 4 B per position), over that bandwidth.

    python scripts/decode_at_context.py [--context 8000] [--new 40] [--threads 1]

A/B of two trees: run it with PYTHONPATH set to each, alternating.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.bench.decode_bs1 import KernelTimer  # noqa: E402
from engine.bench.machine_rates import measure_read_bandwidth  # noqa: E402

WEIGHT_BYTES = 96.6e6
KV_BYTES_PER_POSITION = 30 * 2 * 3 * 64 * 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--new", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefill-threads", type=int, default=2)
    a = ap.parse_args()
    llm = LLM(
        num_threads=a.prefill_threads,
        max_model_len=a.context + a.new + 64,
        max_num_seqs=2,
        num_kv_blocks=(a.context + a.new) // 16 + 16,
    )
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(a.context)]
    llm.generate([prompt[:16]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    eng = llm.engine
    eng.add_request("ctx", prompt, SamplingParams(temperature=0.0, max_tokens=a.new, ignore_eos=True))
    t0 = time.perf_counter()
    while not any(len(o.outputs[0].token_ids) for o in eng.step() if getattr(o, "request_id", None) == "ctx"):
        pass
    prefill_s = time.perf_counter() - t0
    eng.cpu_threads = a.threads  # the engine sets torch's count to this before each step
    torch.set_num_threads(a.threads)
    steps, wall, cpu = 0, 0.0, 0.0
    with KernelTimer(eng.runner) as tm:
        tm.restart_ops()
        while eng.has_unfinished_requests():
            t, c = time.perf_counter(), time.thread_time()
            eng.step()
            wall, cpu, steps = wall + time.perf_counter() - t, cpu + time.thread_time() - c, steps + 1
    bw = measure_read_bandwidth(1024)
    roof = bw * 1e9 / (WEIGHT_BYTES + (a.context + steps / 2) * KV_BYTES_PER_POSITION)
    out = {
        "engine": os.path.dirname(sys.modules["engine"].__file__),
        "threads": a.threads,
        "context": a.context,
        "prefill_s": round(prefill_s, 1),
        "steps": steps,
        "tok_s": round(steps / wall, 2),
        "tok_s_cpu": round(steps / cpu, 2),
        "ms_per_step": {k: round(v / steps * 1e3, 2) for k, v in tm.ops_s.items()},
        "bw_gb_s": round(bw, 2),
        "roof_tok_s": round(roof, 1),
        "share_of_roof": round(steps / wall / roof, 3),
        "load_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
