"""The as-you-type prompt preview: a keystroke text field and the panel it drives.

`prompt_inputs` draws the fields (streamlit-keyup: the value reaches Python on every keystroke,
debounced, with no Enter and no form); `preview_html` is a pure function of an
engine.preview.PromptPreview: the prompt's tokens as chips grouped by the KV block each fills,
leading blocks the prefix cache would supply in green, the first block that would be computed
marked, and where the prompt first differs from the previous one.
"""

from __future__ import annotations

from engine.preview import PromptPreview

from .tokens import visible_text

DEBOUNCE_MS = 120  # value sent this long after the last keystroke (≤ 150 ms)
BLOCK_BG = ("#EEF4FB", "#FDF3E1")  # alternate blocks: pale blue / pale orange
HIT_BG, HIT_BORDER = "#D5F0E6", "#009E73"  # prefix-cache hit blocks (bluish green)
MAX_PREVIEW_TOKENS = 1200  # chips drawn (the counts cover every token)

VERDICTS = {  # verdict -> (label, streamlit alert kind)
    "fits": ("Fits now", "success"),
    "preempt": ("Admitted, may preempt later", "warning"),
    "wait": ("Would wait", "warning"),
    "rejected": ("Would be rejected", "error"),
}


def fmt_bytes(n: int) -> str:
    if n < 1024:
        return f"{n:,} B"
    if n < 2**20:
        return f"{n / 1024:,.1f} KiB"
    return f"{n / 2**20:,.2f} MiB"


def first_difference(a, b) -> int | None:
    """Index of the first token where two id sequences differ (None if one is a prefix of the other
    and they have the same length)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def preview_html(pv: PromptPreview, previous: tuple[int, ...] | None = None) -> str:
    """Token chips grouped by KV block (escaped text), hit blocks marked, and the block where the
    prompt stops matching `previous` (the last prompt previewed or submitted) outlined in red."""
    bs = pv.block_size
    diff = first_difference(pv.token_ids, previous) if previous else None
    diff_block = None if diff is None else diff // bs
    texts = pv.token_texts or tuple(str(t) for t in pv.token_ids)
    parts = []
    shown = min(len(texts), MAX_PREVIEW_TOKENS)
    for b in range(0, (shown + bs - 1) // bs):
        hit = b < pv.hit_blocks
        bg = HIT_BG if hit else BLOCK_BG[b % 2]
        border = f"2px solid {HIT_BORDER}" if hit else "1px solid #B8C4D0"
        if b == diff_block:
            border = "2px dashed #D55E00"
        chips = []
        for i in range(b * bs, min((b + 1) * bs, shown)):
            style = "outline:2px solid #D55E00;" if diff is not None and i == diff else ""
            chips.append(
                f'<span title="token {i}: id {pv.token_ids[i]}" style="{style}padding:0 2px;'
                f'font-family:monospace;white-space:pre">{visible_text(texts[i])}</span>'
            )
        label = f"b{b}" + (" hit" if hit else "")
        parts.append(
            f'<span class="kvscope-preview-block" data-block="{b}" data-hit="{int(hit)}" '
            f'style="display:inline-block;margin:2px 3px 2px 0;padding:1px 3px;background:{bg};'
            f'border:{border};border-radius:4px"><sup style="color:#555;font-size:0.7em">'
            f"{label}</sup>{''.join(chips)}</span>"
        )
    more = ""
    if len(texts) > shown:
        more = f'<span style="color:#555"> … {len(texts) - shown:,} more tokens not drawn</span>'
    return '<div class="kvscope-preview" style="line-height:1.9;font-size:0.85rem">' + "".join(parts) + more + "</div>"


def summary_lines(pv: PromptPreview, previous: tuple[int, ...] | None = None) -> list[str]:
    """The preview's numbers as short markdown lines (all from the PromptPreview)."""
    bs = pv.block_size
    lines = [
        f"**{pv.num_tokens:,} tokens** with the chat template: {pv.content_tokens:,} typed + "
        f"{pv.template_tokens:,} template · {pv.num_blocks:,} block(s) of {bs}"
    ]
    if pv.hit_blocks:
        lines.append(
            f"**Prefix cache:** blocks 0–{pv.hit_blocks - 1} ({pv.hit_tokens:,} tokens) would be hits "
            f"right now; computing starts at block {pv.hit_blocks}"
        )
    else:
        lines.append("**Prefix cache:** no leading block is cached right now (all computed)")
    diff = first_difference(pv.token_ids, previous) if previous else None
    if diff is not None:
        lines.append(
            f"**Edit:** differs from the previous prompt at token {diff} → block {diff // bs}; blocks "
            f"from there on cannot be shared with it"
        )
    lines.append(
        f"**KV needed:** {fmt_bytes(pv.kv_bytes_prompt)} at the prompt's end ({pv.num_tokens:,} × "
        f"{pv.bytes_per_token:,} B) · {fmt_bytes(pv.kv_bytes_worst)} at max tokens "
        f"({pv.worst_tokens:,} tokens, {pv.blocks_worst:,} blocks) · pool at step {pv.step:,}: "
        f"{pv.free_blocks:,} free "
        f"({pv.cached_free_blocks:,} cached-free)"
    )
    return lines


def render(st, pv: PromptPreview, previous: tuple[int, ...] | None = None) -> None:
    """Draw the preview panel with Streamlit module `st`."""
    label, kind = VERDICTS.get(pv.verdict, (pv.verdict, "info"))
    with st.container(key="kvscope_preview", border=True):
        if pv.num_tokens == 0:
            st.caption("Preview: type a prompt to see its tokens, blocks and prefix-cache hits.")
            return
        st.markdown("  \n".join(summary_lines(pv, previous)))
        getattr(st, kind)(f"{label}: {pv.reason}")
        st.html(preview_html(pv, previous))


# --------------------------------------------------------------------------- the fields (Streamlit)


def typed(prefix: str) -> tuple[str, str]:
    """(system prompt, prompt) as last typed in the fields drawn by prompt_with_preview."""
    import streamlit as st

    ss = st.session_state
    return (ss.get(f"{prefix}_system") or "").strip(), ss.get(f"{prefix}_prompt") or ""


def prompt_with_preview(th, prefix: str, params, *, default: str = "", system_default: str = "") -> None:
    """System prompt and prompt fields that send every keystroke (debounced), and the preview
    panel under them. Runs as a fragment: a keystroke reruns only this part of the page."""
    import streamlit as st
    from st_keyup import st_keyup

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
        render(st, pv, st.session_state.get(f"{prefix}_last_ids"))

    _fields()


def submit(th, prefix: str, params):
    """Submit what was typed, exactly as previewed (same token ids), as this session's request
    (ui/room.py). Raises ValueError if rejected."""
    import streamlit as st

    from ui import room

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
