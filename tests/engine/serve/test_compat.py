"""What real clients send, taken unchanged (issue 22): unknown fields and nulls accepted and
reported as ignored (header + log), the OpenAI SDK multi-turn pattern (the returned message
appended to the history), tool history messages, max_completion_tokens on completions, and a
413 OpenAI-shaped error for an oversized body instead of a connection reset."""

import json
import logging
import socket

import httpx
import pytest

from engine.serve.routes import IGNORED_HEADER

from .test_bad_input import CHAT, GOOD, assert_error

# bodies as LangChain / LiteLLM / the OpenAI SDK send them (fields they add by default)
CLIENT_EXTRAS = {
    "metadata": {"k": "v"},
    "store": False,
    "service_tier": "auto",
    "parallel_tool_calls": True,
    "chat_template_kwargs": {"enable_thinking": False},
    "logit_bias": {},
    "skip_special_tokens": True,
    "include_stop_str_in_output": False,
    "min_p": 0.0,
    "response_format": {"type": "text"},
    "tools": None,
    "tool_choice": None,
}


def test_unknown_and_known_unused_fields_accepted_and_listed(http, caplog):
    ref = http.post("/v1/chat/completions", json=CHAT)
    assert ref.status_code == 200 and IGNORED_HEADER not in ref.headers
    with caplog.at_level(logging.WARNING, logger="kvscope.serve"):
        r = http.post("/v1/chat/completions", json=dict(CHAT, **CLIENT_EXTRAS, foo=1))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == ref.json()["choices"][0]["message"]["content"]
    listed = r.headers[IGNORED_HEADER].split(",")
    assert listed == sorted(["chat_template_kwargs", "foo", "metadata", "parallel_tool_calls", "service_tier", "store"])
    assert any("ignored: chat_template_kwargs, foo" in rec.getMessage() for rec in caplog.records)


def test_nulls_mean_defaults(http):
    nulls = {"n": None, "logprobs": None, "stream": None, "presence_penalty": None, "frequency_penalty": None}
    nulls |= {"repetition_penalty": None, "echo": None, "min_tokens": None, "ignore_eos": None, "top_p": None}
    a = http.post("/v1/completions", json=GOOD).json()
    b = http.post("/v1/completions", json=dict(GOOD, **nulls))
    assert b.status_code == 200, b.text
    assert b.json()["choices"][0]["text"] == a["choices"][0]["text"] and len(b.json()["choices"]) == 1


def test_streaming_reports_ignored(http):
    with http.stream("POST", "/v1/completions", json=dict(GOOD, stream=True, store=True)) as r:
        assert r.status_code == 200 and r.headers[IGNORED_HEADER] == "store"
        assert any(line.strip() == "data: [DONE]" for line in r.iter_lines())


# ignore_eos and a +8 bias on <|endoftext|> / <|im_start|> / <|im_end|>: the tiny model's greedy
# output then holds special tokens among ordinary ones (ids 0 and 2 here)
BIAS = {"0": 8, "1": 8, "2": 8}
SPECIAL = dict(GOOD, prompt="Hello there, tell me", max_tokens=12, ignore_eos=True, logit_bias=BIAS)


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_matches_the_tokenizers_decode(http, server, llm, skip):
    from engine.config import SamplingParams

    tok = server.thread.tokenizer
    params = SamplingParams(max_tokens=12, ignore_eos=True, logit_bias={int(k): v for k, v in BIAS.items()})
    ids = llm.generate([SPECIAL["prompt"]], params)[0].outputs[0].token_ids
    assert {0, 2} <= set(ids) and len(set(ids) - {0, 1, 2}) >= 5  # special and ordinary tokens
    r = http.post("/v1/completions", json=dict(SPECIAL, skip_special_tokens=skip))
    assert r.status_code == 200 and IGNORED_HEADER not in r.headers, r.text
    text = r.json()["choices"][0]["text"]
    assert text == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in text) is (not skip) and ("<|endoftext|>" in text) is (not skip)
    with http.stream("POST", "/v1/completions", json=dict(SPECIAL, skip_special_tokens=skip, stream=True)) as s:
        parts = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(p["choices"][0]["text"] for p in parts if p["choices"]) == text
    # chat: the same rule on the assistant message
    msgs = [{"role": "user", "content": "Hello there"}]
    prompt_ids = http.post("/tokenize", json={"messages": msgs}).json()["tokens"]
    chat_ids = llm.generate([prompt_ids], params)[0].outputs[0].token_ids
    body = {"messages": msgs, "max_tokens": 12, "ignore_eos": True, "logit_bias": BIAS, "temperature": 0}
    msg = http.post("/v1/chat/completions", json=dict(body, skip_special_tokens=skip)).json()["choices"][0]["message"]
    assert msg["content"] == tok.decode(chat_ids, skip_special_tokens=skip)


