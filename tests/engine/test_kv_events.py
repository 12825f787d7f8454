"""KV events in vLLM's wire format (engine/observe/kv_events.py): exact bytes of both wire forms, decoding
with msgspec structs declared as vLLM declares them (and with vLLM's own classes when the vllm
package imports), and the stream applied in order rebuilding the engine's cached block hashes,
live and across replay after a dropped subscriber."""

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import SamplingParams
from engine.observe.kv_event_wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    apply_events,
    decode_batch,
    encode_batch,
    published_hash,
)
from engine.observe.kv_events import KVEventPublisher, KVEventSubscriber
from engine.observe.recording import drive
from tests.engine.engines import tiny_engine

BATCH = KVEventBatch(
    12.5,
    [BlockStored([7, 8], None, [1, 2, 3, 4], 2, None, "GPU", None), BlockRemoved([7], "GPU"), AllBlocksCleared()],
    0,
)


def test_current_wire_bytes_are_tagged_maps_in_a_positional_batch():
    expect = [
        12.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [7, 8],
                "parent_block_hash": None,
                "token_ids": [1, 2, 3, 4],
                "block_size": 2,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            },
            {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ],
        0,
    ]
    assert encode_batch(BATCH) == msgpack.packb(expect, use_bin_type=True)
    # first bytes: fixarray(3), float64 12.5, fixarray(3), fixmap(8), fixstr "type"
    assert encode_batch(BATCH)[:13] == bytes.fromhex("93cb4029000000000000 93 88 a4".replace(" ", ""))


def test_legacy_wire_bytes_are_tagged_arrays():
    expect = [
        12.5,
        [
            ["BlockStored", [7, 8], None, [1, 2, 3, 4], 2, None, "GPU", None],
            ["BlockRemoved", [7], "GPU"],
            ["AllBlocksCleared"],
        ],
        0,
    ]
    assert encode_batch(BATCH, "legacy") == msgpack.packb(expect, use_bin_type=True)


@pytest.mark.parametrize("wire", ["current", "legacy"])
def test_both_wires_round_trip(wire):
    b = decode_batch(encode_batch(BATCH, wire))
    assert (b.ts, b.events, b.data_parallel_rank, b.wire) == (BATCH.ts, BATCH.events, 0, wire)


def test_decoder_reads_older_shapes_and_rejects_garbage():
    # the first legacy form: 6-field BlockStored (before lora_name), batch without a dp rank
    old = msgpack.packb([1.0, [["BlockStored", [5], 4, [9, 9], 2, None, "GPU"], ["BlockRemoved", [5], None]]])
    b = decode_batch(old)
    assert b.events == [BlockStored([5], 4, [9, 9], 2, None, "GPU", None), BlockRemoved([5], None)]
    # a map-shaped batch, bytes hashes, and unknown newer fields in a current event are accepted
    m = msgpack.packb(
        {
            "ts": 2.0,
            "events": [
                {
                    "type": "BlockStored",
                    "block_hashes": [b"\x01" * 32],
                    "parent_block_hash": None,
                    "token_ids": [1],
                    "block_size": 1,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "group_idx": 0,
                    "session_id": "s",
                }
            ],
        },
        use_bin_type=True,
    )
    assert decode_batch(m).events[0].block_hashes == [b"\x01" * 32]
    for bad in (
        b"\xc1",
        msgpack.packb([1.0, [["Nope"]]]),
        msgpack.packb([1.0, [{"type": "BlockStored"}]]),
        msgpack.packb(["x", []]),
        msgpack.packb([1.0, [["BlockRemoved", ["h"], None]]]),
        b"",
    ):
        with pytest.raises(ValueError):
            decode_batch(bad)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.builds(
                BlockStored,
                st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=4),
                st.none() | st.integers(0, 2**64 - 1),
                st.lists(st.integers(0, 50_000), max_size=8),
                st.integers(1, 64),
                st.none() | st.integers(0, 5),
                st.sampled_from(["GPU", "CPU", None]),
                st.none() | st.text(max_size=5),
            ),
            st.builds(
                BlockRemoved,
                st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=4),
                st.sampled_from(["GPU", None]),
            ),
            st.just(AllBlocksCleared()),
        ),
        max_size=12,
    ),
    st.sampled_from(["current", "legacy"]),
)
def test_round_trip_property(events, wire):
    b = decode_batch(encode_batch(KVEventBatch(3.25, events, 0), wire))
    assert b.events == events


