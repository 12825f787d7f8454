"""Memory calculator views: pure functions of (config, dtype, sizes) -> numbers, text and Plotly
figures. No Streamlit; the page only lays these out. All arithmetic comes from engine.memory_math;
byte formatting and the loaded model's config are here."""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go

from engine.config import KV_CACHE_DTYPES
from engine.lab import memory_math as mm
from engine.lab import recall_grid as RG
from ui.figures import theme

KIND_COLORS = {"MHA": "#D55E00", "GQA": "#0072B2", "MQA": "#009E73", "MLA": "#CC79A7"}
KIND_HELP = {
    "MHA": "multi-head: every query head has its own K and V head",
    "GQA": "grouped-query: groups of query heads share one K/V head",
    "MQA": "multi-query: all query heads share a single K/V head",
    "MLA": "multi-head latent: one compressed latent (+ a small rotary key) per layer",
}
MAX_CONTEXT_POINTS = 24


@dataclass(frozen=True, slots=True)
class MemoryResult:
    kind: str
    dtype: str
    context_len: int
    concurrency: int
    bytes_per_token: int
    bytes_per_sequence: int
    kv_total: int  # bytes_per_sequence x concurrency
    weights: int  # 0 when weights are left out
    total: int  # kv_total + weights
    memory: int  # the GPU memory the user asked about
    max_concurrent: int  # sequences of context_len that fit in memory after weights
    fits: bool
    formula_lines: tuple[str, ...]


def _num(n: int) -> str:
    return f"{n:,}"


def _seqs(n: int) -> str:
    return f"{n:,} sequence" + ("" if n == 1 else "s")


def _tick(x: int) -> str:
    if x >= 1024 * 1024 and x % (1024 * 1024) == 0:
        return f"{x // (1024 * 1024)}M"
    if x >= 1024 and x % 1024 == 0:
        return f"{x // 1024}K"
    return f"{x:,}"


