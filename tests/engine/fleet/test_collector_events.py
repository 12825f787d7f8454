"""engine/fleet/collector.py without servers: a raw ZMQ publisher that skips a seq number on the
PUB socket and serves it on the replay socket; the watch replays it, counts the gap, and ends with
the publisher's cached set. Plus the metrics parser and a dead instance that never blocks."""

from __future__ import annotations

import threading

import zmq

from engine.fleet.collector import FleetCollector, InstanceWatch, Member, hash_hex, parse_metrics
from engine.observe.kv_event_wire import END_SEQ, BlockRemoved, BlockStored, KVEventBatch, encode_batch
from engine.serve.ports import free_port
from tests.waiting import wait_until

BS = 4


def stored(hashes, parent, tokens):
    return BlockStored(list(hashes), parent, list(tokens), BS)


def test_gap_is_replayed_and_counted():
    ev_port, rp_port = free_port(), free_port()
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{ev_port}")
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{rp_port}")
    batches = {
        0: KVEventBatch(1.0, [stored([11], None, [1, 2, 3, 4])]),
        1: KVEventBatch(2.0, [stored([12, 13], 11, [5, 6, 7, 8, 9, 10, 11, 12])]),  # never sent on PUB
        2: KVEventBatch(3.0, [BlockRemoved([13])]),
    }
    payload = {s: encode_batch(b) for s, b in batches.items()}
    sent_live: list[int] = []
    stop = threading.Event()

    def serve_replay():
        while not stop.is_set():
            if router.poll(50):
                ident, _, start = router.recv_multipart()
                s0 = int.from_bytes(start, "big")
                for s in sorted(payload):
                    if s >= s0 and (s in sent_live or (s == 1 and 2 in sent_live)):
                        router.send_multipart((ident, b"", b"", s.to_bytes(8, "big"), payload[s]))
                router.send_multipart((ident, b"", b"", END_SEQ, b""))

    t = threading.Thread(target=serve_replay, daemon=True)
    t.start()
    w = InstanceWatch(
        Member("p", "http://127.0.0.1:1", f"tcp://127.0.0.1:{ev_port}", f"tcp://127.0.0.1:{rp_port}"),
        interval_s=0.2,
        event_block_size=BS,
    )
    w.start()
    try:

        def live() -> bool:
            # keep publishing seq 0 until the subscription is live (PUB drops before it is)
            pub.send_multipart((b"", (0).to_bytes(8, "big"), payload[0]))
            sent_live[:] = [0]
            return w.status().stream.batches > 0

        wait_until(live, "the watch's subscription to receive a batch", 20, 0.1)
        sent_live.append(2)  # before the send: the replay socket may be asked at once
        pub.send_multipart((b"", (2).to_bytes(8, "big"), payload[2]))
        wait_until(lambda: w.status().stream.last_seq >= 2, "seq 2, the gap replayed", 20, 0.05)
        st = w.status()
        assert st.stream.last_seq == 2
        assert st.stream.seq_gaps == 1 and st.stream.replayed_batches >= 1 and st.stream.missed == 0
        assert st.stream.encoding == "current"
        assert w.cached() == {hash_hex(11), hash_hex(12)}
        # the node table keeps each block's parent and tokens (the tree's edges)
        nodes = w.nodes()
        assert nodes[hash_hex(12)] == (hash_hex(11), (5, 6, 7, 8))
        assert nodes[hash_hex(13)] == (hash_hex(12), (9, 10, 11, 12))
        assert st.up is False and st.reason  # nothing listens on port 1
    finally:
        w.stop()
        stop.set()
        t.join(timeout=5)
        pub.close(0)
        router.close(0)


def test_held_prefix_and_duplicates_from_applied_events():
    c = FleetCollector([Member("a", "http://127.0.0.1:1"), Member("b", "http://127.0.0.1:1")], block_size=BS)
    a, b = c.watches["a"], c.watches["b"]
    a.apply(KVEventBatch(0, [stored([1, 2], None, [1, 2, 3, 4, 5, 6, 7, 8])]))
    b.apply(KVEventBatch(0, [stored([1], None, [1, 2, 3, 4])]))
    assert c.held_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9]) == {"a": 8, "b": 4}
    assert c.held_prefix([9, 9, 9, 9]) == {"a": 0, "b": 0}
    tree = c.tree()
    assert tree.duplicated_blocks == 1
    assert {n.block_hash: (n.parent, n.holders, n.depth) for n in tree.nodes} == {
        hash_hex(1): ("", ("a", "b"), 0),
        hash_hex(2): (hash_hex(1), ("a",), 1),
    }
    assert c.ever_stored([1, 2, 3, 4]) and not c.ever_stored([4, 3, 2, 1])


def test_dead_instance_never_blocks_a_snapshot():
    c = FleetCollector([Member("gone", f"http://127.0.0.1:{free_port()}")], interval_s=0.1).start()
    try:
        wait_until(lambda: c.snapshot().instances[0].reason != "not scraped yet", "a first scrape", 10, 0.05)
        s = c.snapshot()
        assert s.instances[0].up is False and "refused" in s.instances[0].reason
    finally:
        c.stop()


def test_parse_metrics_sums_label_sets():
    text = 'vllm:num_requests_running{engine="0"} 2\nvllm:num_requests_running{engine="1"} 3\n'
    assert parse_metrics(text)["vllm:num_requests_running"] == 5.0
