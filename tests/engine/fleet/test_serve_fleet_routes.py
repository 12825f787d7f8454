"""engine/serve/fleet_routes.py on an in-process tiny-model server: the x-kvscope-instance header
(plain and streamed), /v1/kvscope/cached_blocks against the block manager, and /reset_prefix_cache
(dropping only unused blocks, each drop published as a removal the rebuilt set follows)."""

from __future__ import annotations

import pytest

from engine.observe.kv_event_wire import apply_events, published_hash
from tests.engine.serve.conftest import TINY_SERVE, serving


@pytest.fixture(scope="module")
def srv():
    from engine.config import EngineConfig
    from engine.core.thread import EngineThread

    th = EngineThread(config=EngineConfig(**TINY_SERVE))
    with serving(th, instance_id="e7") as s:
        yield s


def test_instance_header_on_every_response(srv):
    with srv.http() as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hello there", "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-kvscope-instance"] == "e7"
        with c.stream(
            "POST", "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": True}
        ) as s:
            assert s.headers["x-kvscope-instance"] == "e7"
            assert any(line.startswith("data:") for line in s.iter_lines())
        assert c.get("/v1/models").headers["x-kvscope-instance"] == "e7"


def test_cached_blocks_lists_the_block_managers_hashes(srv):
    with srv.http() as c:
        c.post("/v1/completions", json={"model": "tiny", "prompt": "one two three " * 10, "max_tokens": 1})
        d = c.get("/v1/kvscope/cached_blocks").json()
    with srv.thread.lock:
        want = sorted(f"{published_hash(h):016x}" for h in srv.thread.engine.bm.cached_hashes())
    assert d["hashes"] == want and d["count"] == len(want) > 0
    assert d["block_size"] == TINY_SERVE["block_size"] and d["num_blocks"] == TINY_SERVE["num_kv_blocks"]


def test_reset_prefix_cache_drops_unused_blocks_and_publishes_removals(srv):
    eng = srv.thread.engine
    with srv.thread.lock:
        before = {published_hash(h) for h in eng.bm.cached_hashes()}
        eng.enable_kv_events()  # the engine queues its KV events; this test drains them
    try:
        with srv.http() as c:
            d = c.post("/reset_prefix_cache").json()
            after = c.get("/v1/kvscope/cached_blocks").json()
        removed = [(kind, published_hash(h)) for _, kind, h, *_ in eng.take_kv_events()]
    finally:
        eng.disable_kv_events()
    assert d["reset"] is True and d["dropped_blocks"] == len(before) > 0 and d["kept_in_use"] == 0
    assert after["hashes"] == []
    assert {h for k, h in removed if k == "removed"} == before
    from engine.observe.kv_event_wire import BlockRemoved

    assert apply_events(set(before), [BlockRemoved([h for _, h in removed])]) == set()
    with srv.thread.lock:
        eng.bm.check_invariants()
