"""A server's /metrics in vLLM's names (vLLM itself, or kvscope's `serve`), read with
prometheus_client's text parser, and the Attach page's figures drawn from a series of scrapes.

Pure functions: text in, `Scrape` out; scrapes in, numbers and Plotly figures out. Names and
meanings follow vLLM 0.33's Prometheus logger: gauges `vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (a fraction, 0..1); counters
`vllm:num_preemptions_total`, `vllm:prefix_cache_queries_total` / `_hits_total` (tokens),
`vllm:spec_decode_num_drafts_total`, `vllm:spec_decode_num_accepted_tokens_per_pos_total{position}`;
histograms `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds` (older vLLM:
`vllm:time_per_output_token_seconds`). Every label set of a name is summed (several engines or
models behind one endpoint add up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import plotly.graph_objects as go

from ui.figures import theme

MAX_METRICS_BYTES = 8 * 1024 * 1024

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PREEMPTIONS = "vllm:num_preemptions_total"
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
TTFT = ("vllm:time_to_first_token_seconds",)
ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
DRAFTS = "vllm:spec_decode_num_drafts_total"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
CACHE_CONFIG = "vllm:cache_config_info"  # an info gauge: the CacheConfig's fields as labels

# What each figure needs, for the "missing" note.
EXPECTED = {
    "running requests": (RUNNING,),
    "waiting requests": (WAITING,),
    "KV cache usage": KV_USAGE,
    "preemptions": (PREEMPTIONS,),
    "prefix cache queries": PREFIX_QUERIES,
    "prefix cache hits": PREFIX_HITS,
    "time to first token": tuple(n + "_bucket" for n in TTFT),
    "inter-token latency": tuple(n + "_bucket" for n in ITL),
    "speculative acceptance per position": (ACCEPTED_PER_POS,),
}


@dataclass(slots=True)
class Scrape:
    t: float  # seconds (the scraper's clock)
    samples: dict[str, list[tuple[dict, float]]] = field(default_factory=dict)


def parse_metrics(text: str, t: float = 0.0) -> Scrape:
    """Prometheus text exposition -> samples by sample name. ValueError if it does not parse."""
    from prometheus_client.parser import text_string_to_metric_families

    if not isinstance(text, str):
        raise ValueError("metrics must be text")
    if len(text) > MAX_METRICS_BYTES:
        raise ValueError(f"metrics page larger than {MAX_METRICS_BYTES} bytes")
    out: dict[str, list[tuple[dict, float]]] = {}
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    except Exception as e:  # the parser raises ValueError, TypeError or IndexError on bad lines
        raise ValueError(f"metrics do not parse as Prometheus text: {type(e).__name__}: {str(e)[:200]}") from None
    return Scrape(t, out)


def _first(scrape: Scrape, names) -> str | None:
    names = (names,) if isinstance(names, str) else names
    return next((n for n in names if n in scrape.samples), None)


def value(scrape: Scrape, names) -> float | None:
    """Sum over every label set of the first of `names` present; None if none is."""
    n = _first(scrape, names)
    if n is None:
        return None
    return sum(v for _, v in scrape.samples[n] if not math.isnan(v))


def block_size(scrape: Scrape) -> int | None:
    """Tokens per KV block, from the block_size label of vllm:cache_config_info (None if absent)."""
    for labels, _ in scrape.samples.get(CACHE_CONFIG, []):
        try:
            n = int(labels.get("block_size", ""))
        except ValueError:
            continue
        if n > 0:
            return n
    return None


def histogram(scrape: Scrape, names) -> tuple[list[float], list[float]] | None:
    """(upper bounds, cumulative counts) of a histogram, label sets summed; None if absent."""
    base = next((n for n in ((names,) if isinstance(names, str) else names) if n + "_bucket" in scrape.samples), None)
    if base is None:
        return None
    acc: dict[float, float] = {}
    for labels, v in scrape.samples[base + "_bucket"]:
        le = labels.get("le")
        if le is None:
            continue
        b = float(le)
        acc[b] = acc.get(b, 0.0) + v
    bounds = sorted(acc)
    return bounds, [acc[b] for b in bounds]


def quantile(bounds: Sequence[float], counts: Sequence[float], q: float) -> float | None:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket holding rank q*n.
    Falls in the +Inf bucket -> the highest finite bound. None when there is nothing counted."""
    if not bounds or not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    prev_b, prev_c = 0.0, 0.0
    for b, c in zip(bounds, counts):
        if c >= rank:
            if math.isinf(b):
                return prev_b
            if c == prev_c:
                return b
            return prev_b + (b - prev_b) * (rank - prev_c) / (c - prev_c)
        prev_b, prev_c = b, c
    return prev_b


