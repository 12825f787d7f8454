"""The one shared engine per Streamlit server, its settings, and page-wide display helpers.

Every page gets the engine through `get_engine()`: one `EngineThread(LLMEngine(...))` per server
process (`st.cache_resource`), shared by all browser sessions. Settings changed in the sidebar
rebuild it through `EngineThread.reconfigure`, which deals with in-flight requests.

Environment
- KVSCOPE_MODEL: model name for the engine ("default" = embedded SmolLM2-135M; tests use "tiny").
- KVSCOPE_ENGINE_PROCESS (default on): the engine core runs in a process of its own
  (engine/core/client.py's EngineClient, same API as EngineThread), so drawing never competes with
  a step for the GIL; "0" keeps the engine in a thread of this process. With two or more CPUs the
  core is pinned to all but the first and this process (pages, charts, the API) to the first
  (engine/core/placement.py); KVSCOPE_CORE_CPUS="1" (or "2,3") names the core's CPUs instead,
  KVSCOPE_FRONT_CPUS this process's. The core (and the lab process) asks for its own scheduler
  group at nice -10 where the OS allows (KVSCOPE_CORE_NICE; 0 leaves it).
- KVSCOPE_TEST_MODE=1: deterministic settings (CPU, float32, one torch thread, seed 0, a small
  pool) and static Plotly charts with fixed heights, no live polling, so screenshots are exact;
  every difference is a field of ui/widgets/mode.py's Mode.
"""

from __future__ import annotations

import os
import threading

import streamlit as st

from engine.config import KV_CACHE_DTYPES, SPEC_METHODS, WEIGHT_FORMATS, EngineConfig, SpeculativeConfig
from engine.model.device import detect_devices
from ui.widgets import mode, sidebar_limits

BLOCK_SIZES = (4, 8, 16, 32)
SPEC_CHOICES = ("off",) + SPEC_METHODS


def model_name() -> str:
    return os.environ.get("KVSCOPE_MODEL", "default").strip() or "default"


def default_config() -> EngineConfig:
    """The engine a fresh server starts with (test mode: a small deterministic one, Mode.engine)."""
    return EngineConfig(model=model_name(), **mode.current().engine)


def plotly_config() -> dict:
    """The Plotly config every chart uses: static in test mode (no hover, no mode bar, no
    resize), interactive otherwise."""
    if mode.current().static_charts:
        return {"staticPlot": True, "displayModeBar": False, "responsive": False}
    return {"displaylogo": False, "displayModeBar": "hover", "responsive": True}


def chart(fig, *, key: str | None = None) -> None:
    """Draw a Plotly figure with the shared config. Heights are fixed by the figure builders."""
    if mode.current().static_charts:
        fig.update_layout(hovermode=False)
    st.plotly_chart(fig, config=plotly_config(), width="stretch", key=key, theme=None)


# --------------------------------------------------------------------------- the shared engine


class SharedEngine:
    """Holds the server's EngineThread. Building it can fail (bad model, too little memory):
    the error is kept and shown on every page instead of a traceback."""

    def __init__(self):
        self.lock = threading.RLock()
        self.thread = None
        self.build_error: str | None = None
        self.last_message: str | None = None
        self.generation = 0  # bumps on every (re)build, so sessions can notice
        self.front: dict | None = None  # where this process was placed (process mode)

    def get(self):
        with self.lock:
            if self.thread is None and self.build_error is None:
                self._build(default_config())
            return self.thread

    def _build(self, config: EngineConfig) -> None:
        from engine import EngineThread, LLMEngine
        from engine.core import placement
        from engine.core.client import EngineClient, process_enabled

        try:
            if process_enabled():
                where = placement.plan()
                self.thread = EngineClient(config, cpus=where.core)
                self.front = placement.tell_front_end(where.front)
            else:
                self.thread = EngineThread(LLMEngine(config))
            self.build_error = None
            self.generation += 1
        except Exception as e:  # noqa: BLE001 - shown in the app; the server keeps running
            self.thread = None
            self.build_error = f"{type(e).__name__}: {e}"

    def reconfigure(self, config: EngineConfig) -> str:
        with self.lock:
            th = self.thread
            if th is None:
                self.build_error = None
                self._build(config)
                if self.thread is None:
                    raise ValueError(self.build_error)
                msg = "Engine built with the new settings."
            else:
                try:
                    result = th.reconfigure(config)  # builds first: on failure the old engine keeps serving
                except ValueError:
                    raise
                except Exception as e:  # noqa: BLE001 - e.g. a draft model that cannot be loaded
                    raise ValueError(f"{type(e).__name__}: {e}") from None
                self.generation += 1
                msg = (
                    f"Shared engine rebuilt with the new settings ({result})."
                    if result
                    else "Shared engine rebuilt with the new settings."
                )
            self.last_message = msg
            return msg

    def retry(self) -> None:
        with self.lock:
            if self.thread is None:
                self.build_error = None
                self._build(default_config())


