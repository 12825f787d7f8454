"""Model inputs from requests: the chat template rule (messages -> token ids) in one place.

`chat_ids` is the one function every caller uses to turn chat messages into prompt ids with the
tokenizer's own chat template (HF `apply_chat_template`, tokenize=True)."""

from __future__ import annotations


def chat_ids(
    tokenizer, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = True
) -> list[int]:
    """messages (role/content dicts, optionally tool_calls / tool_call_id) -> token ids.
    Raises ValueError when the template produces nothing."""
    kwargs = {"add_generation_prompt": add_generation_prompt, "tokenize": True}
    if tools:
        kwargs["tools"] = tools
    out = tokenizer.apply_chat_template(messages, **kwargs)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    ids = [int(t) for t in out]
    if not ids:
        raise ValueError("messages: the chat template produced no tokens")
    return ids
