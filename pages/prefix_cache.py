"""Prefix cache: one system prompt, several user turns, blocks shared by reference count."""

from __future__ import annotations

import streamlit as st

from engine.lab import experiments, lab_proc, packet_channel, side_channel
from engine.lab.workloads import make_workload
from ui.figures import events_table as et
from ui.figures import pool, theme
from ui.figures import prefix_sharing as PS
from ui.widgets import engine_access as ea
from ui.widgets import mode, shell, side_channel_view

shell.enter_app()

SS = st.session_state

st.title("Prefix cache")
st.caption(
    "Requests that begin with the same text — a long system prompt — produce the same keys and values "
    "for those tokens. The engine identifies every full block by a hash chained from the previous block's "
    "hash and the block's tokens, so a new request can reuse the blocks of its longest cached prefix "
    "(their reference count goes up) and only compute the rest. Measured here on a private engine that "
    "shares the loaded weights."
)

th = ea.require_engine()
snap0 = th.snapshot()
info0 = snap0.info


@st.cache_data(show_spinner=False)
def _defaults(system_words: int, n: int) -> tuple[str, list[str]]:
    reqs = make_workload("shared-system-prompt", n, 3, system_words=system_words, arrival_rate=None)
    prefix = "System: "
    text = reqs[0].prompt
    system = text[len(prefix) : text.index("\n\nUser: ")]
    questions = [r.prompt[r.prompt.index("\n\nUser: ") + 8 :].removesuffix("\nAssistant:") for r in reqs]
    return system, questions


small = mode.current().small_workloads or info0.num_blocks * info0.block_size < 4096
sys_default, q_default = _defaults(40 if small else 200, 4 if small else 6)

if not info0.enable_prefix_caching:
    st.warning(
        "Prefix caching is switched off in the shared engine's settings (sidebar), so nothing can be "
        "shared: both runs below will miss. Switch it on to see sharing."
    )

with st.form("pc_form"):
    system = st.text_area(
        "System prompt (shared by every turn)", sys_default, height=120, max_chars=20_000, key="pc_system"
    )
    users = st.text_area(
        "User turns (one per line)", "\n".join(q_default), height=110, max_chars=20_000, key="pc_users"
    )
    c = st.columns(3)
    max_tokens = c[0].slider("Answer length (tokens)", 1, 128, 8 if small else 16, key="pc_max_tokens")
    c[1].caption("The first turn runs alone, then the others together — so they can reuse its blocks.")
    c[2].caption(
        "Two sides, alternated for 3 rounds: one fresh cache namespace (cache_salt) per round, "
        "and one fresh salt per request, which forces misses on the same engine."
    )
    go = st.form_submit_button("Measure with and without sharing", type="primary")

if go:
    turns = [u.strip() for u in users.splitlines() if u.strip()][:12]
    if not system.strip() or not turns:
        st.error("Give a system prompt and at least one user turn.")
    else:
        prompts = [experiments.chat_prompt(th.tokenizer, system.strip(), u) for u in turns]
        lens = [len(th.tokenizer(p_, add_special_tokens=False)["input_ids"]) for p_ in prompts]
        try:
            with (
                st.spinner("Cold and warm turns alternating on a private engine (same weights, its own pool)…"),
                experiments.RUN_LOCK,
            ):
                out = lab_proc.run(
                    experiments.compare_prefix,
                    ea.engine_config(),
                    prompts,
                    int(max_tokens),
                    prompt_lens=lens,
                    busy=lambda: th.step_num,
                    busy_what="shared-engine steps (other requests on the same cores)",
                )
            SS["pc_result"] = {
                "hit": out["hit"],
                "miss": out["miss"],
                "best": out["best"],
                "rec": out["rec"],
                "tag": out["tag"],
                "turns": len(turns),
                "comparison": out["comparison"],
            }
        except ValueError as e:  # the engine refused a request (too long for the budget, a tier cap…)
            st.error(f"The engine refused a request: {e}")
        except Exception as e:  # engine crashed / timed out: say so, keep the page
            st.error(f"Measurement failed: {type(e).__name__}: {e}")

res = SS.get("pc_result")
if not res:
    st.info(
        "Press **Measure** to run the turns with prefix sharing and with forced misses, alternating, "
        "on a private engine that shares the loaded weights."
    )


