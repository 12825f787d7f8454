"""The as-you-type prompt preview's content, pure functions of an engine.preview.PromptPreview:
`preview_html`, the prompt's tokens as chips grouped by the KV block each fills, leading blocks
the prefix cache would supply in green, the first block that would be computed marked, and where
the prompt first differs from the previous one; `summary_lines`, its numbers. The fields and the
panel are ui/widgets/prompt_preview.py.
"""

from __future__ import annotations

from engine.core.preview import PromptPreview
from engine.model.kv_layout import cdiv

from .tokens import visible_text

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
    for b in range(0, cdiv(shown, bs)):
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
