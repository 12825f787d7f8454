"""Memory calculator: KV-cache bytes per token / per sequence, total memory and how many sequences
fit, for any model config. Stands alone (needs no running engine); when the app has loaded a model
it offers that model's shape too, read from ``st.session_state["engine_info"]``."""

import sys
from pathlib import Path

# AppTest (and `streamlit run pages/memory_calculator.py`) put only this folder on sys.path.
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import json  # noqa: E402

import streamlit as st  # noqa: E402

from engine.lab import bench_results as BR  # noqa: E402
from engine.lab import memory_math as mm  # noqa: E402
from ui.figures import memory_calc as mc  # noqa: E402
from ui.figures import presets  # noqa: E402
from ui.widgets import engine_access as ea  # noqa: E402
from ui.widgets import shell  # noqa: E402

shell.enter_app()

PLOT_CONFIG = {"displayModeBar": False}
DTYPES = ("fp32", "bf16", "fp16", "fp8", "int8")  # weights
KV_DTYPES = mc.KV_DTYPES  # every pool format the engine offers (engine/config.py KV_CACHE_DTYPES)
SRC_PRESET, SRC_LOADED, SRC_JSON = "Preset", "The loaded model", "Paste config.json"
AS_CONFIGURED = "as configured"

st.title("Memory calculator")
st.markdown(
    "Every token a model has seen keeps its keys and values in the **KV cache** of every layer, "
    "so the cache grows with context length and with the number of sequences served at once — "
    "and it is usually what runs out first, not compute. Pick a model shape, a number format "
    "and a workload to see the bytes, the formula with its numbers, and how many sequences fit."
)

# ------------------------------------------------------------------ model source
engine_info = st.session_state.get("engine_info")
sources = ([SRC_LOADED] if engine_info is not None else []) + [SRC_PRESET, SRC_JSON]
source = st.radio("Model config from", sources, horizontal=True, key="mc_source")

cfg, given_params, label = None, None, ""
if source == SRC_PRESET:
    name = st.selectbox(
        "Preset", list(presets.PRESETS), index=list(presets.PRESETS).index("Llama-3-8B"), key="mc_preset"
    )
    cfg, given_params, label = presets.preset(name), presets.PRESET_PARAM_COUNTS.get(name), name
elif source == SRC_LOADED:
    try:
        cfg = mc.config_from_engine_info(engine_info)
        model = engine_info.get("model") if isinstance(engine_info, dict) else getattr(engine_info, "model", "")
        label = f"loaded model ({model})" if model else "loaded model"
    except ValueError as e:
        st.error(f"The loaded model's shape could not be read: {e}")
        st.stop()
else:
    text = st.text_area(
        "config.json",
        value=json.dumps(presets.PRESETS["SmolLM2-135M"], indent=2),
        height=260,
        key="mc_json",
        help="Paste a Hugging Face config.json. Needed: number of layers, attention "
        "heads, KV heads (if any) and head_dim or hidden_size; MLA configs need "
        "kv_lora_rank and qk_rope_head_dim.",
    )
    try:
        cfg = mm.parse_config_json(text)
        label = "pasted config"
    except ValueError as e:
        st.error(f"Cannot use this config: {e}")
        st.stop()

# ------------------------------------------------------------------ settings
spec = mm.kv_spec(cfg)
c1, c2, c3 = st.columns(3)
with c1:
    kind_choice = st.selectbox(
        "Attention kind",
        [AS_CONFIGURED, "MHA", "GQA", "MQA"],
        key="mc_kind",
        help="Re-run the sum as if the model used another attention layout (same layers, heads and head sizes).",
    )
    gqa_heads = None
    if kind_choice == "GQA" and spec.num_heads:
        divisors = [d for d in range(2, spec.num_heads) if spec.num_heads % d == 0]
        if divisors:
            default = (
                spec.num_kv_heads
                if spec.kind == "GQA" and spec.num_kv_heads in divisors
                else max((d for d in divisors if d <= 8), default=divisors[0])
            )
            gqa_heads = st.selectbox(
                "KV heads (GQA groups)", divisors, index=divisors.index(default), key="mc_gqa_heads"
            )
    dtype = st.selectbox(
        "KV cache dtype",
        KV_DTYPES,
        index=KV_DTYPES.index("bf16"),
        key="mc_dtype",
        help="fp8 and int8 count one float32 scale per (token, KV head) row, int4 and int2 (2 and 4 "
        "numbers per byte) one per 32 numbers of the row, as kvscope stores them.",
    )
    measured = mc.kvquant_caption(BR.committed_kvquant(), dtype)  # `bench kvquant`'s committed JSON
    if measured:
        st.caption(measured)
with c2:
    context_len = int(
        st.number_input(
            "Context length (tokens per sequence)",
            min_value=1,
            max_value=10_485_760,
            value=4096,
            step=1024,
            key="mc_context",
        )
    )
    concurrency = int(
        st.number_input("Concurrent sequences", min_value=1, max_value=100_000, value=1, step=1, key="mc_concurrency")
    )
