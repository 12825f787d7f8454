"""Output of the benchmark command: a progress bar on stderr (tqdm), a readable table, one JSON line, files
under results/ and optional PNG plots (Plotly + kaleido, only when a Chromium is installed).

Pure formatting lives here so that tests can check it without running a model.
"""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import sys
import time

import pandas as pd
from tqdm import tqdm


class BenchUnavailable(RuntimeError):
    """A suite needs an engine feature that is missing; the suite reports it and exits non-zero."""


# ---------------------------------------------------------------------------- progress bar


class Progress:
    """The bench's progress bar on stderr (tqdm): `bench phase [#####...] 3/6 (12.3 s)`.

    ctx.start(phase) names the phase about to run; ctx.done(phase) advances the bar by one."""

    def __init__(self, total: int, label: str = "", stream=None, width: int = 24):
        self.total = max(1, int(total))
        self.label = label
        self.bar = tqdm(
            total=self.total,
            desc=label,
            file=stream if stream is not None else sys.stderr,
            ascii=".#",
            bar_format="{desc} [{bar:%d}] {n_fmt}/{total_fmt} ({elapsed_s:.1f} s)" % width,
            mininterval=0,
            miniters=1,
            dynamic_ncols=False,
            leave=True,
        )

    @property
    def done(self) -> int:
        return self.bar.n

    def start(self, phase: str) -> None:
        """Announce a phase that is about to run (does not advance the bar)."""
        self.bar.set_description_str(f"{self.label} {phase} ...")

    def advance(self, phase: str = "", n: int = 1) -> None:
        self.bar.set_description_str(f"{self.label} {phase}".rstrip(), refresh=False)
        self.bar.update(max(0, min(n, self.total - self.bar.n)))
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


# ---------------------------------------------------------------------------- values


def fmt_value(v) -> str:
    """Human formatting: 3 significant digits for floats, thousands separators for ints."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        a = abs(v)
        if a == 0:
            return "0"
        if a >= 1000:
            return f"{v:,.0f}"
        if a >= 100:
            return f"{v:.1f}"
        if a >= 1:
            return f"{v:.2f}"
        if a >= 0.01:
            return f"{v:.3f}"
        return f"{v:.2e}"
    if isinstance(v, (list, tuple)):
        s = ", ".join(fmt_value(x) for x in v)
        return s if len(s) <= 60 else s[:57] + "..."
    if isinstance(v, dict):
        s = json.dumps(jsonable(v), separators=(",", ":"))
        return s if len(s) <= 60 else s[:57] + "..."
    return str(v)


def format_table(rows, title: str | None = None, headers=("metric", "value", "note")) -> str:
    """rows: iterable of (name, value[, note]). Returns a monospace table as one string (pandas):
    names left-aligned, values (fmt_value) right-aligned, notes left-aligned."""
    body = [
        (str(r[0]), fmt_value(r[1]), str(r[2]) if len(r) > 2 and r[2] is not None else "") for r in map(tuple, rows)
    ]
    df = pd.DataFrame(body, columns=list(headers))
    w0 = max([len(headers[0])] + [len(b[0]) for b in body])
    w1 = max([len(headers[1])] + [len(b[1]) for b in body])
    w2 = max([len(b[2]) for b in body] or [0])
    text = df.to_string(
        index=False,
        header=False,
        formatters={  # pandas right-justifies: pad each cell
            headers[0]: lambda v: f"{v:<{w0}}",
            headers[1]: lambda v: f" {v:>{w1}}",
            headers[2]: lambda v: f" {v:<{w2}}",
        },
    )
    lines = [title] if title else []
    lines.append(f"{headers[0]:<{w0}}  {headers[1]:>{w1}}  {headers[2]}".rstrip())
    lines.append(f"{'-' * w0}  {'-' * w1}  {'-' * max(4, len(headers[2]))}")
    lines += [ln.rstrip() for ln in text.splitlines()] if body else []
    return "\n".join(lines)


def jsonable(obj):
    """Plain JSON data: NaN/inf become null, tuples lists, unknown objects their str()."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(x) for x in obj]
    try:  # numpy / torch scalars
        return jsonable(obj.item())
    except Exception:
        return str(obj)


