"""Cache vs no-cache: what the KV cache saves per token, and what it costs when 50 sequences grow."""

from __future__ import annotations

import streamlit as st

from engine.lab import experiments, lab_proc
from ui.figures import cache_cost as CC
from ui.figures import events_table as et
from ui.figures import exercise as EX
from ui.widgets import engine_access as ea
from ui.widgets import mode, shell

shell.enter_app()

SS = st.session_state

st.title("Cache vs no-cache")
st.caption(
    "Keys and values of earlier tokens never change (attention is causal), so an engine can compute "
    "them once and keep them. Without that cache every new token re-runs the whole sequence through "
    "the model. With it, memory becomes the limit instead: the cache grows with every token of every "
    "sequence. Both halves of this page are measured on private engines, not simulated."
)

base = ea.engine_config()

# ================================================================== 1. cost per generated token
st.header("1 · Cost per generated token", divider="gray")
with st.form("cvn_cost_form"):
    c = st.columns(3)
    n_tok = c[0].number_input("Tokens to generate", 8, 1024, mode.current().cost_tokens, step=8, key="cvn_n")
    p_tok = c[1].number_input("Prompt length (tokens)", 1, 1024, 32, key="cvn_p")
    c[2].caption(
        f"Model: **{base.model}** (the server's model). Greedy, EOS ignored, one request, one step "
        "at a time; each step's wall time is measured around the engine's step()."
    )
    run_cost = st.form_submit_button("Measure with and without the cache", type="primary")

if run_cost:
    n, p = int(n_tok), int(p_tok)
    th = ea.require_engine()
    bar = st.progress(0.0, text="waiting for the measurement slot…")
    try:
        with experiments.RUN_LOCK:
            bar.progress(0.05, text="two private engines on the loaded weights, then alternating rounds…")
            res = lab_proc.run(
                experiments.compare_cache_vs_nocache,
                base,
                n,
                p,
                busy=lambda: th.step_num,
                busy_what="shared-engine steps (other requests on the same cores)",
                on_sample=lambda r, side, smp: bar.progress(
                    min(1.0, (2 * r + 1 + (side == "cache")) / 6), text=f"round {r + 1}: {side} {smp.seconds:.2f} s"
                ),
            )
        SS["cvn_cost"] = {
            "cache": res["cache"],
            "nocache": res["nocache"],
            "n": n,
            "p": p,
            "model": base.model,
            "comparison": res["comparison"],
        }
    except ValueError as e:
        st.error(f"Not measured: {e}")
    bar.empty()

cost = SS.get("cvn_cost")
if cost:
    (pf_a, pa), (pf_b, pb) = cost["cache"], cost["nocache"]
    sa, sb = CC.cost_summary(pa), CC.cost_summary(pb)
    fa, fb = CC.cumulative_fed(pa), CC.cumulative_fed(pb)
    c = st.columns(4)
    c[0].metric("Decode time, with cache", f"{sa['total_s']:.2f} s")
    cmp_ = cost.get("comparison")
    c[1].metric(
        "Decode time, no cache",
        f"{sb['total_s']:.2f} s",
        delta=(
            f"{cmp_.ratio.median:.1f}× slower (median)"
            if cmp_
            else f"{sb['total_s'] / sa['total_s']:.1f}× slower"
            if sa["total_s"]
            else None
        ),
        delta_color="off",
    )
    c[2].metric("Tokens through the model, with cache", f"{fa[-1] if fa else 0:,}")
    c[3].metric("Tokens through the model, no cache", f"{fb[-1] if fb else 0:,}")
    if cmp_:
        (st.warning if cmp_.contended else st.caption)(
            f"No-cache / cache decode time: median {cmp_.ratio.median:.2f}× (range {cmp_.ratio.lo:.2f}–"
            f"{cmp_.ratio.hi:.2f}×); with the cache median {cmp_.b.median:.2f} s ({cmp_.b.lo:.2f}–{cmp_.b.hi:.2f}), "
            f"without {cmp_.a.median:.2f} s ({cmp_.a.lo:.2f}–{cmp_.a.hi:.2f}). Conditions: {cmp_.conditions()}. "
            "The decode times and chart above are the median round's."
        )
    ea.chart(CC.cost_figure(pa, pb), key="cvn_cost_fig")
    st.markdown(
        f"**Reading it.** Both runs prefilled the same {cost['p']}-token prompt and then generated {cost['n']} tokens "
        "one step at a time. With the cache each step fed the model only the newest token — "
        f"{fa[-1] if fa else 0:,} tokens over the whole decode, linear in the length. Without it each step re-fed the "
        f"entire sequence: {fb[-1] if fb else 0:,} tokens, which grows with the square of the length. Measured step "
        f"times (median of the first → last quarter): with the cache {1000 * sa['early_step_s']:.1f} → "
        f"{1000 * sa['late_step_s']:.1f} ms, without {1000 * sb['early_step_s']:.1f} → "
        f"{1000 * sb['late_step_s']:.1f} ms; "
        f"a least-squares fit puts the no-cache cost at {1e6 * sb['slope_s_per_ctx_token']:.0f} µs per extra token of "
        f"context vs {1e6 * sa['slope_s_per_ctx_token']:.0f} µs with the cache. Wall times come from a shared CPU and "
        "move a little between runs; the token counts do not. On a small model at short lengths, fixed per-step "
        "overheads hide part of the gap; it widens as the context grows."
    )