def compute(
    cfg, dtype: str, context_len: int, concurrency: int, memory_bytes: int, weights_bytes: int = 0
) -> MemoryResult:
    """Everything the page shows, from the config and the user's sizes (ValueError on bad input)."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be an integer >= 1, got {concurrency!r}")
    kind = mm.kv_spec(cfg).kind
    bpt = mm.config_kv_bytes_per_token(cfg, dtype)
    per_seq = mm.kv_bytes_per_sequence(cfg, dtype, context_len)
    kv_total = per_seq * concurrency
    total = kv_total + weights_bytes
    maxc = mm.max_concurrent_sequences(cfg, dtype, context_len, memory_bytes, weights_bytes)
    free = memory_bytes - weights_bytes
    pad = " " * 17
    lines = [
        f"bytes per token  = {mm.formula_factors(cfg, dtype)}",
        f"{pad}= {_num(bpt)} B  ({format_bytes(bpt)})",
        f"per sequence     = {_num(bpt)} B x {_num(context_len)} tokens",
        f"{pad}= {_num(per_seq)} B  ({format_bytes(per_seq)})",
        f"KV for the batch = {_num(per_seq)} B x {_seqs(concurrency)}",
        f"{pad}= {_num(kv_total)} B  ({format_bytes(kv_total)})",
    ]
    if weights_bytes:
        lines += [
            f"total needed     = {_num(kv_total)} B KV + {_num(weights_bytes)} B weights",
            f"{pad}= {_num(total)} B  ({format_bytes(total)})",
        ]
    else:
        lines += [f"total needed     = {_num(total)} B  ({format_bytes(total)}; weights left out)"]
    if free > 0:
        lines += [
            "max concurrent   = floor((memory - weights) / per sequence)",
            f"{pad}= floor(({_num(memory_bytes)} B - {_num(weights_bytes)} B) / {_num(per_seq)} B)",
            f"{pad}= {_num(maxc)}",
        ]
    else:
        lines += [
            f"max concurrent   = 0: the weights alone ({format_bytes(weights_bytes)}) "
            f"do not fit in {format_bytes(memory_bytes)}"
        ]
    return MemoryResult(
        kind,
        dtype,
        context_len,
        concurrency,
        bpt,
        per_seq,
        kv_total,
        weights_bytes,
        total,
        memory_bytes,
        maxc,
        total <= memory_bytes,
        tuple(lines),
    )


def summary_rows(r: MemoryResult) -> list[dict]:
    """The headline numbers as table rows (exact bytes and a readable size)."""
    rows = [
        ("KV bytes per token", r.bytes_per_token),
        ("KV per sequence", r.bytes_per_sequence),
        (f"KV for {_seqs(r.concurrency)}", r.kv_total),
        ("weights", r.weights),
        ("total needed", r.total),
        ("GPU memory", r.memory),
    ]
    out = [{"quantity": q, "bytes": _num(b), "size": format_bytes(b)} for q, b in rows]
    out.append({"quantity": "max concurrent sequences", "bytes": "", "size": _num(r.max_concurrent)})
    return out


def context_points(context_len: int, lo: int = 512, hi: int | None = None) -> list[int]:
    """Powers of two from ``lo`` up to at least ``context_len`` (and ``hi``), plus ``context_len``."""
    top = max(context_len, hi or 0, lo)
    pts, x = [], lo
    while x < top and len(pts) < MAX_CONTEXT_POINTS - 1:
        pts.append(x)
        x *= 2
    pts.append(x if x >= top else top)
    return sorted(set(pts) | {context_len})


def bytes_by_kind_figure(cfg, dtype: str, height: int = 300) -> go.Figure:
    """Bytes per token of the config's own attention layout beside its MHA/GQA/MQA variants
    (same layers, heads and head sizes). The config's own kind is outlined and hatched."""
    own = mm.kv_spec(cfg).kind
    by = mm.bytes_per_token_by_kind(cfg, dtype)
    kinds = list(by)
    fig = go.Figure(
        go.Bar(
            x=[f"{k} (this config)" if k == own else k for k in kinds],
            y=[by[k] for k in kinds],
            marker=dict(
                color=[KIND_COLORS[k] for k in kinds],
                line=dict(
                    color=[theme.INK if k == own else "#FFFFFF" for k in kinds],
                    width=[3 if k == own else 0 for k in kinds],
                ),
                pattern=dict(shape=["/" if k == own else "" for k in kinds]),
            ),
            text=[format_bytes(by[k]) for k in kinds],
            textposition="outside",
            cliponaxis=False,
            hovertext=[f"{k}: {by[k]:,} B per token. {KIND_HELP[k]}" for k in kinds],
            hoverinfo="text",
            showlegend=False,
        )
    )
    fig.update_layout(**theme.base_layout(height, f"KV bytes per token by attention kind ({dtype})"))
    fig.update_layout(yaxis_title="bytes per token", yaxis=dict(gridcolor=theme.GRID, rangemode="tozero"), bargap=0.35)
    top = max(by.values())
    fig.update_yaxes(range=[0, top * 1.18])
    return fig


def memory_vs_context_figure(
    cfg, dtype: str, context_len: int, concurrency: int, memory_bytes: int, weights_bytes: int = 0, height: int = 340
) -> go.Figure:
    """GiB needed (weights + KV for ``concurrency`` sequences) against context length, one line per
    attention kind, with the GPU memory as a dashed line and the chosen context marked."""
    own = mm.kv_spec(cfg).kind
    by = mm.bytes_per_token_by_kind(cfg, dtype)
    xs = context_points(context_len, hi=max(context_len, 131_072))
    fig = go.Figure()
    for k, bpt in by.items():
        ys = [(weights_bytes + bpt * x * concurrency) / mm.GiB for x in xs]
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=ys,
                mode="lines+markers",
                name=f"{k} (this config)" if k == own else k,
                line=dict(color=KIND_COLORS[k], width=3 if k == own else 1.5, dash="solid" if k == own else "dot"),
                marker=dict(size=6 if k == own else 4),
                hovertemplate="%{x:,} tokens: %{y:,.2f} GiB<extra>" + k + "</extra>",
            )
        )
    fig.add_hline(
        y=memory_bytes / mm.GiB,
        line=dict(color=theme.INK, dash="dash", width=1.5),
        annotation_text=f"GPU memory {format_bytes(memory_bytes)}",
        annotation_position="top left",
    )
    chosen = (weights_bytes + by[own] * context_len * concurrency) / mm.GiB
    fig.add_trace(
        go.Scatter(
            x=[context_len],
            y=[chosen],
            mode="markers",
            name="your setting",
            marker=dict(symbol="diamond", size=12, color=theme.INK),
            hovertemplate="%{x:,} tokens: %{y:,.2f} GiB<extra>your setting</extra>",
        )
    )
    what = "weights + " if weights_bytes else ""
    fig.update_layout(
        **theme.base_layout(
            height, f"Memory needed ({what}KV x {_seqs(concurrency)})", margin=dict(l=55, r=20, t=78, b=45)
        )
    )
    fig.update_layout(
        legend=dict(y=1.0, yanchor="bottom"),
        xaxis=dict(
            type="log",
            title="context length (tokens, log scale)",
            gridcolor=theme.GRID,
            tickvals=xs[::2],
            ticktext=[_tick(x) for x in xs[::2]],
        ),
        yaxis=dict(title="GiB", gridcolor=theme.GRID, rangemode="tozero"),
    )
    return fig