def json_line(obj) -> str:
    """One line of JSON (no newlines inside), suitable as the last line of stdout."""
    return json.dumps(jsonable(obj), separators=(",", ":"), allow_nan=False, sort_keys=False)


# ---------------------------------------------------------------------------- files


def results_dir(path: str | None = None) -> str:
    d = path or os.environ.get("KVSCOPE_RESULTS_DIR") or "results"
    os.makedirs(d, exist_ok=True)
    return d


def write_results(name: str, payload: dict, out_dir: str) -> str:
    """Writes results/<name>-<UTC time>.json and results/<name>-latest.json; returns the first."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = os.path.join(out_dir, f"{name}-{stamp}.json")
    text = json.dumps(jsonable(payload), indent=2, allow_nan=False)
    for p in (path, os.path.join(out_dir, f"{name}-latest.json")):
        with open(p, "w") as f:
            f.write(text + "\n")
    return path


def find_chromium() -> str | None:
    """A Chromium/Chrome executable for kaleido, or None."""
    env = os.environ.get("BROWSER_PATH")
    if env and os.path.exists(env):
        return env
    for exe in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome"):
        p = shutil.which(exe)
        if p:
            return p
    home = os.path.expanduser("~")
    for pat in (
        os.path.join(home, ".cache", "ms-playwright", "chromium-*", "chrome-linux*", "chrome"),
        os.path.join(home, ".cache", "ms-playwright", "chromium_headless_shell-*", "chrome-*", "headless_shell"),
    ):
        hits = sorted(glob.glob(pat))
        if hits:
            return hits[-1]
    return None


def save_png(fig, path: str, width: int = 900, height: int = 500) -> str | None:
    """Writes a PNG with kaleido. Returns None on success, else a note saying why it was skipped."""
    browser = find_chromium()
    if browser is None:
        return "plot skipped: no Chromium found for kaleido (install chromium or set BROWSER_PATH)"
    os.environ.setdefault("BROWSER_PATH", browser)
    try:
        fig.write_image(path, width=width, height=height, scale=1)
    except Exception as e:  # kaleido/Chromium problems must never fail a benchmark
        return f"plot skipped: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return None


def bar_figure(title: str, labels, values, yaxis: str, note: str | None = None):
    import plotly.graph_objects as go

    fig = go.Figure(
        go.Bar(
            x=list(labels),
            y=list(values),
            text=[fmt_value(v) for v in values],
            textposition="outside",
            marker_color="#0072B2",
        )
    )
    fig.update_layout(
        title=title + (f"<br><sup>{note}</sup>" if note else ""),
        yaxis_title=yaxis,
        template="plotly_white",
        width=900,
        height=500,
        margin=dict(t=90),
    )
    return fig


def side_by_side_bars(title: str, labels, left: tuple, right: tuple, note: str | None = None):
    """Two bar panels over the same labels: left and right are (panel title, values, y-axis title)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=(left[0], right[0]), horizontal_spacing=0.12)
    for col, (_, values, axis) in enumerate((left, right), start=1):
        fig.add_trace(
            go.Bar(
                x=list(labels),
                y=list(values),
                text=[fmt_value(v) for v in values],
                textposition="outside",
                marker_color="#0072B2" if col == 1 else "#E69F00",
                showlegend=False,
            ),
            row=1,
            col=col,
        )
        fig.update_yaxes(title_text=axis, row=1, col=col)
    fig.update_layout(
        title=title + (f"<br><sup>{note}</sup>" if note else ""),
        template="plotly_white",
        width=900,
        height=500,
        margin=dict(t=110),
    )
    return fig


def line_figure(title: str, series: dict, xaxis: str, yaxis: str, log_y: bool = False):
    """series: name -> (xs, ys)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    palette = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9"]
    for i, (name, (xs, ys)) in enumerate(series.items()):
        fig.add_trace(
            go.Scatter(
                x=list(xs), y=list(ys), mode="lines+markers", name=name, line=dict(color=palette[i % len(palette)])
            )
        )
    fig.update_layout(title=title, xaxis_title=xaxis, yaxis_title=yaxis, template="plotly_white", width=900, height=500)
    if log_y:
        fig.update_yaxes(type="log")
    return fig
