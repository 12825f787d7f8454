"""Tool calling (engine/serve/tools.py): the Hermes-style parser and its streaming form, the tool
definition checks, and the wire: tools rendered by a template that reads them, "required" and a
named tool_choice forcing a valid call through the grammar even with random weights, streamed
tool_calls deltas, the tool round trip in the history, and a 400 for a template without tools."""

import json

import httpx
import jsonschema
import pytest

from engine.serve.protocol import ChatCompletionRequest
from engine.serve.tools import (
    ToolCallStream,
    check_tools,
    forced_format,
    parse_tool_calls,
    resolve_tool_choice,
    template_supports_tools,
)

from .conftest import TOOLS_TEMPLATE

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"utc": {"type": "boolean"}},
            "required": ["utc"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# ------------------------------------------------------------------ parsing
def test_parse_text_around_and_several_calls():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"utc": true}}</tool_call> Done.'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me check.\n\n Done."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "C"}
    assert calls[1]["function"]["arguments"] == '{"utc": true}'
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert calls[0]["id"] != calls[1]["id"]


def test_parse_malformed_json_stays_content():
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    no_name = '<tool_call>{"arguments": {}}</tool_call>'
    good = '<tool_call>{"name": "get_time", "arguments": {"utc": false}}</tool_call>'
    content, calls = parse_tool_calls(f"a {bad} b {no_name} {good}")
    assert content == f"a {bad} b {no_name}"
    assert [c["function"]["name"] for c in calls] == ["get_time"]


def test_parse_only_calls_gives_null_content_and_other_shapes():
    content, calls = parse_tool_calls('\n<tool_call>\n{"name": "f", "parameters": {"x": 1}}\n</tool_call>\n')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    # an unclosed last call at the end of the output still parses; arguments given as a string pass through
    content, calls = parse_tool_calls('ok <tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}')
    assert content == "ok" and calls[0]["function"]["arguments"] == '{"x": 2}'
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    assert parse_tool_calls("<tool_call>not json") == ("<tool_call>not json", [])


@pytest.mark.parametrize("step", [1, 3, 7])
def test_stream_matches_the_whole_parse(step):
    text = 'Hi <tool_call>\n{"name": "get_time", "arguments": {"utc": true}}\n</tool_call> x <tool_call>{"name": "g"}'
    ts, content, calls = ToolCallStream(), "", []
    for end in list(range(step, len(text), step)) + [len(text)]:
        new_text, new_calls = ts.feed(text[:end], final=end == len(text))
        assert "<tool" not in new_text  # a possible call start is never sent as content
        content += new_text
        calls += new_calls
    whole_content, whole_calls = parse_tool_calls(text)
    assert content.strip() == whole_content == "Hi  x"
    assert [i for i, _ in calls] == [0, 1]
    assert [c["function"] for _, c in calls] == [c["function"] for c in whole_calls]


# ------------------------------------------------------------------ definitions and choices
def test_template_detection(server):
    assert not template_supports_tools(server.thread.tokenizer)  # SmolLM2-135M-Instruct's template

    class T:
        chat_template = TOOLS_TEMPLATE

    assert template_supports_tools(T())
    T.chat_template = {"default": "{{ messages }}", "tool_use": "{% if tools %}x{% endif %}"}
    assert template_supports_tools(T())


@pytest.mark.parametrize(
    "tools, field",
    [
        ([{"type": "retrieval", "function": {"name": "f"}}], "tools.0.type"),
        ([{"type": "function"}], "tools.0.function"),
        ([{"type": "function", "function": {"name": "bad name"}}], "tools.0.function.name"),
        ([WEATHER, WEATHER], "tools.1.function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools.0.function.parameters"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            "tools.0.function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}],
            "tools.0.function.parameters",
        ),
        ([{"type": "function", "function": {"name": "f", "description": 5}}], "tools.0.function.description"),
    ],
)
def test_bad_tool_definitions_name_the_field(tools, field):
    with pytest.raises(ValueError, match="^" + field.replace(".", r"\.") + ":"):
        check_tools(tools)


