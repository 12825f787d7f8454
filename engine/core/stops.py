"""Stop-string matching on the detokenized output (one home for the rule; engine.py calls it)."""

from __future__ import annotations

TAIL_CHARS = 64  # only the text a step can have added is searched (plus the longest stop string)


def find_stop_string(text: str, stops: list[str], include: bool) -> tuple[str, str] | None:
    """The first of `stops` (in the request's order) found in the tail of `text`: (the text cut
    before it, or after it when `include` is true as vLLM's include_stop_str_in_output, the stop
    string), or None."""
    tail_from = max(0, len(text) - TAIL_CHARS - max(len(s) for s in stops))
    for s in stops:
        i = text.find(s, tail_from)
        if i >= 0:
            return (text[: i + len(s)] if include else text[:i]), s
    return None
