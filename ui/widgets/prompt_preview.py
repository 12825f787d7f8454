"""The as-you-type prompt fields and the preview panel they drive (its content is
ui/figures/preview.py). The fields are streamlit-keyup's: the value reaches Python on every
keystroke, debounced, with no Enter and no form."""

from __future__ import annotations

import streamlit as st
from st_keyup import st_keyup

from engine.core.preview import PromptPreview
from ui.figures import preview as P
from ui.widgets import room

DEBOUNCE_MS = 120  # value sent this long after the last keystroke (≤ 150 ms)


def render(pv: PromptPreview, previous: tuple[int, ...] | None = None) -> None:
    """Draw the preview panel."""
    label, kind = P.VERDICTS.get(pv.verdict, (pv.verdict, "info"))
    with st.container(key="kvscope_preview", border=True):
        if pv.num_tokens == 0:
            st.caption("Preview: type a prompt to see its tokens, blocks and prefix-cache hits.")
            return
        st.markdown("  \n".join(P.summary_lines(pv, previous)))
        getattr(st, kind)(f"{label}: {pv.reason}")
        st.html(P.preview_html(pv, previous))


def typed(prefix: str) -> tuple[str, str]:
    """(system prompt, prompt) as last typed in the fields drawn by prompt_with_preview."""
    ss = st.session_state
    return (ss.get(f"{prefix}_system") or "").strip(), ss.get(f"{prefix}_prompt") or ""


def prompt_with_preview(th, prefix: str, params, *, default: str = "", system_default: str = "") -> None:
    """System prompt and prompt fields that send every keystroke (debounced), and the preview
    panel under them. Runs as a fragment: a keystroke reruns only this part of the page."""

    @st.fragment
    def _fields():
        st_keyup(
            "System prompt (optional; shared prefixes are where the prefix cache helps)",
            value=system_default,
            key=f"{prefix}_system",
            debounce=DEBOUNCE_MS,
            max_chars=20000,
            placeholder="e.g. You are the release-freeze assistant…",
        )
        st_keyup("Prompt", value=default, key=f"{prefix}_prompt", debounce=DEBOUNCE_MS, max_chars=20000)
        system, user = typed(prefix)
        try:
            pv = th.preview(user, params, system=system or None)
        except ValueError as e:
            st.error(f"Preview: {e}")
            return
        except Exception as e:  # noqa: BLE001 - an engine being rebuilt must not break typing
            st.warning(f"Preview unavailable right now: {type(e).__name__}: {e}")
            return
        render(pv, st.session_state.get(f"{prefix}_last_ids"))

    _fields()


def submit_typed(th, prefix: str, params):
    """Submit what was typed, exactly as previewed (same token ids), as this session's request
    (ui/widgets/room.py). Raises ValueError if rejected."""
    system, user = typed(prefix)
    if not user.strip():
        raise ValueError("prompt must be a non-empty string")
    if system:
        pv = th.preview(user, params, system=system)
        h = room.submit(th, list(pv.token_ids), params)
        ids = pv.token_ids
    else:
        h = room.submit(th, user, params, chat=True)
        ids = tuple(th.preview(user, params).token_ids)
    st.session_state[f"{prefix}_last_ids"] = tuple(ids)
    return h