def _delta_hist(cur: Scrape, old: Scrape | None, names):
    h = histogram(cur, names)
    if h is None:
        return None
    if old is None:
        return h
    o = histogram(old, names)
    if o is None or o[0] != h[0]:
        return h
    counts = [c - p for c, p in zip(h[1], o[1])]
    if any(c < 0 for c in counts):  # the server restarted: counters went back to zero
        return h
    return h[0], counts


def _window_start(history: Sequence[Scrape], i: int, window_s: float) -> Scrape | None:
    """The latest scrape at least window_s older than history[i] (None: use everything since start)."""
    t = history[i].t
    for j in range(i - 1, -1, -1):
        if t - history[j].t >= window_s:
            return history[j]
    return None


@dataclass(slots=True)
class Row:
    t: float
    running: float | None
    waiting: float | None
    kv_usage: float | None  # fraction
    preemptions: float | None  # total since the server started
    hit_rate: float | None  # prefix-cache hits / queries over the window
    ttft: dict  # {0.5: s, 0.9: s, 0.99: s} over the window
    itl: dict


QUANTILES = (0.5, 0.9, 0.99)


def rows(history: Sequence[Scrape], window_s: float = 10.0) -> list[Row]:
    """One row per scrape: gauges as read, rates and percentiles over the last window_s seconds."""
    out = []
    for i, s in enumerate(history):
        old = _window_start(history, i, window_s)
        q, h = value(s, PREFIX_QUERIES), value(s, PREFIX_HITS)
        if q is not None and h is not None and old is not None:
            oq, oh = value(old, PREFIX_QUERIES), value(old, PREFIX_HITS)
            if oq is not None and oh is not None and q >= oq:
                q, h = q - oq, h - oh
        hit = (h / q) if (q and h is not None) else None
        lat = {}
        for key, names in (("ttft", TTFT), ("itl", ITL)):
            d = _delta_hist(s, old, names)
            lat[key] = {qq: quantile(d[0], d[1], qq) for qq in QUANTILES} if d else {}
        out.append(
            Row(
                s.t,
                value(s, RUNNING),
                value(s, WAITING),
                value(s, KV_USAGE),
                value(s, PREEMPTIONS),
                hit,
                lat["ttft"],
                lat["itl"],
            )
        )
    return out


def acceptance_per_position(scrape: Scrape) -> list[tuple[int, float]]:
    """(draft position, accepted tokens / drafts) — the chance the k-th drafted token is accepted."""
    drafts = value(scrape, DRAFTS)
    if not drafts or ACCEPTED_PER_POS not in scrape.samples:
        return []
    acc: dict[int, float] = {}
    for labels, v in scrape.samples[ACCEPTED_PER_POS]:
        try:
            pos = int(labels.get("position", ""))
        except ValueError:
            continue
        acc[pos] = acc.get(pos, 0.0) + v
    return [(p, acc[p] / drafts) for p in sorted(acc)]


def missing(scrape: Scrape) -> list[str]:
    """Which of the figures' inputs this server does not expose (by what they are)."""
    return [what for what, names in EXPECTED.items() if not any(n in scrape.samples for n in names)]


