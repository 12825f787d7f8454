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


def main() -> int:
    from engine.bench import scaling_points as SP
    from engine.bench.report import find_chromium
    from engine.lab.claims import latest_results
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
    fields, machine = SP.merge([d["fields"] for d in datas]), datas[0].get("machine") or {}
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
