"""EngineClient's KV events (engine serve --kv-events-endpoint with the core in its own process):
the publisher lives in the core, attached to its engine; the block pool's reads the API makes
(/get_server_info, the fleet routes) and admission_check are forwarded; a rebuilt core takes the
endpoints over, says AllBlocksCleared and continues the seq numbers; shutdown frees them."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.config import EngineConfig
from engine.core.client import EngineClient
from engine.observe.kv_event_wire import AllBlocksCleared, BlockStored, published_hash
from engine.observe.kv_events import KVEventSubscriber
from engine.serve.ports import free_port
from tests.engine.engines import TINY_CORE
from tests.waiting import wait_until

pytestmark = pytest.mark.slow
WAIT_S = 300


def _drain(sub, into: list) -> list:
    into.extend(sub.poll(timeout_ms=50))
    return into


def _until(sub, kind, what: str) -> list:
    """The (seq, batch) pairs received until a batch holds an event of `kind`."""
    got: list = []
    wait_until(lambda: any(isinstance(e, kind) for _, b in _drain(sub, got) for e in b.events), what, WAIT_S)
    return got


def test_the_core_publishes_kv_events_and_a_rebuilt_core_continues_them():
    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    kv = {"endpoint": events, "replay_endpoint": replay, "wire": "current"}
    c = EngineClient(EngineConfig(**TINY_CORE), kv_events=kv)
    sub = KVEventSubscriber(events, replay)
    try:
        info = c.kv_events_info()
        assert (info.endpoint, info.replay_endpoint, info.wire) == (events, replay, "current")
        pool = c.engine.bm
        assert pool.block_size == TINY_CORE["block_size"] and pool.enable_prefix_caching and pool.hasher.algo
        with pytest.raises(ValueError, match="max_tokens"):
            c.engine.admission_check([1, 2, 3], SamplingParams(max_tokens=10**7))
        prompt = "the quick brown fox jumps over the lazy dog " * 4
        c.submit(prompt, SamplingParams(max_tokens=2, temperature=0.0)).result(timeout=WAIT_S)
        got = _until(sub, BlockStored, "BlockStored from the core")
        stored = {h for _, b in got for e in b.events if isinstance(e, BlockStored) for h in e.block_hashes}
        cached = {published_hash(h) for h in c.engine.bm.cached_hashes()}
        assert cached and cached <= stored
        last = got[-1][0]

        c.reconfigure(EngineConfig(**TINY_CORE))  # a new core process takes the endpoints over
        assert c.kv_events_info().endpoint == events
        after = _until(sub, AllBlocksCleared, "AllBlocksCleared from the rebuilt core")
        assert after[0][0] == last + 1  # the seq numbers continue: a subscriber keeps listening
        c.submit(prompt, SamplingParams(max_tokens=2, temperature=0.0)).result(timeout=WAIT_S)
        _until(sub, BlockStored, "BlockStored from the rebuilt core")
        assert c.engine.bm.reset_prefix_cache()[0] > 0 and c.engine.bm.cached_hashes() == []
    finally:
        sub.close()
        c.close()
    # shutdown closed the core's publisher: the endpoint can be bound again
    import zmq

    s = zmq.Context.instance().socket(zmq.PUB)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.bind(events)
    finally:
        s.close()


def test_a_busy_endpoint_fails_the_start_with_the_option_named():
    import zmq

    events = f"tcp://127.0.0.1:{free_port()}"
    s = zmq.Context.instance().socket(zmq.PUB)
    s.setsockopt(zmq.LINGER, 0)
    s.bind(events)
    try:
        with pytest.raises(ValueError, match=f"--kv-events-endpoint {events}: ZMQError"):
            EngineClient(EngineConfig(**TINY_CORE), kv_events={"endpoint": events})
    finally:
        s.close()