def test_max_completion_tokens_on_completions(http):
    r = http.post("/v1/completions", json=dict(GOOD, max_tokens=None, max_completion_tokens=3))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def test_openai_sdk_multi_turn_appends_returned_message(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.base + "/v1", api_key="sk-kvscope-test")
    history = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model="kvscope-tiny", messages=history, max_tokens=3, temperature=0)
    history.append(r.choices[0].message)  # the SDK object: tool_calls [] / refusal None / ...
    history.append({"role": "user", "content": "And again?"})
    r2 = client.chat.completions.create(model="kvscope-tiny", messages=history, max_tokens=3, temperature=0)
    assert r2.usage.completion_tokens == 3
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens + r.usage.completion_tokens


def test_tool_history_messages_accepted(http):
    msgs = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "refusal": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"c": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny.", "tool_calls": [], "refusal": None, "annotations": []},
        {"role": "user", "content": "Thanks"},
    ]
    r = http.post("/v1/chat/completions", json=dict(CHAT, messages=msgs))
    assert r.status_code == 200, r.text
    assert r.headers[IGNORED_HEADER] == "messages.3.annotations"


@pytest.mark.parametrize(
    "extra,field",
    [
        ({"logit_bias": {"abc": 10}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"999999999": 1}}, "logit_bias"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": "3"}, "n"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ],
)
def test_implemented_fields_stay_strict_and_unimplemented_values_say_so(http, extra, field):
    assert_error(http.post("/v1/chat/completions", json=dict(CHAT, **extra)), 400, field, param=field)


def test_sampler_knobs_reach_the_engine(http):
    """LiteLLM's logit_bias (string token ids) and the penalties are applied, not ignored."""
    body = dict(GOOD, max_tokens=4, temperature=0, ignore_eos=True)
    r = http.post("/v1/completions", json=dict(body, logit_bias={"42": 100}))
    assert r.status_code == 200 and IGNORED_HEADER not in r.headers, r.text
    want = http.post("/detokenize", json={"tokens": [42] * 4}).json()["prompt"]
    assert r.json()["choices"][0]["text"] == want
    knobs = dict(presence_penalty=-2, frequency_penalty=-1, repetition_penalty=0.5, min_p=0.1)
    a = http.post("/v1/completions", json=dict(body, **knobs))
    assert a.status_code == 200, a.text
    assert a.json()["choices"][0]["text"] != http.post("/v1/completions", json=body).json()["choices"][0]["text"]


def test_include_stop_str_in_output_on_the_wire(http):
    body = dict(GOOD, max_tokens=16, temperature=0, ignore_eos=True)
    full = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = full.index(stop)
    for include, want in ((False, full[:cut]), (True, full[: cut + len(stop)])):
        b = dict(body, stop=[stop], include_stop_str_in_output=include)
        ch = http.post("/v1/completions", json=b).json()["choices"][0]
        assert (ch["text"], ch["finish_reason"], ch["stop_reason"]) == (want, "stop", stop)
        with http.stream("POST", "/v1/completions", json=dict(b, stream=True)) as r:
            lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]
        assert "".join(json.loads(ln)["choices"][0]["text"] for ln in lines) == want