else:
    st.info("Press **Measure** to time the same generation with the KV cache and without it (kv_cache=False).")

# ================================================================== 2. 50 growing sequences
st.header("2 · Fifty growing sequences vs a fixed budget", divider="gray")
st.caption(
    "The seed's exercise on the real engine: many sequences whose caches all grow at once, against a KV "
    "budget far below what they would need together. Three runs of the same sequences: (A) nothing is ever "
    "evicted — the engine is given all the memory it asks for and we watch its KV use cross the budget, the "
    "point where a server that keeps every cache would fail with MemoryBudgetExceeded; (B) the budget is "
    "enforced without eviction by reserving each sequence's full final length at admission, so the rest must "
    "wait; (C) the budget is enforced with LRU preemption: when blocks run out, the least recently "
    "scheduled sequence gives its blocks back and recomputes later."
)
with st.form("cvn_ex_form"):
    c = st.columns(5)
    n_seq = c[0].number_input("Sequences", 2, 200, 50, key="cvn_seqs")
    p_len = c[1].number_input("Prompt (tokens)", 1, 512, 24, key="cvn_plen")
    growth = c[2].number_input("Tokens each grows by", 1, 1024, mode.current().exercise_growth, key="cvn_growth")
    ex_budget = c[3].number_input("KV budget (blocks)", 2, 4096, 64, key="cvn_budget")
    ex_bs = c[4].selectbox("Block size", (4, 8, 16, 32), index=2, key="cvn_bs")
    models = ["tiny", base.model] if base.model != "tiny" else ["tiny"]
    ex_model = st.radio(
        "Model",
        models,
        horizontal=True,
        key="cvn_model",
        format_func=lambda m: (
            "tiny (2-layer test model: fast; the memory behaviour is the same, "
            "since it depends on lengths, not weights)"
            if m == "tiny"
            else f"{m} (the server's model: slower)"
        ),
    )
    run_ex = st.form_submit_button("Run the three engines", type="primary")

if run_ex:
    n, p, g, bs, budget = int(n_seq), int(p_len), int(growth), int(ex_bs), int(ex_budget)
    bar = st.progress(0.0, text="waiting for the measurement slot…")
    try:
        plan = experiments.exercise_plan(
            base, n=n, prompt_tokens=p, growth=g, budget_blocks=budget, block_size=bs, model=ex_model
        )

        def on_step(i, s, snap):
            if s % 20 == 0:
                bar.progress(min(0.999, (i + snap.metrics.num_finished / n) / 3), text=f"run {plan[i][0]}: step {s}")

        with experiments.RUN_LOCK:
            runs = lab_proc.run(
                experiments.run_exercise,
                plan,
                experiments.exercise_prompts(n, p),
                g,
                budget_tokens=budget * bs,
                on_step=on_step,
            )
        SS["cvn_ex"] = {"runs": runs, "n": n, "p": p, "g": g, "bs": bs, "budget": budget, "model": ex_model}
    except ValueError as e:
        st.error(f"Not run: {e}")
    bar.empty()

