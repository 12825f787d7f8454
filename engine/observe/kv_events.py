"""KV cache events in vLLM's wire format: publish the engine's prefix-cache changes over ZeroMQ,
and read them back (from kvscope or from a vLLM started with `--kv-events-config`).

The wire format itself (event types, msgpack encoding of both generations, replay framing) is
engine/observe/kv_event_wire.py; this module owns the sockets.

kvscope's events come from the block manager's hash index: "stored" when a full block's hash
enters it, "removed" when it leaves (the block was popped from the free queue for new content,
rewritten, or evicted by hand). Applying the stream in order rebuilds the engine's set of cached
block hashes (`apply_events`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from engine.observe.kv_event_wire import (
    END_SEQ,
    MEDIUM_GPU,
    WIRES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    published_hash,
)

# ---------------------------------------------------------------- publisher


@dataclass(frozen=True)
class PublisherInfo:
    """A publisher's endpoints and settings as its server reports them (the publisher itself may
    live in the engine core's process). close() is a no-op: the core closes its publisher."""

    endpoint: str
    replay_endpoint: str | None
    topic: bytes
    buffer_steps: int
    hwm: int
    wire: str

    def close(self) -> None:
        pass


def open_publisher(endpoint: str, replay_endpoint: str | None = None, wire: str = "current", **kw):
    """A KVEventPublisher on `endpoint`, or a ValueError that names the option and the cause
    (`--kv-events-endpoint tcp://...: ZMQError: Address already in use`), as `engine serve`
    reports it, whether the publisher opens in its process or in the engine core's."""
    try:
        return KVEventPublisher(endpoint, replay_endpoint=replay_endpoint, wire=wire, **kw)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. zmq: address already in use
        raise ValueError(f"--kv-events-endpoint {endpoint}: {type(e).__name__}: {e}") from None


