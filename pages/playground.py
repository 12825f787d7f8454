"""Playground: one prompt, streamed, with its KV cache drawn live beside it."""

from __future__ import annotations

import time

import streamlit as st

from engine.config import SamplingParams
from engine.core.thread import EngineCrashed
from ui.figures import growth, pool, theme, tokens
from ui.figures import load as L
from ui.widgets import engine_access as ea
from ui.widgets import mode, prompt_preview, redraw, room, shell

shell.enter_app()

EXAMPLE = "Explain in two sentences why a KV cache makes text generation faster."
SS = st.session_state
IDLE_REFRESH_S = 2.0  # how often an idle engine's views look for new work
# While the engine works, the Plotly views are built again at most this often (the answer's text
# and the metrics follow every update): each new figure costs the browser a full Plotly render on
# the same few cores as the engine (issue 32).
FIGURE_EVERY_S = 1.0

st.title("Playground")
st.caption(
    "Type a prompt (the model's chat template is applied): the preview under it follows every keystroke, "
    "before anything runs. Generate streams the answer on the left; "
    "on the right, live from the engine: the whole block pool, this request's block table, "
    "its cache growth and phases, and every generated token."
)

th = ea.require_engine()


def _evict_steps(rid: str) -> list[int]:
    try:
        return [e.step for e in th.events.since(0, kinds=["evict"]) if e.request_id == rid]
    except Exception:
        return []


def render_views(rid: str | None, tag: str, *, busy: bool = False) -> None:
    snap = ea.current_snapshot(th)
    # Figures are built again only when what they draw changed (an idle page builds nothing; a
    # finished request's views are not rebuilt while other requests run); while the engine is
    # busy, at most once every FIGURE_EVERY_S.
    every = FIGURE_EVERY_S if busy and mode.current().refresh else 0.0
    skey = (redraw.snapshot_key(snap), rid)
    colors = theme.request_colors_for(snap)
    rkey = (redraw.request_key(snap, rid), colors.index(rid) if rid is not None else None)
    mine = room.mine(snap)
    ea.chart(
        redraw.memo(
            "pg_pool",
            (skey, mine),
            lambda: pool.pool_map_figure(snap, colors, highlight=rid, mine=mine),
            at_most_every=every,
        ),
        key=f"pool_{tag}",
    )
    st.html(theme.block_legend_html())
    if L.origin_html(snap):
        st.html(L.origin_html(snap))  # HTTP API requests on the same engine (their blocks are above)
    if rid is None:
        st.info("Submit a prompt to see its block table, cache growth and tokens.")
        return
    req = snap.request(rid)
    if req is None:
        st.info("This request is no longer in the engine's snapshot (only recent finished requests are kept).")
        return
    stats = growth.phase_stats(req, now=snap.time)
    c = st.columns(2) + st.columns(2)
    with c[0].container(key=f"pg_timing_a_{tag}"):
        st.metric("TTFT", growth.format_seconds(stats.ttft_s), help="arrival → first generated token (wall clock)")
    with c[1].container(key=f"pg_timing_b_{tag}"):
        st.metric(
            "Decode",
            "—" if stats.decode_tok_s is None else f"{stats.decode_tok_s:.0f} tok/s",
            help="tokens after the first / time from the first to the newest token (1 / TPOT)",
        )
    c[2].metric("Prompt · output", f"{req.prompt_len} · {req.output_len}", help="tokens")
    c[3].metric("K/V held", L.format_bytes(req.kv_bytes), help="bytes of keys and values this request holds now")
    st.caption(
        f"State: {req.state}"
        + (f" ({req.finish_reason})" if req.finish_reason else "")
        + (f" · prefix-cache hit: {req.num_cached_tokens} prompt tokens" if req.num_cached_tokens else "")
        + (f" · preempted {req.num_preemptions}×" if req.num_preemptions else "")
    )
    if req.block_table:
        bt = redraw.memo("pg_bt", rkey, lambda: pool.block_table_figure(snap, rid, colors), at_most_every=every)
        ea.chart(bt, key=f"bt_{tag}")
    elif req.is_terminal:
        held = max((p.num_blocks for p in req.history), default=0)
        st.markdown("**Block table**")
        st.caption(
            f"Finished: it held up to {held} block(s); they were released at the end. Full blocks "
            "stay cached-free (grey, “c”) so the same prefix can be reused without recomputation."
        )
    else:
        st.markdown("**Block table**")
        st.caption(
            f"No blocks held right now ({req.state}" + (f": {req.waiting_reason}" if req.waiting_reason else "") + ")."
        )
    ev = redraw.memo("pg_ev", rkey, lambda: _evict_steps(rid))
    fig_growth = redraw.memo(
        "pg_growth", rkey, lambda: growth.growth_figure(req, snap.info.block_size, evict_steps=ev), at_most_every=every
    )
    ea.chart(fig_growth, key=f"growth_{tag}")
    ea.chart(redraw.memo("pg_phase", rkey, lambda: growth.phase_figure(req), at_most_every=every), key=f"phase_{tag}")
    st.caption(
        f"{stats.prefill_steps} prefill step(s) for {stats.prompt_tokens} prompt tokens, "
        f"{stats.decode_steps} decode step(s) for {stats.output_tokens} generated tokens. "
        "Prefill processes the prompt in parallel; decode adds one token (or, with speculation, "
        "several) per step."
    )
    st.markdown("**Generated tokens**")
    if snap.info.speculative is None:
        st.caption("Speculative decoding is off (sidebar): every token comes from one target pass.")
    st.html(
        redraw.memo(
            "pg_tokens",
            rkey,
            lambda: tokens.strip_with_legend(
                req.tokens,
                evicted_before_step=tokens.recomputed_before_step(ev),
                prompt_evicted_tokens=req.prompt_len if ev else 0,
            ),
        )
    )


