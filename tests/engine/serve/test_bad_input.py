"""Hostile HTTP input: every case answers 4xx in OpenAI's error shape naming the field (and the
limit where there is one), never a 500 or a trace, and the server keeps serving after each. Plus
a hypothesis fuzz of the request schemas with zero server errors."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import API_KEY

GOOD = {"model": "kvscope-tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
CHAT = {"model": "kvscope-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


def assert_error(r, status, *words, param="any"):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == status
    msg = body["error"]["message"]
    assert "Traceback" not in msg and 'File "' not in msg
    for w in words:
        assert w in msg, (w, msg)
    if param != "any":
        assert body["error"]["param"] == param, body
    return body["error"]


def still_serving(http):
    r = http.post("/v1/completions", json=GOOD)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


RAW_CASES = [
    ("malformed JSON", "/v1/completions", b'{"prompt": "x",', 400, ["not valid JSON"], None),
    ("JSON array body", "/v1/completions", b"[1, 2]", 400, ["JSON object"], None),
    ("empty body", "/v1/completions", b"", 400, [], "any"),
    ("not UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, [], "any"),
]


@pytest.mark.parametrize("name,path,raw,status,words,param", RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_raw_bodies(http, name, path, raw, status, words, param):
    assert_error(
        http.post(path, content=raw, headers={"content-type": "application/json"}), status, *words, param=param
    )
    still_serving(http)


CASES = [
    ("temperature as a string", "/v1/completions", dict(GOOD, temperature="hot"), 400, ["temperature"], "temperature"),
    (
        "temperature over 100",
        "/v1/completions",
        dict(GOOD, temperature=150),
        400,
        ["temperature", "100"],
        "temperature",
    ),
    ("negative max_tokens", "/v1/completions", dict(GOOD, max_tokens=-1), 400, ["max_tokens", "1"], "max_tokens"),
    (
        "max_tokens past the context",
        "/v1/completions",
        dict(GOOD, max_tokens=100000),
        400,
        ["maximum context length is 256", "100000"],
        "max_tokens",
    ),
    (
        "tools (a definition without its function)",
        "/v1/chat/completions",
        dict(CHAT, tools=[{"type": "function"}]),
        400,
        ["tools.0.function"],
        "tools.0.function",
    ),
    ("n = 0", "/v1/completions", dict(GOOD, n=0), 400, ["n", "1"], "n"),
    ("n = 99", "/v1/completions", dict(GOOD, n=99), 400, ["n", "16"], "n"),
    ("prompt as an int", "/v1/completions", dict(GOOD, prompt=42), 400, ["prompt"], "prompt"),
    ("empty prompt", "/v1/completions", dict(GOOD, prompt=""), 400, ["prompt", "empty"], "prompt"),
    (
        "token id outside the vocabulary",
        "/v1/completions",
        dict(GOOD, prompt=[1, 10**9]),
        400,
        ["vocabulary"],
        "prompt",
    ),
    ("top_p = 0", "/v1/completions", dict(GOOD, top_p=0), 400, ["top_p"], "top_p"),
    ("logprobs = 21", "/v1/completions", dict(GOOD, logprobs=21), 400, ["logprobs", "20"], "logprobs"),
    (
        "min_tokens > max_tokens",
        "/v1/completions",
        dict(GOOD, min_tokens=5),
        400,
        ["min_tokens", "max_tokens"],
        "min_tokens",
    ),
    ("unknown tier", "/v1/completions", dict(GOOD, tier="platinum"), 400, ["platinum"], "tier"),
    ("stop list too long", "/v1/completions", dict(GOOD, stop=["a"] * 17), 400, ["stop", "16"], "stop"),
    ("missing messages", "/v1/chat/completions", {"model": "kvscope-tiny"}, 400, ["messages", "required"], "messages"),
    (
        "bad role",
        "/v1/chat/completions",
        dict(CHAT, messages=[{"role": "wizard", "content": "x"}]),
        400,
        ["role"],
        "any",
    ),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        dict(CHAT, top_logprobs=2),
        400,
        ["top_logprobs"],
        "top_logprobs",
    ),
    (
        "presence_penalty out of range",
        "/v1/completions",
        dict(GOOD, presence_penalty=2.5),
        400,
        ["presence_penalty"],
        "presence_penalty",
    ),
    (
        "stream_options without stream",
        "/v1/completions",
        dict(GOOD, stream_options={"include_usage": True}),
        400,
        ["stream_options"],
        "stream_options",
    ),
    (
        "lone surrogate in content",
        "/v1/chat/completions",
        dict(CHAT, messages=[{"role": "user", "content": "\ud800"}]),
        400,
        ["Unicode"],
        "any",
    ),
]


@pytest.mark.parametrize("name,path,body,status,words,param", CASES, ids=[c[0] for c in CASES])
def test_bad_fields(http, name, path, body, status, words, param):
    assert_error(
        http.post(path, content=json.dumps(body), headers={"content-type": "application/json"}),
        status,
        *words,
        param=param,
    )
    still_serving(http)


def test_unknown_model_is_404(http):
    assert_error(http.post("/v1/completions", json=dict(GOOD, model="gpt-9")), 404, "gpt-9", param="model")
    still_serving(http)


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/nothing"), 404, "/v1/nothing")
    assert_error(http.get("/v1/completions"), 405, "GET")
    still_serving(http)


def test_api_key(server):
    r = httpx.post(server.base + "/v1/completions", json=GOOD)
    assert_error(r, 401, "API key")
    r = httpx.post(server.base + "/v1/completions", json=GOOD, headers={"Authorization": "Bearer wrong"})
    assert_error(r, 401, "incorrect")
    assert httpx.get(server.base + "/health").status_code == 200  # /health needs no key
    assert_error(httpx.get(server.base + "/metrics"), 401)


def test_huge_bodies_are_413(server, http):
    big = json.dumps(dict(GOOD, prompt="x " * 100_000))
    assert_error(http.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413, "65536")

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(100):
            yield b"x" * 1024

    r = httpx.post(server.base + "/v1/completions", content=chunks(), headers=dict(server.headers))
    assert_error(r, 413, "65536")
    still_serving(http)


def test_queue_full_is_429(server, http):
    st = server.app.state.kvscope
    old = st.max_waiting
    st.max_waiting, st.in_flight = 1, st.in_flight + 100  # as if 100 requests were being served
    try:
        assert_error(http.post("/v1/completions", json=GOOD), 429, "capacity")
    finally:
        st.max_waiting, st.in_flight = old, st.in_flight - 100
    still_serving(http)


# ------------------------------------------------------------------ fuzz
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**12), 10**12) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "seed",
    "ignore_eos",
    "n",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "echo",
    "tier",
    "request_class",
    "cache_salt",
    "speculative",
    "best_of",
    "user",
    "zzz",
]
SMALL = {
    "max_tokens": st.integers(-2, 3),
    "max_completion_tokens": st.integers(-2, 3),
    "n": st.integers(-1, 3),
    "min_tokens": st.integers(-1, 3),
    "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 60000), max_size=5), JSONISH),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "x"]), "content": st.one_of(st.text(max_size=20), JSONISH)}
        ),
        max_size=2,
    )
    | JSONISH,
    "model": st.sampled_from(["kvscope-tiny", "tiny", "other"]) | JSONISH,
}


def body_strategy():
    def field_value(name):
        return SMALL.get(name, JSONISH)

    return st.lists(st.sampled_from(FIELDS), max_size=6, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({n: field_value(n) for n in names})
    )


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=body_strategy())
def test_fuzzed_bodies_never_500(server, path, body):
    if isinstance(body.get("max_tokens"), int) is False and "max_completion_tokens" not in body:
        body.setdefault("max_tokens", 2)  # bounded work for the ones that are valid
    body.setdefault("max_completion_tokens", None) if path.endswith("chat/completions") else None
    if body.get("max_completion_tokens") is None:
        body.pop("max_completion_tokens", None)
    r = httpx.post(server.base + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == r.status_code
    elif body.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        assert r.json()["choices"]


def test_engine_down_is_503():
    from engine.config import EngineConfig
    from engine.core.thread import EngineThread
    from engine.serve import create_app, run_in_background
    from engine.serve.ports import free_port

    from .conftest import TINY_SERVE

    th = EngineThread(config=EngineConfig(**TINY_SERVE))
    port = free_port()
    srv = run_in_background(create_app(th), "127.0.0.1", port)
    try:
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(base + "/health").status_code == 200
        th.shutdown()
        assert_error(httpx.get(base + "/health"), 503, "engine is down")
        assert_error(httpx.post(base + "/v1/completions", json=GOOD | {"model": None}), 503, "engine is down")
    finally:
        srv.should_exit = True
        srv.thread.join(10)


def test_default_max_tokens_is_the_rest_of_the_context(http):
    prompt = list(range(1000, 1000 + 250))  # max_model_len 256: room for 6 tokens
    r = http.post("/v1/completions", json={"prompt": prompt, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6 and r.json()["choices"][0]["finish_reason"] == "length"