# ---------------------------------------------------------------- vLLM's own schema


def _vllm_structs():
    """msgspec structs declared as vLLM 0.33.0 declares its KV events:
    the batch array_like, the events tagged maps; and the legacy declarations (array_like events)."""
    msgspec = pytest.importorskip("msgspec")

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored_(KVCacheEvent, tag="BlockStored"):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list | None = None
        group_idx: int | None = None

    class BlockRemoved_(KVCacheEvent, tag="BlockRemoved"):
        block_hashes: list[bytes | int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared_(KVCacheEvent, tag="AllBlocksCleared"):
        pass

    class KVEventBatch_(EventBatch):
        events: list[BlockStored_ | BlockRemoved_ | AllBlocksCleared_]

    class LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class LBlockStored(LegacyEvent, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None

    class LBlockRemoved(LegacyEvent, tag="BlockRemoved"):
        block_hashes: list[int]
        medium: str | None

    class LAllBlocksCleared(LegacyEvent, tag="AllBlocksCleared"):
        pass

    class LegacyBatch(EventBatch):
        events: list[LBlockStored | LBlockRemoved | LAllBlocksCleared]

    return msgspec, KVEventBatch_, LegacyBatch, (BlockStored_, BlockRemoved_, AllBlocksCleared_)


def test_msgspec_with_vllm_declarations_decodes_our_bytes_and_we_decode_its():
    msgspec, Current, Legacy, (S, R, C) = _vllm_structs()
    cur = msgspec.msgpack.Decoder(type=Current).decode(encode_batch(BATCH, "current"))
    assert cur.ts == 12.5 and cur.data_parallel_rank == 0
    s, r, c = cur.events
    assert (s.block_hashes, s.parent_block_hash, s.token_ids, s.block_size, s.medium) == (
        [7, 8],
        None,
        [1, 2, 3, 4],
        2,
        "GPU",
    )
    assert (r.block_hashes, r.medium, type(c).__name__) == ([7], "GPU", "AllBlocksCleared_")
    leg = msgspec.msgpack.Decoder(type=Legacy).decode(encode_batch(BATCH, "legacy"))
    assert leg.events[0].token_ids == [1, 2, 3, 4] and leg.events[1].block_hashes == [7]
    # the other way: bytes msgspec writes from vLLM's declarations decode here, in both forms
    theirs = Current(
        ts=1.5,
        events=[
            S(
                block_hashes=[3],
                parent_block_hash=2,
                token_ids=[4, 5],
                block_size=2,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            ),
            R(block_hashes=[3], medium="GPU"),
            C(),
        ],
        data_parallel_rank=0,
    )
    ours = decode_batch(msgspec.msgpack.encode(theirs))
    assert ours.wire == "current" and ours.events == [
        BlockStored([3], 2, [4, 5], 2, None, "GPU", None),
        BlockRemoved([3], "GPU"),
        AllBlocksCleared(),
    ]
    assert msgspec.msgpack.encode(theirs) == encode_batch(KVEventBatch(1.5, ours.events, 0), "current")


def test_vllm_own_classes_decode_our_bytes():
    kv = pytest.importorskip("vllm.distributed.kv_events")  # needs vllm and its dependencies importable
    import msgspec

    b = msgspec.msgpack.Decoder(type=kv.KVEventBatch).decode(encode_batch(BATCH, "current"))
    assert [type(e).__name__ for e in b.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert (b.ts, b.data_parallel_rank, b.events[0].token_ids, b.events[0].block_hashes) == (
        12.5,
        0,
        [1, 2, 3, 4],
        [7, 8],
    )
    # and what vLLM's classes write, we read
    theirs = kv.KVEventBatch(
        ts=2.0,
        events=[
            kv.BlockStored(
                block_hashes=[11, 12],
                parent_block_hash=10,
                token_ids=[1, 2],
                block_size=1,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                group_idx=0,
            ),
            kv.BlockRemoved(block_hashes=[11], medium="GPU"),
            kv.AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    ours = decode_batch(msgspec.msgpack.encode(theirs))
    assert ours.events == [
        BlockStored([11, 12], 10, [1, 2], 1, None, "GPU", None),
        BlockRemoved([11], "GPU"),
        AllBlocksCleared(),
    ]


# ---------------------------------------------------------------- the engine's stream

PROMPTS = [[1] * 24 + [i, i + 1, i + 2] * 5 for i in range(2, 12)]  # shared 3-block prefix, distinct tails


def _engine():
    return tiny_engine(device="cpu", num_kv_blocks=20, block_size=8, max_model_len=128, max_num_seqs=3)


def _cached(engine) -> set:
    return {published_hash(h) for h in engine.bm.hash_to_block}


def _drain(sub, pub, rebuilt, rounds=400):
    pub.flush()
    for _ in range(rounds):  # bounded: each poll waits at most 50 ms for a message
        if sub.state.last_seq >= pub.next_seq - 1:
            break
        for _, b in sub.poll(50):
            apply_events(rebuilt, b.events)
    return rebuilt


@pytest.mark.parametrize("wire", ["current", "legacy"])
def test_stream_rebuilds_cached_hashes_after_hits_and_evictions(wire):
    eng = _engine()
    pub = KVEventPublisher(
        "tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", wire=wire, flush_interval=3600
    )  # the test flushes by hand
    sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint)
    try:
        pub.attach(eng)
        rebuilt: set = set()
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"r{i}", p, SamplingParams(max_tokens=6, temperature=0))
            if i % 3 == 2:
                while eng.has_unfinished_requests():
                    eng.step()
                    _drain(sub, pub, rebuilt)
                    assert rebuilt == _cached(eng)
        drive(eng)
        _drain(sub, pub, rebuilt)
        eng.check_invariants()
        assert eng.bm.prefix_hits > 0 and eng.bm.evicted_hashes > 0  # the workload hit and evicted
        assert rebuilt == _cached(eng) and rebuilt
        assert sub.state.decode_errors == 0 and sub.state.wires == {wire}
    finally:
        sub.close()
        pub.close()


def test_rebuild_across_replay_after_a_dropped_subscriber():
    eng = _engine()
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", flush_interval=3600)
    sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint)
    try:
        pub.attach(eng)
        rebuilt: set = set()
        for i, p in enumerate(PROMPTS[:4]):
            eng.add_request(f"a{i}", p, SamplingParams(max_tokens=4, temperature=0))
        drive(eng)
        _drain(sub, pub, rebuilt)
        assert rebuilt == _cached(eng)
        seen = sub.state.last_seq
        sub.close()  # dropped: everything published now is lost to it
        for i, p in enumerate(PROMPTS[4:]):
            eng.add_request(f"b{i}", p, SamplingParams(max_tokens=4, temperature=0))
        while eng.has_unfinished_requests():
            eng.step()
            pub.flush()
        assert pub.next_seq - 1 > seen + 1
        sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint)
        sub.state.last_seq = seen  # it resumes where it stopped
        got = sub.replay(seen + 1)
        for _, b in got:
            apply_events(rebuilt, b.events)
        assert [s for s, _ in got] == list(range(seen + 1, pub.next_seq))
        assert sub.state.replayed == len(got) and rebuilt == _cached(eng)
        eng.check_invariants()
    finally:
        sub.close()
        pub.close()


def test_a_late_subscriber_catches_up_from_the_replay_buffer():
    eng = _engine()
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", flush_interval=0.01)
    try:
        pub.attach(eng)
        for i, p in enumerate(PROMPTS[:5]):
            eng.add_request(f"l{i}", p, SamplingParams(max_tokens=3, temperature=0))
        drive(eng)
        pub.flush()
        sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint)  # joins after everything was sent
        got = sub.poll(0)  # no live traffic: replay only
        assert [s for s, _ in got] == list(range(pub.next_seq))
        assert apply_events(set(), [e for _, b in got for e in b.events]) == _cached(eng)
        assert (sub.state.replayed, sub.state.missed) == (pub.next_seq, 0)
        sub.close()
    finally:
        pub.close()


