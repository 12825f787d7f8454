"""engine.core.inputs: the one home of the chat-template rule, the prompt checks, the admission limits
and the default completion length (the messages of every rejection: tests/engine/test_bad_input.py)."""

import pytest

from engine.config import EngineConfig, SamplingParams, TierConfig
from engine.core.inputs import (
    MAX_PROMPT_CHARS,
    admission_check,
    as_ids,
    chat_ids,
    check_prompt_length,
    check_unicode,
    completion_room,
    prompt_ids,
    text_prompt_ids,
)


class _Tok:
    def __init__(self, out):
        self.out, self.calls = out, []

    def apply_chat_template(self, msgs, **kw):
        self.calls.append((msgs, kw))
        return self.out


def test_as_ids_accepts_list_dict_and_batch_of_one():
    assert as_ids([1, 2, 3]) == [1, 2, 3]
    assert as_ids({"input_ids": [4, 5]}) == [4, 5]
    assert as_ids([[6, 7]]) == [6, 7]


def test_chat_ids_passes_generation_prompt_and_tools():
    tok = _Tok({"input_ids": [9, 8]})
    msgs = [{"role": "user", "content": "hi"}]
    assert chat_ids(tok, msgs) == [9, 8]
    assert tok.calls[-1] == (msgs, {"add_generation_prompt": True, "tokenize": True})
    tools = [{"type": "function", "function": {"name": "f"}}]
    chat_ids(tok, msgs, tools=tools, add_generation_prompt=False)
    assert tok.calls[-1][1] == {"add_generation_prompt": False, "tokenize": True, "tools": tools}


def test_prompt_checks_name_the_limit():
    check_prompt_length("x" * MAX_PROMPT_CHARS)
    with pytest.raises(ValueError, match="limit is 1000000"):
        check_prompt_length("x" * (MAX_PROMPT_CHARS + 1))
    with pytest.raises(ValueError, match="lone surrogate at character 1"):
        check_unicode("a\ud800")


class _Enc:
    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return [ord(c) for c in text.strip()]


def test_prompt_ids_text_and_token_ids():
    assert prompt_ids(_Enc(), 200, "ab") == ([97, 98], "ab")
    assert prompt_ids(_Enc(), 200, (3, 4)) == ([3, 4], "")
    with pytest.raises(ValueError, match="tokenizes to no tokens"):
        text_prompt_ids(_Enc(), "   ")
    with pytest.raises(ValueError, match=r"token id 200 is outside the vocabulary \[0, 200\)"):
        prompt_ids(_Enc(), 200, [1, 200])
    with pytest.raises(ValueError, match="must be integers, got bool"):
        prompt_ids(_Enc(), 200, [True])


CFG = EngineConfig(model="tiny", block_size=4, max_model_len=64, tiers={"small": TierConfig("small", 20, 0)})


def test_completion_room_is_what_context_pool_and_tier_leave():
    assert completion_room(CFG, 100, 10) == 54  # max_model_len 64
    assert completion_room(CFG, 5, 10) == 10  # a 20-token pool
    assert completion_room(CFG, 100, 10, "small") == 10  # the tier's 20-token context
    assert completion_room(CFG, 100, 70) == 1  # never below one token
    assert completion_room(CFG, 100, 10, "unknown") == 54  # admission rejects unknown tiers


def test_admission_accepts_exactly_the_completion_room():
    """The default length is always admissible: completion_room's bounds are admission's."""
    for num_blocks, tier in ((100, None), (5, None), (100, "small")):
        room = completion_room(CFG, num_blocks, 10, tier)
        params = SamplingParams(max_tokens=room, tier=tier)
        blocks = lambda n: -(-n // 4)  # noqa: E731
        assert admission_check(CFG, 500, num_blocks, blocks, [1] * 10, params) == CFG.tiers.get(tier or "")
        with pytest.raises(ValueError):
            admission_check(CFG, 500, num_blocks, blocks, [1] * 10, SamplingParams(max_tokens=room + 1, tier=tier))