def show_result(res) -> None:
    hit, miss, best = res["hit"], res["miss"], res["best"]
    sh, sm = PS.prefix_summary(hit), PS.prefix_summary(miss)
    share = experiments.sharing_stats(best)
    c = st.columns(6)
    c[0].metric(
        "Prefix hit rate (this run)",
        f"{100 * sh['hit_rate']:.0f}%",
        help="prompt tokens served from the cache / all prompt tokens, over the run with sharing",
    )
    c[1].metric("Hit rate with forced misses", f"{100 * sm['hit_rate']:.0f}%")
    c[2].metric(
        "Mean TTFT, later turns (shared)",
        "—" if len(hit) < 2 else f"{1000 * PS.prefix_summary(hit[1:])['mean_ttft_s']:.0f} ms",
    )
    c[3].metric(
        "Mean TTFT, later turns (misses)",
        "—" if len(miss) < 2 else f"{1000 * PS.prefix_summary(miss[1:])['mean_ttft_s']:.0f} ms",
    )
    saved = PS.ttft_saved_ms(hit, miss)
    c[5].metric(
        "TTFT saved, later turns",
        "—" if saved is None else f"{saved:,.0f} ms",
        help="mean TTFT of the later turns with forced misses minus with the prefix cache (cold − warm)",
    )
    c[4].metric(
        "Blocks shared at peak",
        f"{share['shared_blocks']} (×{share['max_ref']})",
        help="blocks held by more than one request at once, and the largest reference count",
    )

    cmp_ = res.get("comparison")
    if cmp_:
        (st.warning if cmp_.contended else st.caption)(
            f"Mean TTFT of the later turns, cold / warm: median {cmp_.ratio.median:.2f}× (range {cmp_.ratio.lo:.2f}–"
            f"{cmp_.ratio.hi:.2f}×); warm median {1000 * cmp_.b.median:.0f} ms ({1000 * cmp_.b.lo:.0f}–"
            f"{1000 * cmp_.b.hi:.0f}), cold {1000 * cmp_.a.median:.0f} ms "
            f"({1000 * cmp_.a.lo:.0f}–{1000 * cmp_.a.hi:.0f}). "
            f"Conditions: {cmp_.conditions()}. Run on a private engine sharing the loaded weights (the shared pool "
            "was not touched); the turns shown are the median round's."
        )
    ea.chart(PS.prefix_figure(hit, miss), key="pc_fig")

    if best is not None and share["shared_blocks"]:
        st.subheader("The pool while the later turns ran together")
        ea.chart(pool.pool_map_figure(best, title="KV block pool at peak sharing"), key="pc_pool")
        st.html(theme.block_legend_html())
        st.caption(
            f"Engine step {best.step}. Cells marked ×n are one physical block in n requests' block tables: "
            "the system prompt's keys and values, stored once."
        )
    elif best is not None:
        st.caption("No block was shared by two running requests at the same moment in this run.")

    later_hit = PS.prefix_summary(hit[1:]) if len(hit) > 1 else None
    later_miss = PS.prefix_summary(miss[1:]) if len(miss) > 1 else None
    if later_hit and later_miss and later_hit["mean_ttft_s"] and later_miss["mean_ttft_s"]:
        cached_each = [r.cached_tokens for r in hit[1:]]
        span = (
            f"{min(cached_each)}" if min(cached_each) == max(cached_each) else f"{min(cached_each)}–{max(cached_each)}"
        )
        st.markdown(
            f"**What was measured.** Turn 1 found nothing cached in its fresh namespace and computed all "
            f"{hit[0].prompt_tokens} prompt tokens. Turns 2–{len(hit)} then found {span} "
            f"of their prompt tokens already cached — the full blocks of the shared system prompt; a partly filled "
            f"last block is never shared — and prefilled only the rest. Their mean time to first token was "
            f"{1000 * later_hit['mean_ttft_s']:.0f} ms, against {1000 * later_miss['mean_ttft_s']:.0f} ms for the same "
            f"turns with a fresh salt each (every prompt token computed). TTFT is wall time on a shared CPU, so "
            "other sessions' work can move it (see the conditions above); the cached-token counts come straight from "
            "the engine."
        )
    with st.expander("Prefix-cache events of this measurement"):
        evs = [e for e in res["rec"].events if (e.request_id or "").startswith(res["tag"])]
        st.html(et.events_html(et.filter_events(evs, ("prefix_hit", "admit", "preempt", "finish", "reject"), limit=60)))
    st.download_button(
        "Download this measurement's trace (JSONL)",
        data=res["rec"].trace_text,
        file_name=f"kvscope-prefix-{res['tag']}.jsonl",
        mime="application/jsonl",
        key="pc_dl",
        on_click="ignore",
    )


if res:
    show_result(res)

# ------------------------------------------------------------------ the timing side channel (shared engine)
asked = side_channel_view.controls(small=small)
if asked is not None:
    prefix_tokens, rounds = asked
    bar = st.progress(0.0, text="probing…")
    try:
        probes = side_channel.measure(
            th,
            prefix_tokens=prefix_tokens,
            rounds=rounds,
            on_probe=lambda p, i, n: bar.progress(i / n, text=f"probe {i} of {n}"),
        )
        probed = side_channel.probed_prefix_tokens(prefix_tokens, th.config.block_size)
        SS["sc_result"] = {"probes": probes, "prefix": probed}
    except ValueError as e:
        st.error(f"Not measured: {e}")
    except Exception as e:  # noqa: BLE001 - engine down or timed out: a message, not a traceback
        st.error(f"Measurement failed: {type(e).__name__}: {e}")
    bar.empty()
side_channel_view.result(SS.get("sc_result"))

# ------------------------------------------------------------------ the packet-size side channel (TLS on loopback)
asked = side_channel_view.packet_controls(small=small)
if asked is not None:
    bar = st.progress(0.0, text="streaming…")
    try:
        SS["pk_result"] = packet_channel.measure(
            th, **asked, on_trial=lambda t, i, n: bar.progress(i / n, text=f"stream {i} of {n}")
        )
    except ValueError as e:
        st.error(f"Not measured: {e}")
    except Exception as e:  # noqa: BLE001 - engine down, no openssl, timed out: a message, not a traceback
        st.error(f"Measurement failed: {type(e).__name__}: {e}")
    bar.empty()
side_channel_view.packet_result(SS.get("pk_result"))
