"""engine.inputs: the one home of the chat-template rule and the prompt-text checks."""

import pytest

from engine.inputs import MAX_PROMPT_CHARS, as_ids, chat_ids, check_prompt_length, check_unicode


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