ex = SS.get("cvn_ex")
if not ex:
    st.info("Press **Run the three engines** to reproduce the exercise on the engine.")
    st.stop()

runs = ex["runs"]
sums = [EX.exercise_summary(r) for r in runs]
budget_tok = ex["budget"] * ex["bs"]
st.caption(
    f"{ex['n']} sequences × ({ex['p']} prompt + {ex['g']} generated) tokens on model {ex['model']}; "
    f"budget {ex['budget']} blocks × {ex['bs']} = {budget_tok:,} token slots; together they need up to "
    f"{ex['n'] * (ex['p'] + ex['g']):,}."
)
cols = st.columns(3)
for col, s, r in zip(cols, sums, runs):
    with col:
        st.markdown(f"**{s['label']}**")
        c = st.columns(2)
        c[0].metric("Finished", f"{s['finished']} / {s['requests']}")
        d = s["peak_held"] - budget_tok
        c[1].metric(
            "Peak KV slots",
            f"{s['peak_held']:,}",
            delta=f"{d:+,}" if d else "0",
            delta_color="inverse" if d else "off",
            help=f"difference from the budget of {budget_tok:,} slots",
        )
        c = st.columns(2)
        c[0].metric("Preemptions", s["preemptions"])
        c[1].metric("Steps", s["steps"])
        first = s["held_over_budget_step"]
        if first is not None:
            st.error(
                f"The engine's own KV use passed the budget at step {first}: a server that keeps every "
                "cache and enforces this budget raises MemoryBudgetExceeded there.",
                icon=":material/memory:",
            )
        elif s["over_budget_step"] is not None:
            when = "from the start" if s["over_budget_step"] == 0 else f"from step {s['over_budget_step']}"
            st.success(
                f"Demand exceeded the budget {when}, yet KV use never did: "
                + (
                    "sequences waited for room instead."
                    if s["preemptions"] == 0
                    else f"{s['preemptions']} preemptions kept it inside."
                ),
                icon=":material/check_circle:",
            )
        reasons = EX.waiting_reasons(r, limit=3)
        if reasons:
            st.caption(
                "Engine's waiting reasons (most sequences waiting at once): "
                + "; ".join(f"{why} ({k})" for why, k in reasons)
            )

ea.chart(EX.exercise_figure(runs), key="cvn_ex_fig")
st.markdown(
    "**Reading it.** The dashed line is demand: the context every unfinished sequence has built so far, i.e. "
    "what a server that never evicts must hold at that moment. Run A holds all of it (rounded up to whole "
    "blocks) and crosses the budget (dotted) within a few steps. Run B never crosses it, because each admitted "
    "sequence reserved its final size up front — "
    "but then only a few fit at a time, and the rest queue. Run C lets every sequence start, and when the blocks "
    "run out it takes them back from the sequence scheduled longest ago; that sequence later recomputes its "
    "context (the greedy output is the same), so all of them finish without the budget ever being exceeded. "
    "The cost of C is recomputation, visible as extra steps."
)
with st.expander("Preemption and admission events of run C"):
    evs = et.filter_events(runs[2].events, ("preempt", "admit", "reject", "finish"), limit=120)
    st.html(et.events_html(evs))
dl = st.columns(3)
for i, r in enumerate(runs):
    dl[i].download_button(
        f"Trace of run {r.label[:1]}",
        data=r.trace_text,
        file_name=f"kvscope-exercise-{r.label[:1]}.jsonl",
        mime="application/jsonl",
        key=f"cvn_dl_{i}",
        on_click="ignore",
    )