def vllm_publisher_binds(endpoint: str) -> bool:
    """vLLM's ZmqEventPublisher binds its PUB socket to a wildcard / ipc / inproc endpoint and
    CONNECTS to any other one (tcp://127.0.0.1:5557 included): then the consumer must bind."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def bind_endpoint(endpoint: str, bind: bool | None) -> bool:
    """vLLM's rule (`vllm_publisher_binds`), except that kvscope also binds loopback tcp endpoints
    (tcp://127.0.0.1:5557), so a subscriber can connect to them."""
    if bind is not None:
        return bind
    if vllm_publisher_binds(endpoint):
        return True
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
    return host in ("127.0.0.1", "localhost", "[::1]")


class KVEventPublisher:
    """Publishes an engine's prefix-cache changes as vLLM's KV events.

        pub = KVEventPublisher("tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5558")
        pub.attach(engine_thread)      # or an LLMEngine; call before requests run
        ...
        pub.close()

    attach() asks the engine to queue its KV events (the block manager queues them, as vLLM's block
    pool does; LLMEngine.take_kv_events drains them stamped with their step); the publisher's own
    thread takes and sends what accumulated every `flush_interval` seconds, one KVEventBatch per engine step
    (so batches and seq numbers follow the steps). Given an EngineThread it follows
    `reconfigure()` (a new engine): it publishes AllBlocksCleared and listens to the new one.
    `flush()` sends everything pending now (tests, shutdown).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        wire: str = "current",
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        bind: bool | None = None,
        flush_interval: float = 0.02,
        data_parallel_rank: int = 0,
        medium: str | None = MEDIUM_GPU,
        first_seq: int = 0,
    ):
        """first_seq: the seq number of the first batch (a publisher that replaces another one,
        as an engine core process rebuilt with a new engine does, continues its numbering)."""
        import zmq

        if wire not in WIRES:
            raise ValueError(f"kv events wire format must be one of {WIRES}, got {wire!r}")
        if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"kv events endpoint must be tcp://HOST:PORT, ipc:// or inproc://, got {endpoint!r}")
        if not isinstance(buffer_steps, int) or buffer_steps < 1:
            raise ValueError("buffer_steps must be a positive integer")
        self.wire = wire
        self.buffer_steps, self.hwm = buffer_steps, hwm  # reported by /kv_event_sources
        self.topic = topic.encode("utf-8")
        self.medium = medium
        self.data_parallel_rank = data_parallel_rank
        self.flush_interval = flush_interval
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if bind_endpoint(endpoint, bind):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self._replay = None
        self.replay_endpoint = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._pending: list[tuple[int, str, bytes, bytes | None, list | None, tuple | None]] = []
        self._lock = threading.Lock()  # guards _pending (flush() may run on a caller's thread)
        self._sock_lock = threading.Lock()  # sockets are used by one thread at a time
        self._seq = int(first_seq)
        self._engine = None
        self._owner = None  # the EngineThread, when attached through one
        self.block_size = 0
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="kvscope-kv-events", daemon=True)
        self._thread.start()

    # -- engine side
    def attach(self, target, cleared: bool = False) -> None:
        """Listen to an LLMEngine's (or an EngineThread's current engine's) block manager.
        cleared: publish AllBlocksCleared first (this engine replaces one whose blocks a
        subscriber may still hold)."""
        engine = getattr(target, "engine", None) if hasattr(target, "submit") else target
        if engine is None or not hasattr(engine, "bm"):
            raise ValueError("attach() needs an LLMEngine or an EngineThread")
        self._owner = target if engine is not target else None
        if self._owner is not None:
            with self._owner.lock:
                self._listen(self._owner.engine, cleared)
        else:
            self._listen(engine, cleared)

    def _listen(self, engine, cleared: bool = False) -> None:
        old = self._engine
        if old is not None:
            self.collect(old)  # what the old engine queued before it was replaced
            old.disable_kv_events()
        self.block_size = engine.bm.block_size
        cached = engine.enable_kv_events()
        if old is not None or cached or cleared:
            # a new engine, or one that cached blocks before we listened: subscribers start over
            # then every block cached now, with its parent, tokens and extra keys (as when it was
            # stored: a consumer that checks batches strictly gets whole BlockStored events)
            with self._lock:
                self._append([(engine.step_num, "cleared", b"", None, None, None), *cached])
        self._engine = engine

    def collect(self, engine=None) -> None:
        """Take what the engine (default: the attached one) queued into the pending batches; the
        publisher's thread does it before every flush."""
        engine = engine if engine is not None else self._engine
        if engine is None:
            return
        with self._lock:  # taken and queued in one go: two takers keep the engine's order
            self._append(engine.take_kv_events())

    def _append(self, events) -> None:  # with _lock held
        for step, kind, h, parent, tokens, extra in events:
            self._pending.append((step, kind, h, parent, list(tokens) if tokens is not None else None, extra))

    # -- batches
    def _batches(self, pending) -> list[KVEventBatch]:
        """Group pending hash changes into one batch per engine step; consecutive stores of one
        chain merge into one BlockStored, consecutive removals into one BlockRemoved."""
        batches: list[KVEventBatch] = []
        cur_step = None
        for step, kind, h, parent, tokens, extra in pending:
            if step != cur_step:
                batches.append(KVEventBatch(time.time(), [], self.data_parallel_rank))
                cur_step = step
            evs = batches[-1].events
            last = evs[-1] if evs else None
            if kind == "stored":
                xh = published_hash(h)
                xp = published_hash(parent) if parent is not None else None
                toks = tokens or []
                if (
                    isinstance(last, BlockStored)
                    and tokens is not None
                    and len(last.token_ids) > 0
                    and xp is not None
                    and last.block_hashes[-1] == xp
                ):
                    last.block_hashes.append(xh)
                    last.token_ids.extend(toks)
                    if extra is not None or last.extra_keys is not None:
                        last.extra_keys = (last.extra_keys or [None] * (len(last.block_hashes) - 1)) + [extra]
                else:
                    ev = BlockStored([xh], xp, toks, self.block_size, None, self.medium, None, group_idx=0)
                    ev.extra_keys = [extra] if extra is not None else None
                    evs.append(ev)
            elif kind == "removed":
                if isinstance(last, BlockRemoved):
                    last.block_hashes.append(published_hash(h))
                else:
                    evs.append(BlockRemoved([published_hash(h)], self.medium, group_idx=0))
            else:
                evs.append(AllBlocksCleared())
        return batches

    def flush(self) -> int:
        """Send every pending change now; returns the number of batches sent."""
        if self._engine is not None:
            self.collect(self._engine)
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return 0
        batches = self._batches(pending)
        with self._sock_lock:
            for b in batches:
                payload = encode_batch(b, self.wire)
                seq = self._seq
                self._seq += 1
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
        return len(batches)

    @property
    def next_seq(self) -> int:
        return self._seq

    def info(self) -> "PublisherInfo":
        """What /kv_event_sources and /get_server_info report of this publisher (plain data: it
        crosses the engine core's process boundary)."""
        return PublisherInfo(self.endpoint, self.replay_endpoint, self.topic, self.buffer_steps, self.hwm, self.wire)

    # -- replay
    def _service_replay(self) -> None:
        import zmq

        while self._replay.poll(0):
            frames = self._replay.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 3:
                continue  # not [identity, b"", start seq]: ignore, as vLLM does
            ident, _, start = frames
            if len(start) != 8:
                continue
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    body = (seq.to_bytes(8, "big"), payload)
                    if self.wire == "current":
                        body = (self.topic, *body)
                    self._replay.send_multipart((ident, b"", *body))
            end = (END_SEQ, b"") if self.wire == "legacy" else (b"", END_SEQ, b"")
            self._replay.send_multipart((ident, b"", *end))

    def _loop(self) -> None:
        next_flush = time.monotonic() + self.flush_interval
        while self._running:
            owner = self._owner
            if owner is not None and owner.engine is not self._engine:
                with owner.lock:  # EngineThread.reconfigure swapped engines
                    self._listen(owner.engine)
            if time.monotonic() >= next_flush:
                self.flush()
                next_flush = time.monotonic() + self.flush_interval
            if self._replay is not None:
                with self._sock_lock:
                    self._service_replay()
            time.sleep(min(self.flush_interval, 0.01))

    def close(self) -> None:
        if not self._running:
            return
        self._running = False
        self._thread.join(timeout=5)
        if self._engine is not None:
            self._engine.disable_kv_events()
        self.flush()
        with self._sock_lock:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)