def test_attach_to_an_engine_with_cached_blocks_starts_subscribers_over():
    eng = _engine()
    eng.add_request("x", PROMPTS[0], SamplingParams(max_tokens=2, temperature=0))
    drive(eng)
    assert eng.bm.hash_to_block
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", flush_interval=3600)
    sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint)
    try:
        pub.attach(eng)
        pub.flush()
        got = sub.replay(0)
        assert isinstance(got[0][1].events[0], AllBlocksCleared)
        assert apply_events(set(), [e for _, b in got for e in b.events]) == _cached(eng)
    finally:
        sub.close()
        pub.close()


def test_publisher_rejects_bad_options():
    with pytest.raises(ValueError, match="wire"):
        KVEventPublisher("tcp://127.0.0.1:0", wire="v2")
    with pytest.raises(ValueError, match="endpoint"):
        KVEventPublisher("http://127.0.0.1:5557")


def test_attached_to_an_engine_thread_it_follows_reconfigure():
    from engine import EngineThread

    th = EngineThread(_engine())
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", flush_interval=0.01)
    sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint)
    try:
        pub.attach(th)
        handles = [th.submit(p, SamplingParams(max_tokens=3, temperature=0)) for p in PROMPTS[:4]]
        for h in handles:
            h.result()
        rebuilt: set = set()
        with th.lock:
            expect = _cached(th.engine)
        for _ in range(400):  # bounded: the publisher's thread sends every 10 ms
            for _, b in sub.poll(50):
                apply_events(rebuilt, b.events)
            if rebuilt == expect and rebuilt:
                break
        assert rebuilt == expect and rebuilt
        th.reconfigure(th.engine.config)  # a new engine: subscribers must start over
        cleared = False
        for _ in range(400):
            for _, b in sub.poll(50):
                cleared = cleared or any(isinstance(e, AllBlocksCleared) for e in b.events)
                apply_events(rebuilt, b.events)
            if cleared:
                break
        assert cleared and rebuilt == set()
        th.submit(PROMPTS[5], SamplingParams(max_tokens=3, temperature=0)).result()
        with th.lock:
            expect = _cached(th.engine)
        for _ in range(400):
            for _, b in sub.poll(50):
                apply_events(rebuilt, b.events)
            if rebuilt == expect:
                break
        assert rebuilt == expect and rebuilt
    finally:
        sub.close()
        pub.close()
        th.shutdown()


