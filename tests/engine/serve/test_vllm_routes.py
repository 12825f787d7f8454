"""vLLM's routes for routers (engine/serve/vllm_routes.py): the render routes' GenerateRequest
shape and token ids (those the generation routes would run), /get_server_info, /kv_event_sources
(empty without a publisher; the publisher's endpoints with one), bad input as a 400 naming the
field, and a subscriber that attaches through the discovered endpoints after blocks were cached
getting whole BlockStored events (token ids, vLLM's hashes)."""

from __future__ import annotations

import pytest

from engine.config import SamplingParams
from engine.core.prefix_hash import PrefixHasher
from engine.observe.kv_event_wire import AllBlocksCleared, BlockStored, published_hash
from tests.engine.serve.conftest import TINY_SERVE, serving

GENERATE_REQUEST_KEYS = {
    "request_id",
    "token_ids",
    "features",
    "sampling_params",
    "model",
    "stream",
    "stream_options",
    "cache_salt",
    "priority",
}
MESSAGES = [{"role": "system", "content": "You review release notes."}, {"role": "user", "content": "Summarize."}]


def _idle(server):
    assert not server.thread.engine.has_unfinished_requests()


def test_chat_render_returns_vllms_generate_request_with_the_prompt_ids(http, server):
    r = http.post("/v1/chat/completions/render", json={"messages": MESSAGES, "temperature": 0.3, "cache_salt": "t1"})
    assert r.status_code == 200, r.text
    d = r.json()
    assert set(d) == GENERATE_REQUEST_KEYS
    tok = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert d["token_ids"] == tok and tok
    assert d["request_id"].startswith("chatcmpl-") and d["features"] is None
    assert (d["model"], d["stream"], d["stream_options"], d["cache_salt"]) == ("kvscope-tiny", False, None, "t1")
    sp = d["sampling_params"]
    assert sp["temperature"] == 0.3 and sp["max_tokens"] == server.thread.engine.max_completion_tokens(len(tok))
    # the same prompt through /v1/chat/completions reports that many prompt tokens
    u = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).json()["usage"]
    assert u["prompt_tokens"] == len(tok)
    _idle(server)


def test_chat_render_keeps_stream_fields(http):
    body = {"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 5}
    d = http.post("/v1/chat/completions/render", json=body).json()
    assert d["stream"] is True and d["stream_options"]["include_usage"] is True
    assert d["sampling_params"]["max_tokens"] == 5


def test_completions_render_is_a_list_one_per_prompt(http, server):
    prompts = ["The release freeze starts", "Merge window closes"]
    r = http.post("/v1/completions/render", json={"prompt": prompts, "max_tokens": 3, "seed": 9})
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, list) and len(out) == 2 and all(set(d) == GENERATE_REQUEST_KEYS for d in out)
    for p, d in zip(prompts, out):
        assert d["token_ids"] == list(server.thread.tokenizer.encode(p, add_special_tokens=False))
    assert all(d["request_id"].startswith("cmpl-") for d in out)
    assert [d["sampling_params"]["seed"] for d in out] == [9, 9]
    ids = http.post("/v1/completions/render", json={"prompt": [5, 6, 7, 8]}).json()
    assert len(ids) == 1 and ids[0]["token_ids"] == [5, 6, 7, 8]
    _idle(server)


@pytest.mark.parametrize(
    "route, body, field",
    [
        ("/v1/chat/completions/render", {}, "messages"),
        ("/v1/chat/completions/render", {"messages": []}, "messages"),
        ("/v1/chat/completions/render", {"messages": MESSAGES, "max_tokens": 100_000}, "max_tokens"),
        ("/v1/chat/completions/render", {"messages": MESSAGES, "temperature": "hot"}, "temperature"),
        ("/v1/completions/render", {"prompt": [10**9]}, "prompt"),
        ("/v1/completions/render", {"prompt": ""}, "prompt"),
        ("/v1/completions/render", {"prompt": "x " * 400}, "prompt"),
        ("/v1/completions/render", {"prompt": "ok", "tier": "nope"}, "tier"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(http, server, route, body, field):
    r = http.post(route, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and (err["param"] == field or field in err["message"]), err
    _idle(server)


def test_unknown_model_is_a_404(http):
    r = http.post("/v1/completions/render", json={"prompt": "hi", "model": "gpt-x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_get_server_info_has_vllms_fields_and_what_a_kv_router_reads(http):
    a = http.get("/get_server_info").json()
    b = http.get("/server_info").json()
    assert a == b
    assert (a["model_id"], a["served_model_name"], a["model_path"]) == ("kvscope-tiny", "kvscope-tiny", "tiny")
    assert (a["dp_size"], a["tp_size"], a["kv_block_size"]) == (1, 1, TINY_SERVE["block_size"])
    assert a["instance_id"].startswith("kvscope-") and a["prefix_caching_hash_algo"] == "sha256"
    assert a["kv_events"] is False


def test_kv_event_sources_is_empty_without_a_publisher(http):
    r = http.get("/kv_event_sources")
    assert r.status_code == 200 and r.json() == {}


def test_discovered_publisher_replays_cached_blocks_with_their_token_ids():
    """A server that cached a prompt's blocks before a subscriber came: /kv_event_sources names
    the sockets, and the subscriber gets AllBlocksCleared then BlockStored events carrying every
    block's tokens, whose hashes are vLLM's for those tokens."""
    from engine.config import EngineConfig
    from engine.core.thread import EngineThread
    from engine.observe.kv_events import KVEventPublisher, KVEventSubscriber

    th = EngineThread(config=EngineConfig(**TINY_SERVE))
    prompt = list(range(40, 80))  # 5 full blocks of 8
    h = th.submit(prompt, SamplingParams(max_tokens=1, temperature=0))
    h.result(timeout=120)  # the handle says when the request finished
    assert h.finished and len(th.engine.bm.hash_to_block) >= 4
    with serving(th) as srv, srv.http() as c:
        pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", flush_interval=0.02)
        pub.attach(th)
        srv.app.state.kvscope.kv_events = pub
        sub = None
        try:
            src = c.get("/kv_event_sources").json()
            assert list(src) == ["0"]
            e = src["0"]
            assert (e["publisher"], e["enable_kv_cache_events"], e["topic"]) == ("zmq", True, "")
            assert (e["encoding"], e["schema_version"]) == ("msgpack", 1)  # vllm-router 0.1.17 needs both
            assert e["endpoint"] == pub.endpoint and e["replay_endpoint"] == pub.replay_endpoint
            assert c.get("/get_server_info").json()["kv_events"] is True
            pub.flush()
            sub = KVEventSubscriber(e["endpoint"], e["replay_endpoint"])
            events = [ev for _, b in sub.replay(0) for ev in b.events]
            assert isinstance(events[0], AllBlocksCleared)
            stored = [ev for ev in events if isinstance(ev, BlockStored)]
            assert stored and all(len(s.token_ids) == s.block_size * len(s.block_hashes) for s in stored)
            got = {hh: tuple(s.token_ids[i * 8 : (i + 1) * 8]) for s in stored for i, hh in enumerate(s.block_hashes)}
            want = PrefixHasher().chain(prompt, 8)
            for i, hh in enumerate(want):
                assert got[published_hash(hh)] == tuple(prompt[i * 8 : (i + 1) * 8])
        finally:
            if sub is not None:
                sub.close()
            pub.close()