def test_structured_output_on_the_wire(http):
    """LangChain's with_structured_output body: response_format json_schema; the content parses
    and validates, streamed and not."""
    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 10},
            "unit": {"enum": ["C", "F"]},
            "days": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
        },
        "required": ["city", "unit", "days"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "Weather", "schema": schema, "strict": True}}
    body = dict(CHAT, max_tokens=200, temperature=0, response_format=fmt)
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and IGNORED_HEADER not in r.headers, r.text
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "stop"
    jsonschema.validate(json.loads(ch["message"]["content"]), schema)
    with http.stream("POST", "/v1/chat/completions", json=dict(body, stream=True)) as s:
        lines = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]
    text = "".join(
        json.loads(ln)["choices"][0]["delta"].get("content") or "" for ln in lines if json.loads(ln)["choices"]
    )
    assert text == ch["message"]["content"]


def test_oversized_body_gets_413_json_not_a_reset(server):
    limit = server.app.state.kvscope.max_body_bytes
    body = json.dumps(dict(GOOD, prompt="x" * 12_000_000)).encode()  # 12 MB, as the issue sent
    r = httpx.post(
        server.base + "/v1/completions",
        content=body,
        headers=dict(server.headers, **{"content-type": "application/json"}),
    )
    err = assert_error(r, 413, "limit", str(limit))
    assert err["type"]
    with socket.create_connection(("127.0.0.1", server.port), timeout=30):
        pass
    r = httpx.post(server.base + "/v1/completions", json=GOOD, headers=server.headers, timeout=120)
    assert r.status_code == 200


def test_cached_tokens_in_usage(http):
    body = dict(GOOD, prompt="The same long prompt for the prefix cache, " * 3, max_tokens=1)
    first = http.post("/v1/completions", json=body).json()["usage"]
    second = http.post("/v1/completions", json=body).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] >= 0
    # every full block of the prompt but the one holding the last token is a hit (block_size 8)
    assert second["prompt_tokens_details"]["cached_tokens"] == (second["prompt_tokens"] - 1) // 8 * 8


def test_n_with_seed_gives_each_choice_its_own_seed(http):
    body = dict(GOOD, prompt="Once upon", max_tokens=8, temperature=1.0, seed=7, n=3)
    texts = [c["text"] for c in http.post("/v1/completions", json=body).json()["choices"]]
    for i in range(3):
        one = http.post("/v1/completions", json=dict(body, n=1, seed=7 + i)).json()["choices"][0]["text"]
        assert texts[i] == one
    assert len(set(texts)) > 1


def test_tokenize_detokenize_version_ping_model_by_id(http, server):
    tok = server.thread.tokenizer
    r = http.post("/tokenize", json={"model": "kvscope-tiny", "prompt": "Hello world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["tokens"] == tok.encode("Hello world", add_special_tokens=True)
    assert d["count"] == len(d["tokens"]) and d["max_model_len"] == 256
    assert d["token_strs"] == tok.convert_ids_to_tokens(d["tokens"])
    r = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
    want = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True)
    assert r.json()["tokens"] == list(getattr(want, "input_ids", want))
    assert http.post("/detokenize", json={"tokens": d["tokens"]}).json() == {"prompt": tok.decode(d["tokens"])}
    assert_error(http.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens", param="tokens")
    assert_error(http.post("/tokenize", json={}), 400, "prompt")
    assert set(http.get("/version").json()) == {"version"}
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    card = http.get("/v1/models/kvscope-tiny").json()
    assert card == http.get("/v1/models").json()["data"][0]
    assert_error(http.get("/v1/models/nope"), 404, "nope", param="model")