def max_concurrency_figure(
    cfg, dtype: str, context_len: int, memory_bytes: int, weights_bytes: int = 0, height: int = 300
) -> go.Figure:
    """How many sequences fit in ``memory_bytes`` after the weights, per context length."""
    xs = context_points(context_len, hi=max(context_len, 131_072))
    ys = [mm.max_concurrent_sequences(cfg, dtype, x, memory_bytes, weights_bytes) for x in xs]
    own = mm.kv_spec(cfg).kind
    fig = go.Figure(
        go.Bar(
            x=[f"{x:,}" for x in xs],
            y=ys,
            text=[f"{y:,}" for y in ys],
            textposition="outside",
            cliponaxis=False,
            marker=dict(color=[theme.INK if x == context_len else KIND_COLORS[own] for x in xs]),
            hovertemplate="%{x} tokens: %{y:,} sequences<extra></extra>",
            showlegend=False,
        )
    )
    fig.update_layout(
        **theme.base_layout(height, f"Max concurrent sequences in {format_bytes(memory_bytes)} ({own}, {dtype})")
    )
    fig.update_layout(
        xaxis=dict(type="category", title="context length per sequence (tokens)"),
        yaxis=dict(title="sequences", gridcolor=theme.GRID, rangemode="tozero"),
    )
    return fig


# ------------------------------------------------------------------ formatting, the loaded model


def format_bytes(n: float, decimal: bool = False) -> str:
    """``131072 -> '128 KiB'``; ``decimal=True`` uses kB/MB/GB (1000-based)."""
    if n != n or n is None:
        return "n/a"
    base, units = (
        (1000, ("B", "kB", "MB", "GB", "TB", "PB")) if decimal else (1024, ("B", "KiB", "MiB", "GiB", "TiB", "PiB"))
    )
    v = float(n)
    i = 0
    while abs(v) >= base and i < len(units) - 1:
        v /= base
        i += 1
    if i == 0:
        return f"{int(v):,} B"
    s = f"{v:,.2f}".rstrip("0").rstrip(".")
    return f"{s} {units[i]}"


def config_from_engine_info(info) -> dict:
    """A config dict for the loaded model, from the app's ``engine_info`` (an EngineInfo-like object
    or dict). Uses a full HF config when one is attached (``hf_config``/``model_config``/``config``),
    else the fields EngineInfo reports (layers, KV heads, head dim; query heads if present)."""
    for key in ("hf_config", "model_config", "config"):
        sub = mm.config_field(info, key)
        if isinstance(sub, dict) or (sub is not None and hasattr(sub, "to_dict")):
            return mm.config_to_dict(sub)
    out = {
        "num_hidden_layers": mm.config_field(info, "num_layers") or mm.config_field(info, "num_hidden_layers"),
        "num_key_value_heads": mm.config_field(info, "num_kv_heads") or mm.config_field(info, "num_key_value_heads"),
        "head_dim": mm.config_field(info, "head_dim"),
    }
    heads = mm.config_field(info, "num_heads") or mm.config_field(info, "num_attention_heads")
    if heads:
        out["num_attention_heads"] = heads
    mm.kv_spec(out)
    return out


