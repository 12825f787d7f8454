"""Speculative decoding views: theory curve vs measurement, per-position acceptance, costs.

Formulas
- E(α, k) = (1 − α^(k+1)) / (1 − α) (engine's definition): expected tokens per target pass when each of k draft tokens
  is accepted independently with probability α and a rejection stops the run (one target token
  is always emitted: the replacement or the bonus). E(1, k) = k + 1; E(α, k) ≥ 1.
- α for that curve is estimated from per-position counts: accepted / reached, where a position
  is "reached" when every earlier draft token of that pass was accepted. This is the geometric
  model's maximum-likelihood α. vLLM's acceptance rate (accepted / draft tokens) also counts the
  positions after a rejection, which the target never looked at, so it is lower; both are shown.
- Tokens per target pass for a finished request = output tokens / target passes, and target
  passes = output tokens − accepted draft tokens (every pass emits exactly one non-draft token).
"""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go

from engine.observe import rates
from engine.speculative.math import expected_tokens_per_pass as _engine_expected_tokens_per_pass

from . import theme
from .theme import ACCEPTED, BONUS, PLAIN, REPLACED


def expected_tokens_per_pass(alpha: float, k: float) -> float:
    """E(α, k) from the engine's one definition, for a page's inputs (checked here)."""
    if k < 0:
        raise ValueError("k must be >= 0")
    if not 0 <= alpha <= 1:
        raise ValueError("alpha must be in [0, 1]")
    return _engine_expected_tokens_per_pass(alpha, k)


@dataclass(frozen=True, slots=True)
class PositionCounts:
    accepted: tuple[int, ...]  # accepted[i]: passes whose draft token i was accepted
    reached: tuple[int, ...]  # reached[i]: passes in which the target judged draft token i
    verify_passes: int  # passes that verified at least one draft token
    plain_passes: int  # target passes with no draft (plain decode, or the prefill token)

    @property
    def rates(self) -> tuple[float | None, ...]:
        return tuple(a / r if r else None for a, r in zip(self.accepted, self.reached))

    @property
    def alpha(self) -> float | None:
        tot = sum(self.reached)
        return sum(self.accepted) / tot if tot else None


def position_counts(tokens) -> PositionCounts:
    """Per-position acceptance for one request, from its TokenMarks grouped by step. A step's
    accepted tokens are positions 0..a−1; a replaced token means position a was judged and
    rejected; a bonus token means every proposed position was accepted."""
    by_step: dict[int, list] = {}
    order: list[int] = []
    for m in tokens:
        if m.step not in by_step:
            by_step[m.step] = []
            order.append(m.step)
        by_step[m.step].append(m)
    acc: list[int] = []
    reached: list[int] = []
    verify = plain = 0

    def bump(arr, i):
        while len(arr) <= i:
            arr.append(0)
        arr[i] += 1

    for s in order:
        marks = by_step[s]
        a = sum(1 for m in marks if m.kind == ACCEPTED)
        rejected = any(m.kind == REPLACED for m in marks)
        spec = a > 0 or rejected or any(m.kind == BONUS for m in marks)
        if not spec:
            if any(m.kind == PLAIN for m in marks):
                plain += 1
            continue
        verify += 1
        for i in range(a):
            bump(acc, i)
            bump(reached, i)
        if rejected:
            bump(reached, a)
            while len(acc) < len(reached):
                acc.append(0)
    while len(acc) < len(reached):
        acc.append(0)
    return PositionCounts(tuple(acc), tuple(reached), verify, plain)


@dataclass(frozen=True, slots=True)
class JudgedDraft:
    """One draft token rejection sampling judged: its verify pass (engine step), position in the
    pass, the target's p and drafter's q of it, accept probability min(1, p/q), the draw u."""

    step: int
    position: int
    draft: str
    p: float
    q: float
    accept_prob: float
    u: float
    accepted: bool
    emitted: str  # the token the target emitted at this position (the draft, or its replacement)


