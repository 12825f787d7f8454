"""Input rules in one home: the chat template -> token ids, and the prompt-text checks.

Every caller (LLMEngine, EngineThread, the serve routes, preview, the workload prompt sets) applies the
chat template through `chat_ids` and checks prompt text through `check_prompt_text`."""

from __future__ import annotations

MAX_PROMPT_CHARS = 1_000_000


def as_ids(out) -> list[int]:
    """The token ids of whatever `tokenizer.apply_chat_template(..., tokenize=True)` returned
    (a list, a BatchEncoding/dict with input_ids, or a batch of one)."""
    if hasattr(out, "keys") and "input_ids" in out.keys():
        out = out["input_ids"]
    if out and isinstance(out[0], (list, tuple)):
        out = out[0]
    return list(out)


def chat_ids(
    tokenizer, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of `messages` (role/content dicts, optionally tool_calls / tool_call_id) with the
    tokenizer's chat template applied. ValueError when the template produces nothing."""
    kw = {"tools": tools} if tools else {}
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kw)
    ids = [int(t) for t in as_ids(out)]
    if not ids:
        raise ValueError("messages: the chat template produced no tokens")
    return ids


def check_unicode(text: str) -> None:
    """Lone surrogates (possible in Python/JSON strings) make the tokenizer raise TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"prompt is not valid Unicode text (a lone surrogate at character {e.start})") from None


def check_prompt_length(text: str, field: str = "prompt") -> None:
    """The prompt-length limit: at most MAX_PROMPT_CHARS characters."""
    if len(text) > MAX_PROMPT_CHARS:
        raise ValueError(f"{field} is {len(text)} characters; the limit is {MAX_PROMPT_CHARS}")