@st.cache_resource(show_spinner=False)
def shared_engine() -> SharedEngine:
    return SharedEngine()


def get_engine():
    """The shared EngineThread, or None when it could not be built (error shown by the caller
    via `engine_error()`)."""
    holder = shared_engine()
    if holder.thread is None and holder.build_error is None:
        with st.spinner("Loading the model and allocating the KV pool (first start can take a minute)…"):
            return holder.get()
    return holder.get()


def engine_error() -> str | None:
    return shared_engine().build_error


def engine_config():
    th = get_engine()
    if th is None:
        return default_config()
    cfg = th.config
    return cfg if isinstance(cfg, EngineConfig) else default_config()


def snapshot():
    th = get_engine()
    return None if th is None else th.snapshot()


def require_engine():
    """The engine thread for a page, or stop the page with a clear message."""
    th = get_engine()
    if th is None:
        st.error(f"The engine could not be started: {engine_error()}")
        if st.button("Try again", key="retry_engine"):
            shared_engine().retry()
            st.rerun()
        st.stop()
    if not th.healthy:
        st.error(f"The engine loop crashed: {th.error}. Restart it from the Home page or here.")
        if st.button(restart_label(th), key="restart_engine_page"):
            th.restart()
            st.rerun()
        st.stop()
    return th


def restart_label(th) -> str:
    """The restart button's words: a new core process, or a new in-thread loop."""
    return "Start a new engine core" if hasattr(th, "placement_now") else "Restart engine"


def current_snapshot(th):
    """The snapshot a page draws: the loop's latest published one (cheap, at most ~50 ms old),
    or in test mode a fresh one taken between steps, so a finished request always shows its
    final state."""
    return th.snapshot_now() if mode.current().fresh_snapshots else th.snapshot()


# --------------------------------------------------------------------------- sidebar settings