def test_endpoints_bind_like_vllm_plus_loopback():
    from engine.observe.kv_events import bind_endpoint

    assert bind_endpoint("tcp://*:5557", None) and bind_endpoint("ipc:///tmp/kv", None)
    assert bind_endpoint("tcp://127.0.0.1:5557", None) and bind_endpoint("tcp://localhost:5557", None)
    assert not bind_endpoint("tcp://router.internal:5557", None)  # vLLM connects out to a binding subscriber
    assert not bind_endpoint("tcp://127.0.0.1:5557", False)


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=200)
    | st.builds(
        lambda o: msgpack.packb(o, use_bin_type=True),
        st.recursive(
            st.none() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=12) | st.binary(max_size=8),
            lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c, max_size=5),
            max_leaves=20,
        ),
    )
)
def test_decoder_never_fails_with_anything_but_value_error(data):
    try:
        decode_batch(data)
    except ValueError:
        pass


def test_group_idx_and_extra_keys_in_vllm_033_field_order():
    ev = BlockStored([7, 8], None, [1, 2, 3, 4], 2, None, "GPU", None, [("tenant-a",), None], 0)
    rm = BlockRemoved([7], "GPU", 0)
    legacy = msgpack.unpackb(encode_batch(KVEventBatch(1.0, [ev, rm], 0), "legacy"))
    # array_like: the position is the field (extra_keys before group_idx, as vLLM declares them)
    assert legacy[1][0] == ["BlockStored", [7, 8], None, [1, 2, 3, 4], 2, None, "GPU", None, [["tenant-a"], None], 0]
    assert legacy[1][1] == ["BlockRemoved", [7], "GPU", 0]
    # group_idx set, extra_keys unset: the array carries a null in extra_keys' slot
    only_group = BlockStored([7], None, [1, 2], 2, None, "GPU", None, None, 0)
    assert msgpack.unpackb(encode_batch(KVEventBatch(1.0, [only_group]), "legacy"))[1][0][-2:] == [None, 0]
    current = msgpack.unpackb(encode_batch(KVEventBatch(1.0, [ev, rm, only_group], 0), "current"))
    assert current[1][0]["extra_keys"] == [["tenant-a"], None] and current[1][0]["group_idx"] == 0
    assert current[1][1] == {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0}
    assert "extra_keys" not in current[1][2]  # defaults omitted (msgspec omit_defaults)
    # msgspec with vLLM 0.33's declarations reads them
    msgspec, Current, _, _ = _vllm_structs()
    got = msgspec.msgpack.Decoder(type=Current).decode(encode_batch(KVEventBatch(1.0, [ev, rm], 0), "current"))
    assert got.events[0].group_idx == 0 and got.events[0].extra_keys == [["tenant-a"], None]
    assert got.events[1].group_idx == 0


