"""Long-range recall of a quantized K/V cache up to the model's own context: a needle (a 4-digit
access code) at depths 0.1 / 0.5 / 0.9 of prompts of 1k, 2k, 4k and 8k tokens, for each pool
format, scored as `bench kvquant` scores its needles (engine/bench/kvquant.py needle_scores:
teacher-forced, a hit when the argmax at every code token is the code; and log p of the code).

One engine per format is kept alive, and the grid runs length by length (shortest first), every
format at each length, so a run cut short still compares the formats at the lengths it reached.
After each (length, format) the grid so far is written to OUT (JSON); a rerun with the same OUT
resumes, skipping what OUT already holds. A quantized format runs only the needles fp32 recalls
at that length (null in OUT for the others: where fp32 misses, no format can show a loss). A
format that recalls none of the needles fp32 recalls at two lengths in a row is not run at longer
ones (it has nothing left to lose; "skipped" in OUT says where). `--merge` puts the grid into
assets/measurements/kvquant.json as "recall_grid", where the kv_quant Claims row and the Memory calculator read it.

    PYTHONPATH=. HF_HUB_OFFLINE=1 nice -n 19 .venv/bin/python scripts/kv_recall_grid.py OUT [--no-skip]
    PYTHONPATH=. .venv/bin/python scripts/kv_recall_grid.py OUT --merge
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

from engine.bench import common as C
from engine.bench.kvquant import ASSET, needle_scores

DTYPES = ("fp32", "int8", "int4", "int2")
CONTEXTS = (1024, 2048, 4096, 8192)
DEPTHS = (0.1, 0.5, 0.9)
MODEL = "default"
NO_SKIP = "--no-skip" in sys.argv  # run every format at every length (a resumed run completes the grid)


def write(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def merge(path: str, asset: str = ASSET) -> None:
    with open(path) as f:
        grid = json.load(f)
    with open(asset) as f:
        data = json.load(f)
    data["recall_grid"] = grid
    write(asset, data)
    print(f"recall_grid from {path} merged into {asset}")


def main() -> None:
    out = sys.argv[1]
    if "--merge" in sys.argv[2:]:
        merge(out)
        return
    from engine import LLM
    from engine.lab import prompt_sets as PS

    max_len = max(CONTEXTS)
    engines = {}
    for dt in DTYPES:
        engines[dt] = LLM(
            model=MODEL,
            kv_cache_dtype=dt,
            enable_prefix_caching=False,
            max_model_len=max_len,
            max_num_seqs=1,
            num_kv_blocks=max_len // 16 + 8,
        ).engine
    tok = engines["fp32"].tokenizer
    info = C.machine_info()
    old = None
    if os.path.exists(out):
        with open(out) as f:
            old = json.load(f)
    grid = {
        "command": "scripts/kv_recall_grid.py (nice -n 19)",
        "model": MODEL,
        "machine": {k: info.get(k) for k in ("cpu", "nproc", "torch", "torch_threads", "load_avg_1m_at_start")},
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dtypes": list(DTYPES),
        "contexts": [],
        "depths": list(DEPTHS),
        "prompt_tokens": {},
        "answers": {},
        "hit": {dt: {} for dt in DTYPES},
        "logprob": {dt: {} for dt in DTYPES},
        "seconds": {dt: {} for dt in DTYPES},
        "skipped": {dt: [] for dt in DTYPES},
    }
    if old is not None:  # resume: keep what an earlier (interrupted) run measured
        for k in ("started_at", "contexts", "prompt_tokens", "answers", "hit", "logprob", "seconds", "resumed_at"):
            if k in old:
                grid[k] = old[k]
        grid.setdefault("resumed_at", []).append(
            datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        )
    for c in CONTEXTS:
        needles = PS.needle_prompts(tok, depths=DEPTHS, n_codes=1, context_tokens=c)
        key = str(c)
        grid["prompt_tokens"][key] = [n.context_tokens for n in needles]
        grid["answers"][key] = [n.answer for n in needles]
        for dt in DTYPES:
            if key in grid["hit"][dt]:
                continue
            done = [k for k in sorted(grid["hit"][dt], key=int)][-2:]
            ref = grid["hit"]["fp32"]
            if (
                not NO_SKIP
                and dt != "fp32"
                and len(done) == 2
                and all(any(ref[k]) and not any(h and r for h, r in zip(grid["hit"][dt][k], ref[k])) for k in done)
            ):
                grid["skipped"][dt].append(c)
                print(f"{c} tokens {dt}: skipped (no needle fp32 recalls at {done})", flush=True)
                continue
            t = time.time()
            # a format runs only the needles fp32 recalls at this length (where fp32 misses, no
            # format can show a loss): null in OUT for the others
            todo = [i for i in range(len(needles)) if dt == "fp32" or grid["hit"]["fp32"][key][i]]
            got_hits, got_lps = needle_scores(engines[dt], [needles[i] for i in todo])
            hits, lps = [None] * len(needles), [None] * len(needles)
            for i, h, lp in zip(todo, got_hits, got_lps):
                hits[i], lps[i] = h, lp
            s = time.time() - t
            grid["hit"][dt][key] = hits
            grid["logprob"][dt][key] = [None if x is None else round(x, 4) for x in lps]
            grid["seconds"][dt][key] = round(s, 1)
            grid["finished_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            write(out, grid)
            print(
                f"{time.strftime('%H:%M:%S')} {c} tokens {dt}: hits {hits} log p {[x and round(x, 2) for x in lps]} "
                f"({s:.0f} s, load {os.getloadavg()[0]:.2f})",
                flush=True,
            )
        if c not in grid["contexts"]:
            grid["contexts"].append(c)
        write(out, grid)
    print("done", flush=True)


if __name__ == "__main__":
    main()