def test_tool_choice_resolution():
    tools = check_tools(TOOLS)
    assert check_tools([{"type": "function", "function": {"name": "f"}}])[0]["function"]["parameters"] == {
        "type": "object",
        "properties": {},
    }
    assert resolve_tool_choice(None, tools) == "auto" and resolve_tool_choice(None, None) is None
    assert resolve_tool_choice("none", tools) == "none" and resolve_tool_choice("none", None) is None
    assert resolve_tool_choice({"type": "function", "function": {"name": "get_time"}}, tools) == "get_time"
    for bad in ("sometimes", {"type": "function", "function": {"name": "nope"}}, {"function": {}}):
        with pytest.raises(ValueError, match="^tool_choice:"):
            resolve_tool_choice(bad, tools)
    with pytest.raises(ValueError, match="^tool_choice: 'required' needs"):
        resolve_tool_choice("required", None)
    assert forced_format(tools, "auto") is None and forced_format(tools, "none") is None
    assert forced_format(tools, "get_time")["type"] == "lark"


def test_history_tool_call_arguments_reach_the_template_as_a_mapping():
    req = ChatCompletionRequest(
        messages=[
            *ASK,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    },
                    {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "not json"}},
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
    )
    calls = req.chat_messages()[1]["tool_calls"]
    assert calls[0]["function"]["arguments"] == {"city": "Paris"}  # vLLM's rule: templates `tojson` them
    assert calls[1]["function"]["arguments"] == "not json"


# ------------------------------------------------------------------ the wire
@pytest.fixture(scope="module")
def client(tools_server):  # this module talks to the tools server
    return tools_server.openai()


@pytest.fixture(scope="module")
def http(tools_server):
    with tools_server.http() as c:
        yield c


def _valid_call(call, names=("get_weather", "get_time")):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_tool_choice_forces_a_valid_call(client):
    r = client.chat.completions.create(
        model="kvscope-tools",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80,
        temperature=0,
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert len(ch.message.tool_calls) == 1
    _valid_call(ch.message.tool_calls[0], names=("get_weather",))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_forces_a_call_of_one_of_the_tools(client, seed):
    r = client.chat.completions.create(
        model="kvscope-tools",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=80,
        temperature=1.0,
        seed=seed,
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    _valid_call(ch.message.tool_calls[0])


def test_streamed_call_is_one_delta_with_index(client):
    kw = dict(
        model="kvscope-tools",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=80,
        temperature=0,
    )
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    deltas, reasons, content = [], [], ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            deltas += ch.delta.tool_calls or []
            content += ch.delta.content or ""
            reasons.append(ch.finish_reason)
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].id.startswith("call_")
    assert deltas[0].type == "function" and deltas[0].function.name == "get_time"
    assert deltas[0].function.arguments == whole.function.arguments
    assert content == "" and reasons[-1] == "tool_calls"


def test_auto_and_none_render_the_tools(client, http):
    plain = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, "temperature": 0}).json()
    for choice in ("auto", "none"):
        r = http.post(
            "/v1/chat/completions",
            json={"messages": ASK, "tools": TOOLS, "tool_choice": choice, "max_tokens": 4, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        body = r.json()
        # the template put the tool definitions into the prompt (vLLM: also for "none")
        assert body["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 60
        assert body["choices"][0]["message"]["tool_calls"] == []
        assert isinstance(body["choices"][0]["message"]["content"], str)


def test_tool_round_trip_in_the_history(client):
    history = [*ASK]
    r = client.chat.completions.create(
        model="kvscope-tools",
        messages=history,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=80,
        temperature=0,
    )
    msg = r.choices[0].message
    history.append(msg)  # the SDK object, tool_calls and all
    history.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": '{"temp": 21}'})
    r2 = client.chat.completions.create(
        model="kvscope-tools", messages=history, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert r2.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens + r.usage.completion_tokens


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"tools": [{"type": "function", "function": {"name": "x y"}}]}, "tools.0.function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(http, extra, field):
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_template_without_tools_is_a_400_naming_tools(server):
    with httpx.Client(base_url=server.base, headers=server.headers, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "max_tokens": 2})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "tools" and err["type"] == "BadRequestError"
    assert "chat template does not support tools" in err["message"]
