"""kvscope: a live look inside an LLM inference engine. `streamlit run app.py`

Entry point for every page (st.navigation): sets the page config, draws the shared engine
settings in the sidebar, then runs the chosen page from pages/. Each page file starts with
`ui.widgets.shell.enter_app()`, which routes a direct page URL on a fresh server through this script
(see ui/widgets/shell.py and docs/DESIGN.md).
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from engine.lab import memory_math as mm
from ui.figures import memory_calc as mc
from ui.figures import theme
from ui.widgets import engine_access as ea

ROOT = Path(__file__).resolve().parent
PAGES_DIR = ROOT / "pages"

# (file in pages/, title, url path, icon, one-line description for Home)
PAGES = [
    (
        "demo.py",
        "Demo",
        "demo",
        ":material/slideshow:",
        "a guided tour in chapters: the release-freeze afternoon and speculation, from recorded traces or live",
    ),
    (
        "claims.py",
        "Claims",
        "claims",
        ":material/fact_check:",
        "the seeds' claims about inference, each beside this machine's measurement: holds or not, and why",
    ),
    (
        "playground.py",
        "Playground",
        "playground",
        ":material/chat:",
        "type a prompt; watch its blocks, cache growth, phases and (with speculation) every draft token",
    ),
    (
        "load.py",
        "Concurrent load",
        "load",
        ":material/groups:",
        "launch many requests; queues, KV usage vs budget, preemptions, latency percentiles",
    ),
    (
        "speculative.py",
        "Speculative decoding",
        "speculative",
        ":material/fast_forward:",
        "draft, verify, accept or reject: measured α and speedup against the theory curve",
    ),
    (
        "prefix_cache.py",
        "Prefix cache",
        "prefix_cache",
        ":material/share:",
        "one system prompt, many users: shared blocks, hit rate, TTFT with and without the cache",
    ),
    (
        "memory_calculator.py",
        "Memory calculator",
        "memory_calculator",
        ":material/calculate:",
        "KV bytes per token and per sequence for any model config, dtype and context",
    ),
    (
        "paged_vs_contiguous.py",
        "Paged vs contiguous",
        "paged_vs_contiguous",
        ":material/grid_view:",
        "the same workload on both allocators: allocated vs filled slots, waste, admissions",
    ),
    (
        "cache_vs_nocache.py",
        "Cache vs no-cache",
        "cache_vs_nocache",
        ":material/speed:",
        "what the KV cache saves: cost per token with and without it, and the 50-sequence budget",
    ),
    ("replay.py", "Replay", "replay", ":material/replay:", "load a recorded trace and scrub through it step by step"),
    (
        "attach.py",
        "Attach to a server",
        "attach",
        ":material/link:",
        "a running kvscope or vLLM server: its metrics, queues and the prefix cache rebuilt from its KV events",
    ),
    (
        "fleet.py",
        "Fleet",
        "fleet",
        ":material/hub:",
        "several engines behind vLLM's router: every cache rebuilt from its events, merged, each routing checked",
    ),
]


def home() -> None:
    st.title("kvscope")
    st.markdown(
        "kvscope runs a real language model through a small inference engine built the way "
        "production servers are built, and lets you watch its memory while it works. Each token's "
        "keys and values are kept in a pool of fixed-size **KV blocks**; a request's **block table** "
        "maps its positions to those blocks. Here you can see the pool fill up as answers grow, "
        "requests share blocks for a common prompt, the scheduler preempt or swap requests when the "
        "budget runs out, and speculative decoding guess several tokens ahead and have the model "
        "accept or reject them — all from the engine's own state, step by step."
    )
    th = ea.get_engine()
    if th is None:
        st.error(f"The engine could not be started: {ea.engine_error()}")
        if st.button("Try again"):
            ea.shared_engine().retry()
            st.rerun()
    else:
        _engine_panel(th)
    st.subheader("Pages")
    cols = st.columns(2)
    for i, (fname, title, _url, icon, desc) in enumerate(PAGES):
        with cols[i % 2]:
            st.page_link(_page_objects[fname], label=title, icon=icon)
            st.caption(desc)
    st.subheader("Colours used on every page")
    st.html(theme.block_legend_html())
    st.html(theme.token_legend_html())


_KERNEL_NAMES = {
    "cpu_kernel": "kvscope C kernel",
    "onednn": "oneDNN packed",
    "torch": "PyTorch",
    "flex": "FlexAttention in place (all rows)",
}


def _engine_panel(th) -> None:
    snap = th.snapshot()
    info = snap.info
    st.session_state["engine_info"] = info  # the memory calculator offers the loaded model's shape
    healthy = th.healthy
    st.subheader("Engine")
    if healthy:
        st.success("Engine healthy: the step loop is running.", icon=":material/check_circle:")
    else:
        st.error(f"Engine crashed: {th.error}", icon=":material/error:")
        if st.button(ea.restart_label(th), type="primary"):
            th.restart()
            st.rerun()
    c = st.columns(4)
    c[0].metric("Model", info.model)
    c[1].metric("Device · dtype", f"{info.device} · {info.dtype}")
    c[2].metric("KV bytes per token", f"{info.bytes_per_token:,}")
    c[3].metric("KV budget", f"{info.kv_cache_bytes / 2**20:,.2f} MiB")
    st.caption(
        f"bytes per token ({info.kv_cache_dtype}) = "
        f"{mm.formula_factors(mc.config_from_engine_info(info), info.kv_cache_dtype).replace(' x ', ' × ')} "
        f"= {info.bytes_per_token:,} bytes. Pool: {info.num_blocks:,} blocks × "
        f"{info.block_size} tokens = {info.num_blocks * info.block_size:,} token slots "
        f"({info.bytes_per_block:,} bytes per block)."
    )
    m = snap.metrics
    c = st.columns([2, 3, 3])
    c[0].metric("Running · waiting", f"{m.num_running} · {m.num_waiting}")
    c[1].metric("Blocks used · cached · free", f"{m.num_blocks_used} · {m.num_blocks_cached} · {m.num_blocks_free}")
    c[2].metric("Speculative decoding", info.speculative or "off")
    st.caption(
        f"Prefix caching {'on' if info.enable_prefix_caching else 'off'} · preemption by "
        f"{info.preemption_mode} · up to {info.max_num_seqs} concurrent sequences · "
        f"max model length {info.max_model_len:,} tokens · {info.allocator} allocator · kernels: "
        f"Linear {_KERNEL_NAMES.get(info.linear_backend, info.linear_backend)}, decode attention "
        f"{_KERNEL_NAMES.get(info.attention_backend, info.attention_backend)}, layers "
        f"{'kvscope C (one call a step)' if getattr(info, 'decode_backend', '') == 'c' else 'transformers'}"
    )
    with st.container(key="home_placement"):  # pids vary run to run: the Home shot hides this
        for line in ea.placement_lines(th):
            st.caption(line)
    if ea.weight_format_text(info):
        st.caption(
            f"Weights: {ea.weight_format_text(info)}. Each decode step streams every weight once: "
            "reading the GGUF's 4-bit blocks in place of fp32 copies is the lever for batch-1 speed."
        )


def _build_navigation():
    pages = [st.Page(home, title="Home", icon=":material/home:", url_path="home", default=True)]
    objs = {}
    for fname, title, url, icon, _ in PAGES:
        p = st.Page(str(PAGES_DIR / fname), title=title, url_path=url, icon=icon)
        objs[fname] = p
        pages.append(p)
    return pages, objs


st.set_page_config(page_title="kvscope", page_icon=":material/memory:", layout="wide")
_pages, _page_objects = _build_navigation()
_nav = st.navigation(_pages, expanded=True)  # every page listed (past 10 Streamlit folds them)
ea.settings_sidebar()
_nav.run()