# ---------------------------------------------------------------- measured cost of a quantized KV cache

# the calculator's KV dtype names -> EngineConfig.kv_cache_dtype (the one list, engine/config.py);
# the calculator says "fp8" for the pool's fp8_e4m3
KVQUANT_NAMES = {("fp8" if d == "fp8_e4m3" else d): d for d in KV_CACHE_DTYPES if d != "auto"}
KV_DTYPES = tuple(KVQUANT_NAMES)  # the calculator's KV cache dtype choices


def _grid_text(grid, dtype: str) -> str:
    """The recall grid's line for one format: needles recalled per prompt length (of the depths),
    beside fp32's, and where recall first breaks; "" where the grid lacks the format."""
    if not RG.is_grid(grid) or dtype not in grid["hit"]:
        return ""
    n = len(grid["depths"])
    rec, ref = RG.recall(grid, dtype), RG.recall(grid, "fp32")
    pairs = ", ".join(
        f"{RG.ctx_name(c)} {round(rec[c] * n)}/{n} (fp32 {round(ref[c] * n)}/{n})"
        for c in RG.contexts(grid)
        if c in rec
    )
    depths = "/".join(f"{d:g}" for d in grid["depths"])
    return f"; needles at depths {depths} recalled by prompt length: {pairs}, so it {RG.summary(grid, dtype)}"


def _recall_sweep_text(data: dict, row: dict, dtype: str = "") -> str:
    """The short-prompt agreement and the recall-by-distance figures (the recall grid to the
    model's context where the file has it for this format, else the sweep)."""
    out = ""
    if isinstance(row.get("short_top1_agreement"), (int, float)):
        out += f"; on short prompts {row['short_top1_agreement']:.0%} of next-token picks are fp32's"
    grid_text = _grid_text(data.get("recall_grid"), dtype)
    if grid_text:
        return out + grid_text
    rec, base = row.get("recall_by_context"), (data.get("dtypes") or {}).get("fp32", {}).get("recall_by_context")
    if isinstance(rec, dict) and isinstance(base, dict) and rec:
        pairs = ", ".join(
            f"{int(c):,}: {rec[c]:.0%} (fp32 {base.get(c, float('nan')):.0%})" for c in sorted(rec, key=int)
        )
        out += f"; needle recall by context tokens {pairs}"
    return out


def kvquant_caption(data: dict | None, dtype: str) -> str | None:
    """One markdown line with `bench kvquant`'s measured figures for this KV dtype (the JSON of
    assets/measurements/kvquant.json), or None when there is no measurement for it."""
    if not isinstance(data, dict):
        return None
    row = (data.get("dtypes") or {}).get(KVQUANT_NAMES.get(dtype, dtype))
    if not isinstance(row, dict):
        return None
    try:
        date = str(data.get("date", "?"))
        if KVQUANT_NAMES.get(dtype) == "fp32":
            return (
                f"Measured {date} on kvscope's engine ({data.get('model', '?')} model): fp32 is the reference "
                f"for the other formats; {row['tokens_per_mib']:,.0f} tokens per MiB, "
                f"{row['decode_tok_s']:.1f} tok/s decode, needle recall {row['needle_recall']:.0%}."
            )
        recall_text = _recall_sweep_text(data, row, KVQUANT_NAMES.get(dtype, dtype))
        return (
            f"Measured {date} on kvscope's engine ({data.get('model', '?')} model) vs an fp32 cache: "
            f"{row['token_agreement']:.0%} of greedy tokens identical, "
            f"{row['sequences_identical']:.0%} of outputs identical, mean KL {row['mean_kl']:.2g} nats, "
            f"needle recall {row['needle_recall']:.0%} (fp32: "
            f"{data['dtypes']['fp32']['needle_recall']:.0%}){recall_text}; "
            f"{row['tokens_per_mib']:,.0f} tokens per MiB "
            f"({row['tokens_vs_fp32']:.2f}x fp32), {row['decode_tok_s']:.1f} tok/s decode. "
            f"Command: `{data.get('command', 'python -m engine bench kvquant')}`."
        )
    except (KeyError, TypeError, ValueError):
        return None