def spec_config(method: str, k: int, *, mismatched: bool = False, num_layers: int | None = None):
    """SpeculativeConfig for a UI choice. "mismatched" = a deliberately poor drafter: the target
    itself exited after its first ~1/8 of layers (kvscope's "Break it"). In test mode the
    acceptance-monitoring fallback is off: it acts on measured wall-clock costs, which would make
    the token strip differ from run to run."""
    fb = dict(enable_fallback=mode.current().spec_fallback)
    if mismatched:
        layers = max(1, (num_layers or 8) // 8)
        return SpeculativeConfig(method="self_draft", num_speculative_tokens=k, draft_layers=layers, **fb)
    if method == "off":
        return None
    if method == "self_draft":
        return SpeculativeConfig(method="self_draft", num_speculative_tokens=k, draft_quantize="int8", **fb)
    return SpeculativeConfig(method=method, num_speculative_tokens=k, **fb)


WEIGHT_FORMAT_CHOICES = WEIGHT_FORMATS  # engine/config.py
WEIGHT_FORMAT_LABELS = {
    "auto": "auto (GGUF blocks where the model has them)",
    "gguf": "GGUF blocks (Q4_1 / Q8_0)",
    "fp32": "fp32 (de-quantized copies)",
    "bf16": "bf16 (weights that are exactly bf16)",
    "fp16": "fp16 (weights that are exactly fp16)",
}


def weight_format_text(info) -> str:
    """'GGUF blocks · 96.6 MB read per step' for an EngineInfo (older snapshots: '')."""
    fmt = getattr(info, "weight_format", None)
    nbytes = getattr(info, "weight_bytes_per_step", 0)
    if not fmt or not nbytes:
        return ""
    name = {
        "gguf": "GGUF quantized blocks",
        "fp32": "fp32 copies",
        "torch": "fp32 (transformers' F.linear)",
        "bf16": "bf16 values widened exactly",
        "fp16": "fp16 values widened exactly",
    }
    return f"{name.get(fmt, fmt)} · {nbytes / 1e6:,.1f} MB of weights read per step"


def settings_sidebar() -> None:
    """Engine settings that rebuild the shared engine on Apply."""
    cfg = engine_config()
    snap = snapshot()
    info = snap.info if snap is not None else None
    sb = st.sidebar
    from ui.widgets import room

    room.operator_sidebar()
    sb.subheader("Engine settings")
    sb.caption("Shared by everyone using this server. Apply rebuilds the engine.")
    with sb.form("engine_settings", border=False):
        bs = st.selectbox(
            "Block size (tokens per KV block)",
            BLOCK_SIZES,
            index=BLOCK_SIZES.index(cfg.block_size) if cfg.block_size in BLOCK_SIZES else 2,
        )
        cur_blocks = info.num_blocks if info else (cfg.num_kv_blocks or 256)
        blocks = st.number_input(
            "KV budget (blocks in the pool)", min_value=1, max_value=1_000_000, value=int(cur_blocks), step=8
        )
        if info:
            st.caption(
                f"{info.bytes_per_token:,} bytes per token → "
                f"{blocks * bs * info.bytes_per_token / 2**20:,.1f} MiB at block size {bs}"
            )
        kv_dtype = st.selectbox(
            "KV cache dtype",
            KV_CACHE_DTYPES,
            index=KV_CACHE_DTYPES.index(cfg.kv_cache_dtype),
            help="What the pool stores per number: auto = the model's dtype; fp8_e4m3 and "
            "int8 add a float32 scale per (token, KV head); int4 and int2 pack 2 and 4 numbers per "
            "byte with a float32 scale per 32 numbers. Quantized caches are not "
            "token-exact: the Memory calculator shows their measured agreement.",
        )
        seqs = st.number_input("Max concurrent sequences", min_value=1, max_value=4096, value=int(cfg.max_num_seqs))
        prefix = st.toggle("Prefix caching", value=bool(cfg.enable_prefix_caching))
        pre = st.radio(
            "Preemption mode",
            ("recompute", "swap"),
            horizontal=True,
            index=0 if cfg.preemption_mode == "recompute" else 1,
        )
        limits = sidebar_limits.limit_inputs(cfg)
        cur_method = cfg.speculative.method if cfg.speculative else "off"
        method = st.selectbox("Speculative decoding", SPEC_CHOICES, index=SPEC_CHOICES.index(cur_method))
        k = st.slider("Draft length k", 1, 16, value=cfg.speculative.num_speculative_tokens if cfg.speculative else 4)
        devices = detect_devices()
        device = cfg.device
        if len(devices) > 1:  # a GPU is present: offer it and the CPU ("auto" is the first one)
            cur = cfg.device if cfg.device in devices else devices[0]
            device = st.selectbox("Device", devices, index=devices.index(cur))
        wf = st.selectbox(
            "Weight format",
            WEIGHT_FORMAT_CHOICES,
            index=WEIGHT_FORMAT_CHOICES.index(cfg.weight_format),
            format_func=WEIGHT_FORMAT_LABELS.get,
            help="What the CPU Linear layers read each step. gguf: the model file's own "
            "quantized blocks (Q4_1 / Q8_0), computed on in registers — outputs those "
            "of the de-quantized weights (bitwise, or within fp32 rounding where AVX-512 "
            "sums each block factorized); fp32: de-quantized copies.",
        )
        st.caption(room.rebuild_warning(snap))
        confirm = st.checkbox(
            "Rebuild the shared engine, aborting the requests above", value=False, key="confirm_rebuild"
        )
        apply = st.form_submit_button("Apply", type="primary", disabled=not room.is_operator())
    if apply:
        if not confirm:
            sb.warning("Tick the confirmation box to rebuild the shared engine.")
            return
        if not room.is_operator():
            sb.warning("Rebuilding the shared engine needs the operator token.")
            return
        try:
            new = cfg.replace(
                device=device,
                block_size=int(bs),
                num_kv_blocks=int(blocks),
                kv_cache_bytes=None,
                kv_cache_dtype=kv_dtype,
                max_num_seqs=int(seqs),
                enable_prefix_caching=bool(prefix),
                preemption_mode=pre,
                weight_format=wf,
                speculative=spec_config(method, int(k), num_layers=info.num_layers if info else None),
                **limits,
            )
            st.session_state["engine_message"] = ("success", shared_engine().reconfigure(new))
        except ValueError as e:
            st.session_state["engine_message"] = ("error", f"Settings not applied: {e}")
        except Exception as e:  # a failed rebuild must not take the page down
            st.session_state["engine_message"] = ("error", f"Rebuild failed: {type(e).__name__}: {e}")
        st.rerun()
    msg = st.session_state.pop("engine_message", None)
    if msg:
        (sb.success if msg[0] == "success" else sb.error)(msg[1])


def _cpus_text(cpus) -> str:
    if not cpus:
        return "any CPU"
    cpus = sorted(cpus)
    if cpus == list(range(cpus[0], cpus[-1] + 1)) and len(cpus) > 1:
        return f"CPUs {cpus[0]}–{cpus[-1]}"
    return ("CPU " if len(cpus) == 1 else "CPUs ") + ", ".join(map(str, cpus))


def _priority_text(d: dict) -> str:
    nice, group = d.get("nice"), d.get("autogroup")
    if nice is None:
        return "priority not readable"
    where = f", scheduler group {group.split()[0]}" if group else ""
    if nice < 0:
        return f"nice {nice}{where}: ahead of the front end and a browser on the same CPUs"
    return f"nice {nice}{where} (a lower nice value needs CAP_SYS_NICE here; KVSCOPE_CORE_NICE)"


def placement_lines(th) -> list[str]:
    """Where the engine's step loop and the front end (pages, charts, the API) run, for Home:
    pids, CPUs and threads read from the OS now."""
    from engine.core import placement as P

    front = P.describe()
    fe = (
        f"Front end (pages, charts, the API): pid {front['pid']}, {_cpus_text(front['cpus'])}, "
        f"{front['os_threads']} OS threads, {front['torch_threads'] or 'no'} torch thread(s)"
    )
    if hasattr(th, "placement_now"):
        core = th.placement_now()
        return [
            f"Engine core: a process of its own, pid {core.get('pid')}, {_cpus_text(core.get('cpus'))}, "
            f"{core.get('os_threads')} OS threads, {core.get('torch_threads') or 'no'} torch thread(s), "
            f"{_priority_text(core)} (KVSCOPE_ENGINE_PROCESS=0 runs it in a thread of the front end).",
            fe + "; drawing never holds the core's interpreter lock.",
        ]
    n = getattr(getattr(th, "engine", None), "cpu_threads", None)
    return [
        f"Engine: a thread of the front end's process, {n or 'GPU'} torch thread(s), sharing its "
        "interpreter with the pages, charts and the API (KVSCOPE_ENGINE_PROCESS=0 is set; unset, the "
        "step loop runs in a process of its own).",
        fe + ".",
    ]