with c3:
    gpu_gib = float(
        st.number_input("GPU memory (GiB)", min_value=0.0, max_value=100_000.0, value=80.0, step=8.0, key="mc_gpu_gib")
    )
    include_weights = st.checkbox("Include model weights", value=True, key="mc_weights")
    weights_dtype = st.selectbox(
        "Weights dtype", DTYPES, index=DTYPES.index("bf16"), key="mc_weights_dtype", disabled=not include_weights
    )
    params_b = float(
        st.number_input(
            "Parameter count override (billions; 0 = from the config)",
            min_value=0.0,
            max_value=100_000.0,
            value=0.0,
            step=1.0,
            key="mc_params_b",
            disabled=not include_weights,
        )
    )

if source == SRC_LOADED and getattr(engine_info, "weight_bytes_per_step", 0):
    st.caption(
        f"The loaded engine's weights: {ea.weight_format_text(engine_info)} (the bytes each decode step "
        "streams, whatever the dtype chosen above for the memory sum)."
    )

# ------------------------------------------------------------------ numbers
try:
    if kind_choice != AS_CONFIGURED:
        cfg = mm.with_attention_kind(cfg, kind_choice, gqa_heads)
    weights = 0
    weights_note = "weights left out"
    if include_weights:
        override = int(round(params_b * 1e9)) if params_b > 0 else None
        try:
            est = mm.estimate_params(cfg, override or given_params)
            weights = est.total * mm.dtype_bytes(weights_dtype)
            how = (
                "your parameter count"
                if override
                else "published total parameter count"
                if given_params
                else f"{est.method}: {est.note}"
            )
            weights_note = f"{est.total / 1e9:,.2f} billion parameters x {mm.dtype_bytes(weights_dtype)} bytes ({how})"
        except ValueError as e:
            weights_note = f"weights not counted: {e}. Enter a parameter count to include them."
    memory = int(gpu_gib * mm.GiB)
    r = mc.compute(cfg, dtype, context_len, concurrency, memory, weights)
except ValueError as e:
    st.error(f"Cannot compute: {e}")
    st.stop()

unknown_heads = mm.kv_spec(cfg).num_heads is None and r.kind == "GQA"
kind_text = "MHA or GQA (query heads not reported)" if unknown_heads else r.kind
st.subheader(f"{label}: {kind_text}")
st.caption(
    (
        "The byte counts are exact; telling MHA from GQA needs the query head count. "
        if unknown_heads
        else f"{mc.KIND_HELP[r.kind]}. "
    )
    + f"Weights: {weights_note}."
)
m1, m2, m3, m4 = st.columns(4)
m1.metric("KV bytes per token", f"{r.bytes_per_token:,} B", help=mc.format_bytes(r.bytes_per_token))
m2.metric("KV per sequence", mc.format_bytes(r.bytes_per_sequence), help=f"{r.bytes_per_sequence:,} B")
m3.metric("Total needed", mc.format_bytes(r.total), help=f"{r.total:,} B")
m4.metric(
    "Max concurrent",
    f"{r.max_concurrent:,}",
    help=f"sequences of {context_len:,} tokens that fit in {gpu_gib:g} GiB after the weights",
)

verb = "needs" if concurrency == 1 else "need"
need = (
    f"{concurrency:,} sequence{'s' if concurrency > 1 else ''} of {context_len:,} tokens {verb} "
    f"{mc.format_bytes(r.total)} of {mc.format_bytes(memory)}"
)
if r.fits:
    st.success(f"{need}: {'it fits' if concurrency == 1 else 'they fit'}.")
else:
    st.warning(f"{need}: too much; at most {r.max_concurrent:,} fit.")
window = mm.sliding_window(cfg)
if window and context_len > window:
    st.info(
        f"This config declares a sliding window of {window:,} tokens. An engine that exploits it "
        f"keeps only the last {window:,} tokens per layer; the numbers here assume full attention."
    )

st.markdown("**The sum, with this model's numbers**")
st.code("\n".join(r.formula_lines), language=None)
if r.kind == "MLA":
    st.caption(
        "MLA stores one low-rank latent per token and layer and rebuilds per-head keys and "
        "values from it during attention, so there is no separate K and V and no factor 2."
    )

st.plotly_chart(mc.bytes_by_kind_figure(cfg, dtype), config=PLOT_CONFIG, key="mc_fig_kind")
st.plotly_chart(
    mc.memory_vs_context_figure(cfg, dtype, context_len, concurrency, memory, weights),
    config=PLOT_CONFIG,
    key="mc_fig_context",
)
st.plotly_chart(
    mc.max_concurrency_figure(cfg, dtype, context_len, memory, weights), config=PLOT_CONFIG, key="mc_fig_concurrency"
)
st.dataframe(mc.summary_rows(r), hide_index=True, key="mc_table")
st.caption(
    "Sizes use binary units (1 KiB = 1,024 bytes, 1 GiB = 1,024³ bytes). Real servers also "
    "need memory for activations, the CUDA context and allocator slack, and a paged cache "
    "rounds each sequence up to whole blocks."
)
