"""Input rules in one home: the chat template -> token ids, the prompt checks (text and token
ids -> `prompt_ids`), the admission limits (`admission_check`) and the default completion length
(`completion_room`).

Every caller (LLMEngine, LLM, EngineThread, the serve routes, preview, the workload prompt sets)
applies the chat template through `chat_ids` and checks prompts here; LLMEngine.admission_check /
max_completion_tokens call the last two on the engine's live pool. Pure Python: no torch."""

from __future__ import annotations

MAX_PROMPT_CHARS = 1_000_000


def check_request_fields(request_id, in_use, reserved_suffix: str, origin, prompt_text) -> None:
    """add_request's own fields: a fresh request id (not in `in_use`, not ending in
    `reserved_suffix`, the draft caches' ids), who submitted it (`origin`) and the text shown for
    it (`prompt_text`, or None)."""
    if not isinstance(request_id, str) or not request_id or len(request_id) > 128:
        raise ValueError("request_id must be a non-empty string of at most 128 characters")
    if request_id in in_use:
        raise ValueError(f"request_id {request_id!r} is already in use")
    if request_id.endswith(reserved_suffix):
        raise ValueError(f"request_id must not end with {reserved_suffix!r} (reserved for draft-model caches)")
    if not isinstance(origin, str) or not origin or len(origin) > 32:
        raise ValueError("origin must be a non-empty string of at most 32 characters")
    if prompt_text is not None and not isinstance(prompt_text, str):
        raise ValueError("prompt_text must be a string (or None)")


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


def text_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """A text prompt's token ids (no special tokens added), after the prompt-text checks."""
    if not prompt:
        raise ValueError("prompt must not be empty")
    check_prompt_length(prompt)
    check_unicode(prompt)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    if not ids:
        raise ValueError("prompt must not be empty (it tokenizes to no tokens)")
    return list(ids)


def prompt_ids(tokenizer, vocab_size: int, prompt) -> tuple[list[int], str]:
    """(token ids, prompt text) of a prompt given as text or as token ids (checked against the
    vocabulary; their text is ""). ValueError naming what is wrong."""
    if isinstance(prompt, str):
        return text_prompt_ids(tokenizer, prompt), prompt
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            raise ValueError("prompt must not be empty (got an empty token id list)")
        for t in prompt:
            if not isinstance(t, int) or isinstance(t, bool):
                raise ValueError(f"prompt token ids must be integers, got {type(t).__name__}")
            if not 0 <= t < vocab_size:
                raise ValueError(f"prompt token id {t} is outside the vocabulary [0, {vocab_size})")
        return list(prompt), ""
    raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")


# ---------------------------------------------------------------- admission limits


def admission_check(config, vocab_size: int, num_blocks: int, whole_request_blocks, ids: list[int], params):
    """The checks a prompt of token ids must pass to be accepted at all (tier, max_model_len,
    tier context cap, stop ids, logit_bias ids, whole pool of `num_blocks`; `whole_request_blocks(n)`
    is the blocks n tokens take, Scheduler.blocks_for_whole_request); raises ValueError naming
    the limit. Returns the request's TierConfig (or None). Reads only."""
    cfg = config
    tier_name = params.tier or cfg.default_tier
    tier = None
    if tier_name is not None:
        if tier_name not in cfg.tiers:
            raise ValueError(f"tier {tier_name!r} is not configured (known: {sorted(cfg.tiers)})")
        tier = cfg.tiers[tier_name]
    if len(ids) >= cfg.max_model_len:
        raise ValueError(
            f"prompt is {len(ids)} tokens; max_model_len is {cfg.max_model_len} "
            f"(prompt + at least 1 generated token must fit)"
        )
    if tier is not None and len(ids) + params.max_tokens > tier.max_context:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context cap of "
            f"tier {tier.name!r}: {tier.max_context} tokens"
        )
    if len(ids) + params.max_tokens > cfg.max_model_len:  # vLLM's wording
        raise ValueError(
            f"This model's maximum context length is {cfg.max_model_len} tokens. However, you "
            f"requested {len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, "
            f"{params.max_tokens} in the completion). Please reduce the length of the prompt "
            f"or max_tokens (at most {cfg.max_model_len - len(ids)} here)."
        )
    if params.stop_token_ids and any(t >= vocab_size for t in params.stop_token_ids):
        raise ValueError(f"stop_token_ids must be < vocab size {vocab_size}")
    if params.logit_bias and any(t >= vocab_size for t in params.logit_bias):
        bad = next(t for t in params.logit_bias if t >= vocab_size)
        raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab_size})")
    worst = min(len(ids) + params.max_tokens, cfg.max_model_len)
    need = whole_request_blocks(worst)
    if cfg.allocator == "paged" and need > num_blocks:
        raise ValueError(
            f"request needs up to {need} KV blocks ({worst} tokens) but the pool has "
            f"{num_blocks}; lower max_tokens or raise the KV budget"
        )
    return tier


def completion_room(config, num_blocks: int, prompt_len: int, tier_name: str | None = None) -> int:
    """The completion length a request that names none gets (vLLM's default: the rest of the
    context): what max_model_len, the pool (num_blocks * block_size tokens) and the tier's
    context cap leave after the prompt; at least 1."""
    room = min(config.max_model_len, num_blocks * config.block_size) - prompt_len
    t = config.tiers.get(tier_name or config.default_tier or "")
    if t is not None:
        room = min(room, t.max_context - prompt_len)
    return max(1, room)