# ---------------------------------------------------------------- subscriber


@dataclass(slots=True)
class SubscriberState:
    last_seq: int = -1
    batches: int = 0
    replayed: int = 0
    missed: int = 0  # seq numbers neither received nor replayed
    decode_errors: int = 0
    last_error: str | None = None
    wires: set = field(default_factory=set)


class KVEventSubscriber:
    """SUB (+ optional replay DEALER) client for vLLM's or kvscope's KV events. `poll()` returns
    the batches that arrived, in seq order; on a gap it asks the replay socket for the missing
    ones first (bounded wait). Not thread-safe: one thread polls.

    bind=False connects the SUB socket to a publisher that bound `endpoint`; bind=True binds it,
    for a vLLM whose publisher connects to a concrete endpoint (`vllm_publisher_binds` is False).
    The replay socket always connects: the publisher binds its ROUTER."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout_ms: int = 1000,
        *,
        bind: bool = False,
    ):
        import zmq

        if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"KV events endpoint must look like tcp://HOST:PORT, got {str(endpoint)[:80]!r}")
        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        if bind:
            self._sub.bind(endpoint)
        else:
            self._sub.connect(endpoint)
        self.bound = bind
        self._replay = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(replay_endpoint)
        self.replay_timeout_ms = replay_timeout_ms
        self.state = SubscriberState()
        self.replay_complete = False
        self._caught_up = self._replay is None
        self._next_catch_up = 0.0
        self.catch_up_retry_s = 5.0
        # PUB/SUB drops what is published before the subscription reaches the publisher (a
        # publisher that connects to this side does so some time after the bind), and a lost
        # last batch leaves no gap to notice: while nothing arrives, ask the replay socket for
        # anything after last_seq every idle_replay_s.
        self.idle_replay_s = 2.0
        self._next_idle_replay = time.monotonic() + self.idle_replay_s

    def _decode(self, seq: int, payload: bytes, out: list) -> None:
        try:
            b = decode_batch(payload)
        except ValueError as e:
            self.state.decode_errors += 1
            self.state.last_error = f"seq {seq}: {e}"
        else:
            self.state.wires.add(b.wire)
            out.append((seq, b))
        self.state.last_seq = seq
        self.state.batches += 1

    def replay(self, start_seq: int, upto: int | None = None) -> list[tuple[int, KVEventBatch]]:
        """Ask the replay socket for batches from start_seq (until the end marker or upto)."""
        out: list = []
        self.replay_complete = False
        if self._replay is None:
            return out
        self._replay.send_multipart((b"", max(0, start_seq).to_bytes(8, "big")))
        for _ in range(1_000_000):
            if not self._replay.poll(self.replay_timeout_ms):
                break
            frames = self._replay.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) == 3:  # current: topic, seq, payload
                frames = frames[1:]
            if len(frames) != 2:
                continue
            seq = int.from_bytes(frames[0], "big", signed=True)
            if seq < 0:
                self.replay_complete = True
                break
            if seq > self.state.last_seq and (upto is None or seq < upto):
                if seq > self.state.last_seq + 1 and self.state.last_seq >= 0:
                    self.state.missed += seq - self.state.last_seq - 1  # fell out of the replay buffer
                self._decode(seq, frames[1], out)
                self.state.replayed += 1
        return out

    def poll(self, timeout_ms: int = 0, max_messages: int = 10_000) -> list[tuple[int, KVEventBatch]]:
        out: list = []
        zmq = self._zmq
        if not self._caught_up and time.monotonic() >= self._next_catch_up:
            # a subscriber that joins late first fetches what the publisher still buffers, so the
            # cache it rebuilds starts from the publisher's history, not from whenever it connected;
            # retried every catch_up_retry_s until the replay socket answers with its end marker
            out.extend(self.replay(self.state.last_seq + 1))
            self._caught_up = self.replay_complete
            self._next_catch_up = time.monotonic() + self.catch_up_retry_s
        for _ in range(max_messages):
            if not self._sub.poll(timeout_ms if not out else 0):
                break
            frames = self._sub.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 3 or len(frames[1]) != 8:
                self.state.decode_errors += 1
                self.state.last_error = f"unexpected message with {len(frames)} frames"
                continue
            seq = int.from_bytes(frames[1], "big")
            if seq <= self.state.last_seq:
                continue
            if seq > self.state.last_seq + 1:
                got = self.replay(self.state.last_seq + 1, upto=seq)
                out.extend(got)
                if seq > self.state.last_seq + 1:
                    self.state.missed += seq - self.state.last_seq - 1
            self._decode(seq, frames[2], out)
        now = time.monotonic()
        if out:
            self._next_idle_replay = now + self.idle_replay_s
        elif self._replay is not None and self._caught_up and now >= self._next_idle_replay:
            out.extend(self.replay(self.state.last_seq + 1))
            self._next_idle_replay = now + self.idle_replay_s
        return out

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
