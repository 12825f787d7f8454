"""Writes docs/scaling.svg and prints docs/BENCHMARKS.md's opening table from stored `bench
scaling` results (default: the newest results/scaling-*.json; or one or more paths, merged point by
point: scaling_points.merge). The figure is ui/figures/scaling.scaling_figure of the fields;
kaleido renders it with Chromium.

    .venv/bin/python scripts/scaling_figure.py [RESULT.json ...] [--out docs/scaling.svg]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def from_partial(part: dict, done: dict) -> dict:
    """A run's points saved segment by segment (engine/bench/scaling.py's scaling-partial.json),
    with limits from the roofs that run measured at its start and, for the bytes one decode step
    reads, a complete run's value (the same engine, model and weight format)."""
    from engine.bench import scaling as S
    from engine.bench.common import load_hf_model
    from engine.bench.roofline import ModelShape

    model, _ = load_hf_model("default", "float32")
    shape = ModelShape.from_config(model.config)
    roofs = dict(part["roofs_at_start"])
    roofs["weight_bytes_read_per_step"] = done["roofs"]["weight_bytes_read_per_step"]
    peers = dict(part.get("peers") or {})
    for e in ("llamacpp", "vllm"):
        peers.setdefault(e, "run cut short before this peer finished")
    return {
        "grid": part["grid"],
        "roofs": roofs,
        "points": part["points"],
        "limits": S.limits_for(shape, part["grid"], roofs, 4),
        "peers": peers,
        "isa": done.get("isa"),
        "threads": done.get("threads"),
        "segments": part.get("segments") or [],
        "partial": True,
    }


def main() -> int:
    from engine.bench import scaling_points as SP
    from engine.bench.report import find_chromium
    from engine.lab.bench_results import latest_results
    from ui.figures.scaling import scaling_figure

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", nargs="*", help="results/scaling-*.json files (default: the newest one)")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "scaling.svg"))
    args = p.parse_args()
    latest = latest_results().get("scaling")
    paths = args.result or ([latest.path] if latest else [])
    if not paths:
        print("no scaling result: run `python -m engine bench scaling` (or --quick) first", file=sys.stderr)
        return 2
    datas = [json.loads(open(p_).read()) for p_ in paths]
    complete = [d for d in datas if "fields" in d]
    for d in datas:
        if "fields" not in d:  # <out>/scaling-partial.json of a run cut short: its limits from here
            if not complete:
                print("a partial result needs a complete one beside it (its weight bytes)", file=sys.stderr)
                return 2
            d["fields"] = from_partial(d, complete[0]["fields"])
    fields, machine = SP.merge([d["fields"] for d in datas]), (complete[0].get("machine") if complete else {}) or {}
    path = " + ".join(paths)
    fig = scaling_figure(fields, machine, height=460)
    browser = find_chromium()
    if browser:
        os.environ.setdefault("BROWSER_PATH", browser)
    fig.write_image(args.out, width=1200, height=460)
    print(f"wrote {args.out} from {path}", file=sys.stderr)
    print(SP.markdown_table(fields))
    print()
    print(json.dumps(SP.goals(SP.table(fields), fields)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