left, right = st.columns([5, 7], gap="large")

with left:
    max_tokens = st.slider("Max new tokens", 1, 256, 48, key="pg_max_tokens")
    prompt_preview.prompt_with_preview(
        th, "pg", SamplingParams(max_tokens=int(max_tokens)), default=SS.get("pg_prompt", EXAMPLE)
    )
    submitted = st.button("Generate", type="primary", key="pg_generate")
    system, prompt = prompt_preview.typed("pg")
    actions = st.container()
    answer = st.container()

with right:
    slot = st.empty()

_n = [0]


def _refresh_views(rid: str, last: list) -> None:
    """While the answer streams (one script run), the views are drawn again as new elements, each
    a full Plotly render in the browser: at most once every FIGURE_EVERY_S."""
    every = mode.run_every(FIGURE_EVERY_S)
    if every and time.monotonic() - last[0] >= every:
        last[0] = time.monotonic()
        _n[0] += 1
        with slot.container():
            render_views(rid, f"s{_n[0]}", busy=True)


def _stream(h):
    last = [0.0]
    for delta in h.stream():
        yield delta
        _refresh_views(h.request_id, last)


def _resume(rid: str):
    """After a rerun (e.g. the Evict button) while the answer is still being generated: the text
    so far, then the rest as the engine produces it (read from snapshots)."""
    sent, last = 0, [0.0]
    while True:
        req = ea.current_snapshot(th).request(rid)  # the published frame: no call into the core
        if req is None:
            return
        text = req.output_text
        if len(text) > sent:
            yield text[sent:]
            sent = len(text)
        if req.is_terminal:
            return
        _refresh_views(rid, last)
        time.sleep(0.1)


def evict_button(rid: str) -> None:
    with actions:
        if st.button(
            "Evict KV cache",
            key="pg_evict",
            help="Drop this request's keys and values from the pool; the engine must recompute "
            "them (prompt and generated tokens) before it can continue.",
        ):
            try:
                r = th.evict(rid)
                st.info(
                    f"Evicted: {r.get('blocks_freed', '?')} blocks freed, "
                    f"{r.get('tokens_to_recompute', '?')} tokens to recompute."
                    if isinstance(r, dict)
                    else "Evicted."
                )
            except ValueError as e:
                st.warning(f"Nothing to evict: {e}")


h = None
if submitted:
    try:
        h = prompt_preview.submit_typed(th, "pg", SamplingParams(max_tokens=int(max_tokens), temperature=0.0, seed=0))
    except ValueError as e:
        with answer:
            st.error(f"Not submitted: {e}")
    except EngineCrashed as e:
        with answer:
            st.error(f"Not submitted: the engine is down ({e}). Restart it from the Home page.")
if h is not None:
    SS["pg_rid"], SS["pg_prompt"], SS["pg_answer"] = h.request_id, prompt, ""
    evict_button(h.request_id)
    with answer:
        with st.chat_message("user"):
            st.text(prompt)
        with st.chat_message("assistant"):
            try:
                SS["pg_answer"] = st.write_stream(_stream(h)) or ""
            except (EngineCrashed, TimeoutError) as e:
                st.error(f"The request did not complete: {e}")
elif SS.get("pg_rid"):
    rid = SS["pg_rid"]
    evict_button(rid)
    with answer:
        with st.chat_message("user"):
            st.text(SS.get("pg_prompt", ""))
        with st.chat_message("assistant"):
            req = th.snapshot_now().request(rid)
            if req is not None and not req.is_terminal:
                SS["pg_answer"] = st.write_stream(_resume(rid)) or ""
            else:
                st.markdown((req.output_text if req is not None else SS.get("pg_answer", "")) or "…")


def _engine_busy(snap) -> bool:
    return bool(snap is not None and (snap.running_ids or snap.waiting_ids or snap.swapped_ids))


# While the engine has work the views follow it at 4 Hz; idle, the page only looks every 2 s
# whether work arrived (e.g. an API request) and then reruns to follow it: an idle page costs the
# browser and the server next to nothing.
_busy = _engine_busy(th.snapshot())


@st.fragment(run_every=mode.run_every(mode.LIVE_INTERVAL_S if _busy else IDLE_REFRESH_S))
def live():
    if mode.current().refresh and _engine_busy(th.snapshot()) != _busy:
        st.rerun()  # the whole page, so the fragment's refresh interval follows the new state
    render_views(SS.get("pg_rid"), "live", busy=_busy)


with slot.container():  # the same place the streaming updates used: no stale duplicate below
    live()
