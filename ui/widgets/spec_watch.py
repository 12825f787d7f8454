"""The Speculative page's watch mode (engine/lab/watch.py): the live view while the run steps (KV bar,
the tokens so far, Evict and Stop buttons) and the result after it (evictions, recomputed
positions, the growth chart with its drop, greedy match against plain decoding), plus the
rejection-sampling table both modes show for temperature > 0 runs."""

from __future__ import annotations

import streamlit as st

from engine.lab.watch import REQUEST_ID
from ui.figures import growth, pool, spec, tokens

from . import engine_access as ea

KIND = "spec-watch"


def recomputed_before(evictions) -> int | None:
    return tokens.recomputed_before_step(e.step for e in evictions)


def strip_html(req, evictions) -> str:
    return tokens.strip_with_legend(
        req.tokens,
        evicted_before_step=recomputed_before(evictions),
        prompt_evicted_tokens=req.prompt_len if evictions else 0,
    )


def eviction_lines(evictions) -> list[str]:
    return [
        f"Evicted after engine step {e.step} ({e.trigger}), with {e.output_tokens} tokens generated: "
        f"{e.blocks_freed} block(s) freed, {e.tokens_to_recompute} tokens (prompt + output) recomputed "
        "before drafting resumed."
        for e in evictions
    ]


def live_view(run) -> None:
    """Inside the page's polling fragment: where the run is, with Evict / Stop."""
    ctl = run.live
    st.info(f"Watching run {run.run_id} ({run.status}): {run.progress}. Private engine; nothing is timed here.")
    c = st.columns([2, 1, 5])
    if c[0].button("Evict KV cache now", key="spec_watch_evict", type="primary"):
        ctl.request_evict()
        st.toast("Evicting before the next engine step")
    if c[1].button("Stop", key="spec_watch_stop"):
        ctl.stop.set()
    snap = ctl.snapshot
    if snap is None:
        st.caption("Building the private engine…")
        return
    st.html(pool.kv_bar_html(snap))
    req = snap.request(REQUEST_ID)
    if req is not None:
        evs = list(ctl.evictions)
        for line in eviction_lines(evs):
            st.caption(line)
        st.html(strip_html(req, evs))


def judged_table(tokens_) -> None:
    """The rejection-sampling decisions of a temperature > 0 run, with expected vs observed accepts."""
    rows = spec.judged_drafts(tokens_)
    if not rows:
        return
    exp, got = spec.expected_accepts(rows)
    st.markdown("**Rejection sampling, draft by draft**")
    st.caption(
        f"Each draft token x is accepted when u·q(x) < p(x), i.e. with probability min(1, p/q); a rejected "
        f"one is replaced by a sample from max(0, p − q). Over these {len(rows)} judged drafts the "
        f"sampler expected Σ min(1, p/q) = {exp:.1f} accepts and made {got}. Hover a token above for its numbers."
    )
    st.dataframe(
        [
            {
                "step": r.step,
                "position": r.position,
                "draft": r.draft,
                "p (target)": round(r.p, 4),
                "q (draft)": round(r.q, 4),
                "min(1, p/q)": round(r.accept_prob, 4),
                "u": round(r.u, 4),
                "verdict": "accepted" if r.accepted else "rejected",
                "emitted": r.emitted,
            }
            for r in rows
        ],
        hide_index=True,
        width="stretch",
        height=min(400, 38 + 35 * len(rows)),
        key="spec_judged",
    )


def result_view(res) -> None:
    """After a watched run: what happened to it, token by token and block by block."""
    req = res.request
    if req is None:
        st.warning("The watched request's final state was not recorded. Run again.")
        return
    st.subheader(f"Watched run — {res.label or 'speculation off'}")
    if req.error:
        st.error(f"The request failed: {req.error}")
    summ = spec.request_summary(req)
    c = st.columns(4)
    c[0].metric("Evictions", len(res.evictions))
    c[1].metric(
        "Accepted / drafted",
        f"{summ.num_accepted} / {summ.num_draft_tokens}",
        help=f"over {summ.num_drafts} verify passes",
    )
    c[2].metric(
        "Tokens / target pass", "—" if summ.tokens_per_target_pass is None else f"{summ.tokens_per_target_pass:.2f}"
    )
    c[3].metric("Output", f"{req.output_len} tokens", help=f"state: {req.state}")
    for line in eviction_lines(res.evictions):
        st.caption(line)
    if not res.evictions:
        st.caption("No eviction during this run (press Evict while it runs, or set 'Evict after N tokens').")
    if res.stopped:
        st.warning("Stopped before the end: the request was aborted.")
    elif res.matches_plain is True:
        st.success(
            "Greedy output is token-for-token the plain (non-speculative, never evicted) run's: "
            f"{req.output_len} tokens."
        )
    elif res.matches_plain is False:
        st.error("Greedy output differs from the plain run's. This is a bug: please report it.")
    else:
        st.caption("Sampled run (temperature > 0): no token-for-token reference; the distribution is the target's.")
    st.markdown("**Generated tokens** (recomputed positions marked)")
    st.html(strip_html(req, res.evictions))
    judged_table(req.tokens)
    ea.chart(
        growth.growth_figure(
            req,
            res.info.block_size,
            evict_steps=[e.step for e in res.evictions],
            title="cache growth of the watched request",
        ),
        key="spec_watch_growth",
    )
    ticks = spec.tick_steps(req)
    if len(ticks) > 1:
        tick = st.select_slider("Tick timeline (engine steps)", ticks, value=ticks[-1], key="spec_watch_tick")
        st.caption(spec.tick_caption(req, tick, res.info.bytes_per_block))
        toks, _ = spec.at_tick(req, tick)
        evs = [e for e in res.evictions if e.step < tick]
        st.html(
            tokens.token_strip_html(
                toks, evicted_before_step=recomputed_before(evs), prompt_evicted_tokens=req.prompt_len if evs else 0
            )
        )
    st.caption(f"{len(res.verify)} verify passes, {len(res.fallback)} fallback event(s).")