def _replayed_payloads(replay_endpoint: str) -> list[dict | list]:
    """Every batch a publisher still holds, as msgpack-decoded bytes off its replay socket (vLLM's
    replay request: [b"", start seq]; the reply ends with END_SEQ)."""
    import zmq

    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(replay_endpoint)
        s.send_multipart((b"", (0).to_bytes(8, "big")))
        out = []
        for _ in range(10_000):  # bounded: each reply waits at most 5 s
            assert s.poll(5000), "no reply from the replay socket"
            frames = s.recv_multipart()[1:]  # the empty delimiter
            if frames[-2] == END_SEQ:
                return out
            out.append(msgpack.unpackb(frames[-1], strict_map_key=False))
        raise AssertionError("the replay never ended")
    finally:
        s.close()


def test_published_stores_carry_group_idx_0_and_the_salt_on_the_first_block():
    eng = _engine()
    pub = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", flush_interval=3600)
    try:
        pub.attach(eng)
        eng.add_request("a", list(range(2, 30)), SamplingParams(max_tokens=1, temperature=0, cache_salt="tenant-a"))
        eng.add_request("b", list(range(40, 68)), SamplingParams(max_tokens=1, temperature=0))
        drive(eng)
        pub.flush()
        stores = [e for b in _replayed_payloads(pub.replay_endpoint) for e in b[1] if e["type"] == "BlockStored"]
        salted = [e for e in stores if "extra_keys" in e]
        assert stores and all(e["group_idx"] == 0 for e in stores) and len(salted) == 1
        assert salted[0]["parent_block_hash"] is None
        assert salted[0]["extra_keys"] == [["tenant-a"]] + [None] * (len(salted[0]["block_hashes"]) - 1)
    finally:
        pub.close()