def judged_drafts(tokens) -> list[JudgedDraft]:
    """Every judged draft token of a sampled (temperature > 0) speculative run, from the marks'
    recorded p / q / u, in order; empty for greedy runs and traces recorded without them."""
    out: list[JudgedDraft] = []
    pos, last_step = 0, None
    for m in tokens:
        if m.step != last_step:
            pos, last_step = 0, m.step
        if m.kind not in (ACCEPTED, REPLACED) or getattr(m, "p", None) is None or m.q is None or m.u is None:
            continue
        pos += 1
        draft = m.text if m.kind == ACCEPTED else (m.rejected_text if m.rejected_text is not None else "?")
        a = rates.accept_probability(m.p, m.q)
        out.append(JudgedDraft(m.step, pos, draft, m.p, m.q, a, m.u, m.kind == ACCEPTED, m.text))
    return out


def expected_accepts(rows: list[JudgedDraft]) -> tuple[float, int]:
    """(Σ min(1, p/q) over the judged drafts, drafts accepted): the sampler's expected and
    observed accept counts; they agree up to the binomial spread."""
    return sum(r.accept_prob for r in rows), sum(r.accepted for r in rows)


@dataclass(frozen=True, slots=True)
class SpecSummary:
    num_drafts: int
    num_draft_tokens: int
    num_accepted: int
    acceptance_rate: float | None  # vLLM: accepted / draft tokens
    mean_acceptance_length: float | None  # vLLM: 1 + accepted / drafts (tokens per verify pass)
    alpha: float | None  # geometric-model α from per-position counts
    mean_draft_length: float | None  # draft tokens per verify pass (k, or fewer: n-gram after a short match)
    target_passes: int
    tokens_per_target_pass: float | None


def request_summary(req) -> SpecSummary:
    pc = position_counts(req.tokens)
    acc = req.spec_num_accepted_tokens
    passes = max(0, req.output_len - acc)
    return SpecSummary(
        num_drafts=req.spec_num_drafts,
        num_draft_tokens=req.spec_num_draft_tokens,
        num_accepted=acc,
        acceptance_rate=rates.acceptance_rate(acc, req.spec_num_draft_tokens),
        mean_acceptance_length=rates.mean_acceptance_length(acc, req.spec_num_drafts),
        alpha=pc.alpha,
        mean_draft_length=rates.mean_draft_length(req.spec_num_draft_tokens, req.spec_num_drafts),
        target_passes=passes,
        tokens_per_target_pass=req.output_len / passes if passes else None,
    )


REFERENCE_ALPHAS = (0.2, 0.5, 0.8, 0.95)


def theory_figure(
    alpha: float | None,
    k: float,
    measured: float | None,
    *,
    k_max: int = 16,
    height: int = 420,
    measured_label: str = "measured",
) -> go.Figure:
    """E(α, k) over k = 0..k_max for the measured α (bold) and reference α's (faint), with the
    measured tokens per target pass at k: the engine's k, or the mean draft length where drafts
    were shorter (a float). k = 0 is plain decoding (1 token/pass)."""
    ks = list(range(0, k_max + 1))
    fig = go.Figure()
    for a in REFERENCE_ALPHAS:
        fig.add_trace(
            go.Scatter(
                x=ks,
                y=[expected_tokens_per_pass(a, x) for x in ks],
                mode="lines",
                name=f"α = {a}",
                line=dict(color="#BBBBBB", width=1, dash="dot"),
                hovertemplate=f"α={a}, k=%{{x}}: %{{y:.2f}} tokens/pass<extra></extra>",
            )
        )
    if alpha is not None:
        fig.add_trace(
            go.Scatter(
                x=ks,
                y=[expected_tokens_per_pass(alpha, x) for x in ks],
                mode="lines",
                name=f"theory at measured α = {alpha:.2f}",
                line=dict(color=theme.OKABE_ITO["blue"], width=3),
                hovertemplate="k=%{x}: E=%{y:.2f} tokens/pass<extra></extra>",
            )
        )
        fig.add_trace(
            go.Scatter(
                x=[k],
                y=[expected_tokens_per_pass(alpha, k)],
                mode="markers",
                name=(f"theory at k = {k:g}" if float(k).is_integer() else f"theory at the mean draft length {k:.2f}")
                + f": {expected_tokens_per_pass(alpha, k):.2f}",
                marker=dict(symbol="circle-open", size=14, color=theme.OKABE_ITO["blue"], line=dict(width=2)),
            )
        )
    if measured is not None:
        fig.add_trace(
            go.Scatter(
                x=[k],
                y=[measured],
                mode="markers+text",
                name=f"{measured_label}: {measured:.2f}",
                text=[f"{measured:.2f}"],
                textposition="middle right",
                marker=dict(
                    symbol="diamond", size=13, color=theme.OKABE_ITO["vermillion"], line=dict(color=theme.INK, width=1)
                ),
            )
        )
    fig.add_hline(
        y=1,
        line=dict(color=theme.INK, width=1, dash="dash"),
        annotation_text="plain decoding: 1 token / pass",
        annotation_position="bottom right",
        annotation_font_size=10,
    )
    fig.update_layout(
        **theme.base_layout(
            height, "tokens per target pass: E(α, k) = (1 − α^(k+1)) / (1 − α)", margin=dict(l=55, r=15, t=36, b=130)
        )
    )
    fig.update_layout(legend=dict(orientation="h", y=-0.22, yanchor="top", x=0, font=dict(size=10)))
    fig.update_xaxes(title_text="draft length k", dtick=2, gridcolor=theme.GRID, range=[-0.3, k_max + 0.3])
    fig.update_yaxes(title_text="tokens per target pass", gridcolor=theme.GRID, rangemode="tozero")
    return fig


