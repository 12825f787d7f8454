"""Sidebar inputs for the scheduler's limits people expect to set: which request is preempted
first (victim policy), each tier's context cap, and the tier requests get by default.
Drawn inside engine_access.settings_sidebar's form; returns EngineConfig.replace keyword args."""

from __future__ import annotations

import streamlit as st

from engine.config import VICTIM_POLICIES, TierConfig

POLICY_HELP = {
    "last_admitted": "lowest-priority tier first, then the most recently admitted (vLLM's default)",
    "lru": "the running request scheduled longest ago",
}
NO_TIER = "(none: no tier cap)"


def limit_inputs(cfg) -> dict:
    """Victim policy, per-tier context caps and default tier, as EngineConfig.replace kwargs."""
    policy = st.selectbox(
        "Preemption victim policy",
        VICTIM_POLICIES,
        index=VICTIM_POLICIES.index(cfg.victim_policy) if cfg.victim_policy in VICTIM_POLICIES else 0,
        help="; ".join(f"{k}: {v}" for k, v in POLICY_HELP.items()),
        key="sb_victim_policy",
    )
    with st.expander("Tier caps (prompt + max tokens per request)"):
        tiers = {}
        for name, t in cfg.tiers.items():
            cap = st.number_input(
                f"{name} (priority {t.priority})",
                min_value=1,
                max_value=1_048_576,
                value=int(t.max_context),
                step=256,
                key=f"sb_tier_{name}",
            )
            tiers[name] = TierConfig(name, max_context=int(cap), priority=t.priority)
        names = [NO_TIER] + list(cfg.tiers)
        default = st.selectbox(
            "Tier of requests that name none",
            names,
            index=names.index(cfg.default_tier) if cfg.default_tier in names else 0,
            key="sb_default_tier",
            help="Requests without a tier get this one's cap and priority; with none, only max_model_len limits them.",
        )
    return dict(victim_policy=policy, tiers=tiers, default_tier=None if default == NO_TIER else default)
