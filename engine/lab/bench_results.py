"""The measurements the Claims page reads, and where they are: the bench's JSON result files
(`python -m engine bench SUITE` writes results/<suite>-<UTC stamp>.json; the newest stamp per suite
is read, with its date), the committed results docs/BENCHMARKS.md quotes (docs/data/, same form)
and the committed `bench kvquant` measurement (assets/measurements/kvquant.json). Reading only: the
claims and their rules are claims.py."""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

_STAMP = re.compile(r"^(?P<suite>[a-z_]+)-(?P<stamp>\d{8}T\d{6}Z)\.json$")
KVQUANT_JSON = Path(__file__).resolve().parents[2] / "assets" / "measurements" / "kvquant.json"
DOCS_DATA = Path(__file__).resolve().parents[2] / "docs" / "data"


@dataclass(frozen=True, slots=True)
class BenchResult:
    suite: str
    path: str
    when: _dt.datetime
    model: str
    quick: bool
    fields: dict
    machine: dict | None = None

    @property
    def label(self) -> str:
        return (
            f"bench '{self.suite}' ({'quick, ' if self.quick else ''}model {self.model}), "
            f"{Path(self.path).name}, {self.when:%Y-%m-%d %H:%M} UTC"
        )


def results_dir() -> Path:
    """Where bench writes its results: $KVSCOPE_RESULTS_DIR, else results/ in the repository."""
    return Path(os.environ.get("KVSCOPE_RESULTS_DIR") or Path(__file__).resolve().parents[2] / "results")


def latest_results(folder: str | os.PathLike | None = None) -> dict[str, BenchResult]:
    """The newest stamped result file per suite in `folder` (results/ by default); {} if none.
    Files that are not valid bench JSON are skipped."""
    d = Path(folder) if folder is not None else results_dir()
    if not d.is_dir():
        return {}
    best: dict[str, tuple[str, Path]] = {}
    for f in d.iterdir():
        m = _STAMP.match(f.name)
        if m and (m["suite"] not in best or m["stamp"] > best[m["suite"]][0]):
            best[m["suite"]] = (m["stamp"], f)
    out = {}
    for suite, (stamp, f) in best.items():
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or not isinstance(data.get("fields"), dict):
            continue
        when = _dt.datetime.strptime(stamp, "%Y%m%dT%H%M%SZ")
        machine = data.get("machine") if isinstance(data.get("machine"), dict) else None
        out[suite] = BenchResult(
            suite, str(f), when, str(data.get("model")), bool(data.get("quick")), data["fields"], machine
        )
    return out


def committed(suite: str, folder: str | os.PathLike | None = None) -> BenchResult | None:
    """The newest result of `suite` committed in docs/data (what docs/BENCHMARKS.md quotes), or None."""
    return latest_results(folder if folder is not None else DOCS_DATA).get(suite)


def machine_text(r: BenchResult) -> str:
    """Where a result was measured, in words: CPU, CPUs, ISA path, threads."""
    m = r.machine or {}
    parts = [str(m[k]) for k in ("cpu",) if m.get(k)]
    if parts and m.get("cpu_id"):
        parts[0] += f" ({m['cpu_id']})"
    if m.get("nproc"):
        parts.append(f"{m['nproc']} CPUs")
    if m.get("isa"):
        parts.append(str(m["isa"]))
    if m.get("torch_threads"):
        parts.append(f"{m['torch_threads']} thread(s)")
    return ", ".join(parts) or "machine not recorded"


def number(d: dict, k: str) -> float | None:
    """d[k] as a float when it is a number (not a bool), else None."""
    v = d.get(k)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def shown_dir() -> str:
    """results_dir() relative to the repository when inside it (the page never shows where this
    checkout happens to live)."""
    d, root = results_dir().resolve(), Path(__file__).resolve().parents[2]
    return str(d.relative_to(root)) if d.is_relative_to(root) else str(d)


def missing(suite: str) -> str:
    """Why a claim from `suite` has no number: no result file, and the command that makes one."""
    return f"not measured yet: no '{suite}' bench result in {shown_dir()} (run: python -m engine bench {suite} --quick)"


def committed_kvquant(path: str | os.PathLike | None = None) -> dict | None:
    """The committed `bench kvquant` measurement (what the Memory calculator shows), or None."""
    p = Path(path) if path is not None else KVQUANT_JSON
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("dtypes"), dict) else None