def position_figure(
    counts: PositionCounts, *, height: int = 260, title: str = "acceptance by draft position"
) -> go.Figure:
    n = len(counts.reached)
    xs = [str(i + 1) for i in range(n)]
    rates = [r if r is not None else 0 for r in counts.rates]
    text = [f"{a}/{r}" for a, r in zip(counts.accepted, counts.reached)]
    fig = go.Figure(
        go.Bar(
            x=xs,
            y=rates,
            text=text,
            textposition="outside",
            name="accepted / judged",
            marker=dict(color=theme.TOKEN_STYLES[ACCEPTED]["bg"], line=dict(color=theme.OKABE_ITO["blue"], width=2)),
            hovertemplate="position %{x}: %{y:.0%} accepted (%{text})<extra></extra>",
        )
    )
    if not n:
        fig.add_annotation(text="no draft tokens judged yet", showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_layout(**theme.base_layout(height, title, margin=dict(l=55, r=15, t=40, b=45)))
    fig.update_xaxes(title_text="draft position (1 = first guessed token)", type="category")
    fig.update_yaxes(title_text="accepted / judged", range=[0, 1.15], tickformat=".0%", gridcolor=theme.GRID)
    return fig


@dataclass(frozen=True, slots=True)
class Costs:
    """Measured wall-clock costs, in seconds. None = not measured."""

    plain_per_token: float | None = None  # plain decoding of the same prompt: decode time / tokens
    spec_per_token: float | None = None  # speculative run: decode time / tokens
    draft_per_pass: float | None = None  # drafting, per verify pass
    verify_per_pass: float | None = None  # target verify pass of k+1 tokens
    plain_e2e: float | None = None
    spec_e2e: float | None = None

    @property
    def speedup(self) -> float | None:
        if self.plain_e2e and self.spec_e2e:
            return self.plain_e2e / self.spec_e2e
        return None

    @property
    def decode_speedup(self) -> float | None:
        if self.plain_per_token and self.spec_per_token:
            return self.plain_per_token / self.spec_per_token
        return None


def _event_time(e, *names) -> float | None:
    for n in names:
        v = e.data.get(n)
        if isinstance(v, (int, float)):
            return float(v) / (1000.0 if n.endswith("_ms") else 1.0)
    return None


def measured_costs(spec_req, plain_req, verify_events) -> Costs:
    """Costs of a speculative run and its plain twin (RequestInfos; either may be None) and the
    run's verify Events: decode time per token after the first, end-to-end time, and the mean
    draft and verify time per pass from the events' timings (seconds, or *_ms)."""

    def per_token(r):  # TPOT (engine/observe/rates.py); traces recorded before last_token_time end at the finish
        if r is None or r.finish_time is None:
            return None
        last = r.last_token_time if r.last_token_time is not None else r.finish_time
        return rates.tpot(r.first_token_time, (last,), r.output_len)

    def e2e(r):
        return None if r is None else rates.e2e_latency(r.arrival_time, r.finish_time)

    d = [t for t in (_event_time(e, "draft_time_s", "draft_s", "draft_ms") for e in verify_events) if t is not None]
    v = [t for t in (_event_time(e, "verify_time_s", "verify_s", "verify_ms") for e in verify_events) if t is not None]
    return Costs(
        plain_per_token=per_token(plain_req),
        spec_per_token=per_token(spec_req),
        draft_per_pass=sum(d) / len(d) if d else None,
        verify_per_pass=sum(v) / len(v) if v else None,
        plain_e2e=e2e(plain_req),
        spec_e2e=e2e(spec_req),
    )


def costs_figure(c: Costs, *, height: int = 340) -> go.Figure:
    """Measured milliseconds: plain decode per token vs speculative per token, and the
    speculative pass split into draft + verify."""
    ms = lambda v: None if v is None else v * 1000  # noqa: E731
    fig = go.Figure()
    fig.add_trace(
        go.Bar(
            x=["plain / token"],
            y=[ms(c.plain_per_token)],
            name="plain decode / token",
            marker=dict(color="#FFFFFF", line=dict(color=theme.INK, width=2)),
            texttemplate="%{y:.1f} ms",
            textposition="outside",
        )
    )
    fig.add_trace(
        go.Bar(
            x=["spec / token"],
            y=[ms(c.spec_per_token)],
            name="speculative / token",
            marker=dict(color=theme.TOKEN_STYLES[ACCEPTED]["bg"], line=dict(color=theme.OKABE_ITO["blue"], width=2)),
            texttemplate="%{y:.1f} ms",
            textposition="outside",
        )
    )
    fig.add_trace(
        go.Bar(
            x=["spec pass"],
            y=[ms(c.draft_per_pass)],
            name="draft / pass",
            marker=dict(
                color=theme.OKABE_ITO["orange"], pattern=dict(shape="/", fgcolor="#FFFFFF", fillmode="overlay")
            ),
            texttemplate="draft %{y:.1f} ms",
            textposition="auto",
            insidetextfont=dict(color="#000000"),
        )
    )
    fig.add_trace(
        go.Bar(
            x=["spec pass"],
            y=[ms(c.verify_per_pass)],
            name="verify / pass",
            marker=dict(color=theme.OKABE_ITO["blue"]),
            texttemplate="verify %{y:.1f} ms",
            textposition="inside",
        )
    )
    sp = c.speedup
    title = "measured costs" + (f" (speedup {sp:.2f}×)" if sp else "")
    fig.update_layout(**theme.base_layout(height, title, margin=dict(l=55, r=15, t=36, b=90)))
    fig.update_layout(barmode="stack", legend=dict(orientation="h", y=-0.15, yanchor="top", x=0, font=dict(size=10)))
    fig.update_yaxes(title_text="milliseconds", gridcolor=theme.GRID, rangemode="tozero")
    return fig


# --------------------------------------------------------------------------- the tick timeline


def tick_steps(req) -> list[int]:
    """The engine steps at which the request's tokens or KV changed (its history points and the
    steps its tokens were produced), sorted: the positions of the timeline slider."""
    return sorted({p.step for p in req.history} | {t.step for t in req.tokens})


def at_tick(req, step: int) -> tuple[tuple, object | None]:
    """(tokens produced up to `step`, the request's last history point at or before it)."""
    toks = tuple(t for t in req.tokens if t.step <= step)
    point = None
    for p in req.history:
        if p.step <= step:
            point = p
    return toks, point


def tick_caption(req, step: int, bytes_per_block: int) -> str:
    toks, p = at_tick(req, step)
    kinds = {}
    for t in toks:
        kinds[t.kind] = kinds.get(t.kind, 0) + 1
    made = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none yet"
    if p is None:
        return f"Step {step}: not admitted yet. Tokens so far: {made}."
    return (
        f"Step {step}: {p.phase}, {p.num_cached_tokens} tokens' K/V in {p.num_blocks} block(s) "
        f"({p.num_blocks * bytes_per_block:,} bytes of blocks). Tokens so far: {made}."
    )
