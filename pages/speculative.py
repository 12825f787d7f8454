"""Speculative decoding: guess k tokens cheaply, verify them in one target pass, measure it."""

from __future__ import annotations

import streamlit as st

from engine.config import SamplingParams
from engine.core.preview import template_ids
from ui.figures import drafters, pool, spec, theme, tokens
from ui.widgets import engine_access as ea
from ui.widgets import mode, prompt_preview, room, shell, spec_watch

shell.enter_app()

SS = st.session_state
EXAMPLE = drafters.EXAMPLE_PROMPT

MEASURE, WATCH = "Measure vs plain", "Watch live (evict during the run)"

st.title("Speculative decoding")
st.caption(
    "A cheap drafter guesses k tokens; the target model checks all of them in one forward pass "
    "and keeps the longest correct prefix, plus one token of its own. The output is the same "
    "as plain decoding; only the number of target passes changes."
)

th = ea.require_engine()
cfg = ea.engine_config()
info = th.snapshot().info

with st.container(border=True):
    c = st.columns([3, 2, 2, 3])
    cur = cfg.speculative
    labels = list(drafters.DRAFTERS)
    drafter = c[0].selectbox(
        "Drafter",
        labels,
        index=labels.index(drafters.label_of(cur)),
        help="; ".join(f"{k}: {v[1]}" for k, v in drafters.DRAFTERS.items()),
        key="spec_drafter",
    )
    k = c[1].slider(
        "Draft length k",
        1,
        drafters.K_MAX,
        value=cur.num_speculative_tokens if cur else 4,
        key="spec_k",
        help="the most draft tokens one verify pass checks; the n-gram drafter drafts its match's length + 1, "
        "up to k, so a one-token match costs a 3-row pass, not a (k + 1)-row one",
    )
    max_tokens = c[2].slider("Max new tokens", 8, 256, 64, key="spec_max_tokens")
    temperature = c[2].slider(
        "Temperature",
        0.0,
        1.5,
        0.0,
        0.1,
        key="spec_temperature",
        help="0: greedy (output identical to plain decoding). Above 0: rejection sampling "
        "keeps the target's distribution; each draft token is accepted with "
        "probability min(1, p/q)",
    )
    mismatched = c[3].toggle(
        "Mismatched draft (break it)",
        value=False,
        key="spec_mismatched",
        help="Use a poor drafter: the target itself, cut after its first ~1/8 of layers. "
        "Watch acceptance collapse and the speedup fall to about 1× or below.",
    )
    exit_layers, draft_model = 1, ""
    if drafter == "self-draft: early exit" and not mismatched:
        exit_layers = c[3].number_input(
            "Exit after layer", 1, max(1, info.num_layers - 1), max(1, info.num_layers // 2), key="spec_exit_layers"
        )
    if drafter == "draft model" and not mismatched:
        draft_model = st.text_input(
            "Draft model (local path or hub id, same tokenizer as the target)",
            value="tiny",
            key="spec_draft_model",
            help="'tiny' is kvscope's 2-layer random model: it loads offline and drafts "
            "badly, an honest demo of a poor drafter",
        )
    st.caption(
        drafters.DRAFTERS[drafter][1]
        + (" — mismatched: early exit after the first ~1/8 of the target's layers" if mismatched else "")
    )
    spec_mode = st.radio(
        "Mode",
        [MEASURE, WATCH],
        horizontal=True,
        key="spec_mode",
        help="Measure: speculative vs plain decoding, alternated rounds, timed. Watch: one speculative run, "
        "step by step, that you can evict in the middle (untimed)",
    )
    if spec_mode == WATCH:
        w = st.columns(2)
        evict_after = w[0].number_input(
            "Evict automatically after N tokens (0: only the button)", 0, 256, 0, key="spec_evict_after"
        )
        pace = w[1].slider(
            "Pause per engine step (s)",
            0.0,
            1.0,
            mode.current().watch_pace_s,
            0.05,
            key="spec_pace",
            help="slows the run down so you can press Evict at a moment of your choosing",
        )
    st.html(pool.kv_bar_html(th.snapshot()))
    prompt_preview.prompt_with_preview(
        th, "spec", SamplingParams(max_tokens=int(max_tokens)), default=SS.get("spec_prompt", EXAMPLE)
    )
    run = st.button(
        "Run speculative and plain decoding" if spec_mode == MEASURE else "Watch the speculative run",
        type="primary",
        key="spec_run",
    )
    system, prompt = prompt_preview.typed("spec")


def _wanted():
    if mismatched:
        return ea.spec_config("self_draft", int(k), mismatched=True, num_layers=info.num_layers)
    return drafters.drafter_config(
        drafter, int(k), exit_layers=int(exit_layers), draft_model=draft_model, fallback=mode.current().spec_fallback
    )


# The comparison runs on a private engine that shares the loaded weights (engine/lab/experiments.py):
# the shared engine is never rebuilt and nobody's requests are aborted. It runs in the background
# (ui/widgets/room.py), so this tab can be reloaded and other tabs are never blocked.
if run:
    try:
        want = _wanted()
    except ValueError as e:
        st.error(f"Not run: {e}")
        st.stop()
    SS["spec_prompt"] = prompt
    base, n_tok = cfg, int(max_tokens)
    # with a system prompt the private engine gets the templated ids the preview showed
    text = template_ids(th.tokenizer, prompt, system)[0] if system else prompt

    def _experiment(progress):
        from engine.lab import lab_proc
        from engine.lab.experiments import compare_speculative

        progress("building a private engine on the loaded weights, then warm-up runs")

        def on_sample(r, side, smp):
            progress(f"round {r + 1}: {side} took {smp.seconds:.2f} s")

        return lab_proc.run(
            compare_speculative,
            base,
            text,
            want,
            n_tok,
            temperature=float(temperature),
            busy=lambda: th.step_num,
            busy_what="shared-engine steps (other requests on the same cores)",
            budget_s=mode.current().spec_budget_s,
            on_sample=on_sample,
        )

    if spec_mode == MEASURE:
        room.start_run("speculative", _experiment)
    else:
        from engine.lab.watch import WatchControl, watch_in_lab

        ctl = WatchControl(pace_s=float(pace), evict_after_tokens=int(evict_after) or None)
        temp = float(temperature)

        def _watch(progress):
            def on_step(snap, note):
                if snap is None:
                    progress(note)
                    return
                r = snap.request("watch")
                if r is not None:
                    progress(f"engine step {snap.step}: {r.state}, {r.output_len} tokens, {len(r.block_table)} blocks")

            return watch_in_lab(base, text, want, n_tok, ctl, temperature=temp, on_step=on_step)

        room.start_run(spec_watch.KIND, _watch, live=ctl)
    st.rerun()

cur_run = room.current_run("speculative") or room.current_run(spec_watch.KIND)
watching = cur_run is not None and cur_run.kind == spec_watch.KIND
if cur_run is not None and not cur_run.finished:
    # live: a fragment shows the progress; test mode waits here (this tab only), then draws once
    every = mode.wait_or_poll(lambda: not cur_run.finished, wait=cur_run.wait, interval_s=0.5)
    if every is not None:

        @st.fragment(run_every=every)
        def _progress():
            if cur_run.finished:
                st.rerun()
            if watching:
                spec_watch.live_view(cur_run)
                return
            st.info(
                f"Comparison {cur_run.run_id} {cur_run.status}: {cur_run.progress}. "
                "It runs on a private engine; the shared engine and other tabs keep going."
            )

        _progress()
        st.stop()
if cur_run is not None and cur_run.status == "error":
    st.error(f"The {'watched run' if watching else 'comparison'} failed: {cur_run.error}")
    st.stop()
res = cur_run.result if cur_run is not None else None
if watching and res is not None:
    spec_watch.result_view(res)
    st.stop()

if not res:
    st.info(
        "Pick a drafter and k, then run a prompt. Prompts whose answer repeats or edits the prompt "
        "suit n-gram drafting; switch on the mismatched draft to see speculation stop paying."
    )
    st.html(theme.token_legend_html())
    st.stop()

sreq, preq = res.spec, res.plain
if sreq is None:
    st.warning("The speculative request's final state was not recorded. Run again.")
    st.stop()
summ = spec.request_summary(sreq)
pc = spec.position_counts(sreq.tokens)
costs = spec.measured_costs(sreq, preq, res.verify)
cmp_ = res.comparison

st.subheader(f"Result — {res.label or 'speculation off'}")
if sreq.error:
    st.error(f"The request failed: {sreq.error}")
with st.container(key="spec_numbers"):
    c = st.columns(5)
    c[0].metric(
        "Acceptance rate",
        "—" if summ.acceptance_rate is None else f"{summ.acceptance_rate:.0%}",
        help="vLLM's definition: accepted draft tokens / draft tokens",
    )
    c[1].metric(
        "α per position",
        "—" if summ.alpha is None else f"{summ.alpha:.2f}",
        help="accepted / judged draft positions (a position is judged when every earlier draft token "
        "of its pass was accepted): the α of the theory curve",
    )
    c[2].metric(
        "Tokens / target pass",
        "—" if summ.tokens_per_target_pass is None else f"{summ.tokens_per_target_pass:.2f}",
        help=f"{sreq.output_len} tokens / {summ.target_passes} target passes (incl. the prefill pass "
        "and passes without a draft)",
    )
    c[3].metric(
        "Accept length",
        "—" if summ.mean_acceptance_length is None else f"{summ.mean_acceptance_length:.2f}",
        help="vLLM's mean acceptance length: 1 + accepted / drafts = tokens per verify pass",
    )
    c[4].metric(
        "Accepted / drafted",
        f"{summ.num_accepted} / {summ.num_draft_tokens}",
        help=f"draft tokens accepted / proposed, over {summ.num_drafts} verify passes"
        + (f" ({summ.mean_draft_length:.2f} drafted per pass)" if summ.mean_draft_length else ""),
    )
with st.container(key="spec_timing"):
    c = st.columns(4)
    if cmp_.suspect:
        c[0].metric("Wall-clock speedup vs plain", "suspect", help="not shown as a result: " + cmp_.suspect)
    else:
        c[0].metric(
            "Wall-clock speedup vs plain",
            f"{cmp_.ratio.median:.2f}×",
            help="median over rounds of plain seconds / speculative seconds, same prompt, same output",
        )
    c[1].metric(
        "Speculative e2e (median)",
        f"{cmp_.b.median:.2f} s",
        help=f"min {cmp_.b.lo:.2f} s, max {cmp_.b.hi:.2f} s over {cmp_.rounds} runs",
    )
    c[2].metric(
        "Plain e2e (median)",
        f"{cmp_.a.median:.2f} s",
        help=f"min {cmp_.a.lo:.2f} s, max {cmp_.a.hi:.2f} s over {cmp_.rounds} runs",
    )
    dr = res.decode_ratio
    c[3].metric(
        "Speedup after the first token",
        "—" if dr is None or cmp_.suspect else f"{dr.median:.2f}×",
        help="median over rounds of plain / speculative time after the first token (e2e less TTFT): the "
        "phase speculation speeds up; the prefill before it is the same work on both sides"
        + ("" if dr is None else f" (spread {dr.lo:.2f}–{dr.hi:.2f}×)"),
    )
with st.container(key="spec_conditions"):
    if cmp_.suspect:
        st.warning(f"Speedup {cmp_.ratio.median:.2f}× is suspect and not reported: {cmp_.suspect}")
    cond = (
        f"Conditions: {cmp_.conditions()}. Spread: speedup {cmp_.ratio.lo:.2f}–{cmp_.ratio.hi:.2f}×, "
        f"speculative {cmp_.b.lo:.2f}–{cmp_.b.hi:.2f} s, plain {cmp_.a.lo:.2f}–{cmp_.a.hi:.2f} s. "
        "Measured on a private engine that shares the loaded weights; the shared engine was not rebuilt "
        "and no request was aborted."
    )
    (st.warning if cmp_.contended else st.caption)(cond)
st.html(pool.kv_bar_html(th.snapshot_now()))
if preq is not None and sreq.output_text != preq.output_text:
    st.warning("The speculative and plain outputs differ (expected only with sampling, not greedy).")
elif preq is not None:
    st.caption(f"Same output as plain decoding: {sreq.output_len} tokens, identical text.")

st.markdown("**Generated tokens**")
st.html(tokens.strip_with_legend(sreq.tokens))
spec_watch.judged_table(sreq.tokens)
ticks = spec.tick_steps(sreq)
if len(ticks) > 1:
    tick = st.select_slider(
        "Tick timeline: scrub the run step by step (engine steps)", ticks, value=ticks[-1], key="spec_tick"
    )
    st.caption(spec.tick_caption(sreq, tick, th.snapshot().info.bytes_per_block))
    st.html(tokens.token_strip_html(spec.at_tick(sreq, tick)[0]))

left, right = st.columns(2, gap="large")
with left:
    ea.chart(
        spec.theory_figure(
            summ.alpha,
            summ.mean_draft_length or res.k,
            summ.mean_acceptance_length,
            k_max=16,
            measured_label="measured tokens per verify pass",
        ),
        key="spec_theory",
    )
    if summ.num_drafts == 0:
        st.caption(
            "No draft was proposed for this answer (n-gram lookup found no earlier match), so there is "
            "no measured point: every token came from a plain target pass."
        )
    ea.chart(spec.position_figure(pc), key="spec_pos")
with right:
    with st.container(key="spec_costs"):
        ea.chart(spec.costs_figure(costs), key="spec_costs_fig")
    st.markdown("**Fallback events**")
    if res.fallback:
        rows = [
            {
                "step": e.step,
                "class": str(e.data.get("request_class", "")),
                "action": "resumed speculating" if e.data.get("speculating") else "fell back to plain decoding",
                "reason": str(e.data.get("reason", "")),
            }
            for e in res.fallback
        ]
        st.dataframe(
            rows,
            hide_index=True,
            width="stretch",
            column_config={"reason": st.column_config.TextColumn("reason", width="large")},
        )
    else:
        st.caption("None during this run: speculation stayed on for this request class.")