# ---------------------------------------------------------------- figures


def _layout(fig: go.Figure, title: str, ytitle: str, height: int = 300) -> go.Figure:
    fig.update_layout(
        title=dict(text=title, x=0, font=dict(size=14)),
        height=height,
        margin=dict(l=50, r=10, t=40, b=40),
        paper_bgcolor="white",
        plot_bgcolor="white",
        legend=dict(orientation="h", y=-0.25),
        xaxis_title="time since attach (s)",
        yaxis_title=ytitle,
    )
    fig.update_xaxes(gridcolor="#EEE")
    fig.update_yaxes(gridcolor="#EEE", rangemode="tozero")
    return fig


def _line(fig, rs, t0, get, name, color, **kw):
    xs = [r.t - t0 for r in rs]
    fig.add_trace(
        go.Scatter(
            x=xs, y=[get(r) for r in rs], name=name, mode="lines", line=dict(color=color, **kw), connectgaps=False
        )
    )


def queue_figure(rs: Sequence[Row]) -> go.Figure:
    fig = go.Figure()
    t0 = rs[0].t if rs else 0.0
    o = theme.OKABE_ITO
    _line(fig, rs, t0, lambda r: r.running, "running", o["blue"])
    _line(fig, rs, t0, lambda r: r.waiting, "waiting", o["orange"])
    return _layout(fig, "Requests running and waiting", "requests")


def kv_figure(rs: Sequence[Row]) -> go.Figure:
    fig = go.Figure()
    t0 = rs[0].t if rs else 0.0
    o = theme.OKABE_ITO
    _line(fig, rs, t0, lambda r: None if r.kv_usage is None else 100 * r.kv_usage, "KV cache usage (%)", o["blue"])
    _line(
        fig,
        rs,
        t0,
        lambda r: None if r.hit_rate is None else 100 * r.hit_rate,
        "prefix hit rate (%)",
        o["bluish_green"],
        dash="dot",
    )
    fig = _layout(fig, "KV cache usage and prefix-cache hit rate", "%")
    fig.update_yaxes(range=[0, 100])
    return fig


def preemption_figure(rs: Sequence[Row]) -> go.Figure:
    fig = go.Figure()
    t0 = rs[0].t if rs else 0.0
    _line(fig, rs, t0, lambda r: r.preemptions, "preemptions (total)", theme.PHASE_COLORS["preempted"])
    return _layout(fig, "Preemptions since the server started", "preemptions")


def latency_figure(rs: Sequence[Row], which: str = "ttft") -> go.Figure:
    fig = go.Figure()
    t0 = rs[0].t if rs else 0.0
    colors = {0.5: theme.OKABE_ITO["blue"], 0.9: theme.OKABE_ITO["orange"], 0.99: theme.OKABE_ITO["vermillion"]}
    for q in QUANTILES:
        _line(
            fig,
            rs,
            t0,
            lambda r, q=q: None if getattr(r, which).get(q) is None else 1000 * getattr(r, which)[q],
            f"p{int(q * 100)}",
            colors[q],
        )
    title = "Time to first token" if which == "ttft" else "Inter-token latency"
    return _layout(fig, f"{title} (percentiles from histogram buckets, sliding window)", "ms")


def acceptance_figure(points: Sequence[tuple[int, float]]) -> go.Figure:
    fig = go.Figure(
        go.Bar(
            x=[f"{p + 1}" for p, _ in points],
            y=[a for _, a in points],
            marker_color=theme.OKABE_ITO["bluish_green"],
            text=[f"{a:.2f}" for _, a in points],
            textposition="outside",
        )
    )
    fig = _layout(fig, "Acceptance per draft position (accepted / drafts)", "acceptance rate")
    fig.update_xaxes(title="draft position (1 = first drafted token)")
    fig.update_yaxes(range=[0, 1.05])
    return fig
