"""Watch a fleet: per instance, a background thread that applies its KV events (vLLM's ZMQ wire
format, with replay on sequence gaps) to the set of block hashes it caches, and one that scrapes
its /metrics. Nothing here blocks on a slow or dead instance: every HTTP call has a timeout, each
instance has its own threads, and snapshot() only reads what they last stored.

    with FleetCollector(members_of(fleet)) as c:
        c.snapshot()                      # engine.fleet.state.FleetSnapshot
        c.held_prefix(token_ids)          # {engine_id: prefix tokens it holds now}

The tree is keyed by block hash (hex: 16 digits for vLLM's published 64-bit form). Lookups by
content use (parent hash, the block's token ids), so they work whatever hash function the
servers use, as long as their BlockStored events carry token ids.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from engine.fleet.state import FleetSnapshot, InstanceStatus, PrefixTree, StreamHealth, TreeNode
from engine.observe.kv_event_wire import AllBlocksCleared, BlockRemoved, BlockStored
from engine.observe.kv_events import KVEventSubscriber

HTTP_TIMEOUT_S = 2.0
MAX_METRICS_BYTES = 4 * 1024 * 1024

# the vLLM metric names kvscope's /metrics exports (engine/serve/metrics.py); older vLLM spellings after
RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PREEMPTIONS = ("vllm:num_preemptions_total",)
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")


def hash_hex(h) -> str:
    """A published block hash as text: 16 hex digits for an int (vLLM's 64-bit form), hex for bytes."""
    if isinstance(h, int):
        return f"{h & ((1 << 64) - 1):016x}"
    if isinstance(h, (bytes, bytearray)):
        return bytes(h).hex()
    return str(h)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over label sets}. ValueError if it does not parse."""
    from prometheus_client.parser import text_string_to_metric_families

    if len(text) > MAX_METRICS_BYTES:
        raise ValueError(f"metrics page larger than {MAX_METRICS_BYTES} bytes")
    out: dict[str, float] = {}
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.value == s.value:  # not NaN
                    out[s.name] = out.get(s.name, 0.0) + float(s.value)
    except Exception as e:  # the parser raises ValueError, TypeError or IndexError on bad lines
        raise ValueError(f"metrics do not parse as Prometheus text: {type(e).__name__}: {str(e)[:200]}") from None
    return out


def _first(m: dict[str, float], names) -> float | None:
    return next((m[n] for n in names if n in m), None)


def http_json(url: str, method: str = "GET", body: dict | None = None, timeout: float = HTTP_TIMEOUT_S):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def down_reason(e: BaseException) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} from the server"
    if isinstance(e, urllib.error.URLError):
        e = e.reason if isinstance(e.reason, BaseException) else e
    if isinstance(e, ConnectionRefusedError):
        return "connection refused (the process is gone or not listening)"
    if isinstance(e, ConnectionResetError):
        return "connection reset mid-answer (the process was killed or crashed)"
    if isinstance(e, TimeoutError) or "timed out" in str(e):
        return f"no answer within {HTTP_TIMEOUT_S:.0f} s"
    return f"{type(e).__name__}: {str(e)[:200]}"


@dataclass(frozen=True)
class Member:
    engine_id: str
    url: str
    events: str = ""  # tcp://... ("" no event stream)
    replay: str = ""
    kind: str = "kvscope"


def members_of(fleet) -> list[Member]:
    """The members of an engine.fleet.launcher.Fleet."""
    return [Member(i.engine_id, i.url, i.events, i.replay, i.kind) for i in fleet.instances]


class _GapCountingSubscriber(KVEventSubscriber):
    """The subscriber, counting the replays it asks for because of a gap in the seq numbers."""

    gap_replays = 0
    replay_calls_with_batches = 0

    def replay(self, start_seq, upto=None):
        if upto is not None:
            self.gap_replays += 1
        got = super().replay(start_seq, upto)
        if got:
            self.replay_calls_with_batches += 1
        return got


@dataclass
class _InstanceState:
    cached: set = field(default_factory=set)  # hex hashes held now
    nodes: dict = field(default_factory=dict)  # hex -> (parent hex or "", token tuple or None)
    ever_first_blocks: set = field(default_factory=set)  # token tuples of root blocks ever stored
    events: int = 0
    clears: int = 0
    metrics: dict = field(default_factory=dict)
    up: bool = False
    reason: str = "not scraped yet"
    block_size: int | None = None
    num_blocks: int | None = None
    bytes_per_block: int | None = None
    last_ok: float = 0.0
    stream_error: str = ""


class InstanceWatch:
    """One instance's event thread and metrics thread; read with status()."""

    def __init__(self, m: Member, interval_s: float = 0.5, event_block_size: int = 16):
        self.m = m
        self.interval_s = interval_s
        self.event_block_size = event_block_size
        self.lock = threading.Lock()
        self.st = _InstanceState()
        self._stop = threading.Event()
        self._sub: _GapCountingSubscriber | None = None
        self._threads = [threading.Thread(target=self._scrape_loop, name=f"fleet-scrape-{m.engine_id}", daemon=True)]
        if m.events:
            self._threads.append(
                threading.Thread(target=self._event_loop, name=f"fleet-events-{m.engine_id}", daemon=True)
            )

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)

    # -- events
    def apply(self, batch) -> None:
        with self.lock:
            st = self.st
            for e in batch.events:
                st.events += 1
                if isinstance(e, BlockStored):
                    bs = e.block_size or self.event_block_size
                    parent = hash_hex(e.parent_block_hash) if e.parent_block_hash is not None else ""
                    toks = list(e.token_ids or [])
                    have_tokens = len(toks) == bs * len(e.block_hashes)
                    for k, h in enumerate(e.block_hashes):
                        hx = hash_hex(h)
                        block = tuple(toks[k * bs : (k + 1) * bs]) if have_tokens else None
                        old = st.nodes.get(hx)
                        if block is not None or old is None:
                            st.nodes[hx] = (parent, block)
                        if parent == "" and block is not None:
                            st.ever_first_blocks.add(block)
                        st.cached.add(hx)
                        parent = hx
                elif isinstance(e, BlockRemoved):
                    for h in e.block_hashes:
                        st.cached.discard(hash_hex(h))
                elif isinstance(e, AllBlocksCleared):
                    st.cached.clear()
                    st.clears += 1

    def _event_loop(self) -> None:
        try:
            self._sub = _GapCountingSubscriber(self.m.events, self.m.replay or None, replay_timeout_ms=500)
        except Exception as e:  # noqa: BLE001 - a bad endpoint marks the stream, never the collector
            with self.lock:
                self.st.stream_error = f"{type(e).__name__}: {e}"
            return
        sub = self._sub
        try:
            while not self._stop.is_set():
                try:
                    got = sub.poll(timeout_ms=100)
                except Exception as e:  # noqa: BLE001
                    with self.lock:
                        self.st.stream_error = f"{type(e).__name__}: {str(e)[:200]}"
                    time.sleep(0.2)
                    continue
                for _, batch in got:
                    self.apply(batch)
        finally:
            sub.close()

    # -- metrics
    def scrape_once(self) -> None:
        url = self.m.url
        try:
            with urllib.request.urlopen(url + "/metrics", timeout=HTTP_TIMEOUT_S) as r:
                text = r.read(MAX_METRICS_BYTES + 1).decode("utf-8", "replace")
            metrics = parse_metrics(text)
        except Exception as e:  # noqa: BLE001 - any failure marks the instance down, with the reason
            with self.lock:
                self.st.up, self.st.reason = False, down_reason(e)
            return
        info = None
        if self.st.block_size is None and self.m.kind == "kvscope":
            try:
                info = http_json(url + "/v1/kvscope/snapshot").get("info") or {}
            except Exception:  # noqa: BLE001 - optional
                info = None
        with self.lock:
            st = self.st
            st.metrics, st.up, st.reason, st.last_ok = metrics, True, "", time.time()
            if info:
                st.block_size = info.get("block_size")
                st.num_blocks = info.get("num_blocks")
                st.bytes_per_block = info.get("bytes_per_block")

    def _scrape_loop(self) -> None:
        while not self._stop.is_set():
            self.scrape_once()
            self._stop.wait(self.interval_s)

    # -- reads
    def status(self) -> InstanceStatus:
        sub = self._sub
        with self.lock:
            st = self.st
            m = st.metrics
            q, h = _first(m, PREFIX_QUERIES), _first(m, PREFIX_HITS)
            health = StreamHealth(
                connected=sub is not None and not st.stream_error,
                encoding=",".join(sorted(sub.state.wires)) if sub is not None else "",
                batches=sub.state.batches if sub is not None else 0,
                events=st.events,
                last_seq=sub.state.last_seq if sub is not None else -1,
                seq_gaps=sub.gap_replays if sub is not None else 0,
                replays=sub.replay_calls_with_batches if sub is not None else 0,
                replayed_batches=sub.state.replayed if sub is not None else 0,
                clears=st.clears,
                missed=sub.state.missed if sub is not None else 0,
                error=st.stream_error or ((sub.state.last_error or "") if sub is not None else ""),
            )
            up = st.up
            return InstanceStatus(
                url=self.m.url,
                engine_id=self.m.engine_id,
                kind=self.m.kind,
                up=up,
                reason=st.reason,
                kv_usage=_first(m, KV_USAGE) if up else None,
                running=int(v) if up and (v := _first(m, RUNNING)) is not None else None,
                waiting=int(v) if up and (v := _first(m, WAITING)) is not None else None,
                prefix_hit_rate=(h / q) if up and q else None,
                prefix_queries=q,
                prefix_hits=h,
                preemptions=int(v) if (v := _first(m, PREEMPTIONS)) is not None else None,
                block_size=st.block_size or self.event_block_size,
                num_blocks=st.num_blocks,
                cached_blocks=len(st.cached),
                stream=health,
            )

    def cached(self) -> set[str]:
        with self.lock:
            return set(self.st.cached)

    def nodes(self) -> dict:
        with self.lock:
            return dict(self.st.nodes)


class FleetCollector:
    def __init__(
        self,
        members: list[Member],
        *,
        router_url: str = "",
        policy: str = "",
        interval_s: float = 0.5,
        block_size: int = 16,
    ):
        ids = [m.engine_id for m in members]
        if len(set(ids)) != len(ids):
            raise ValueError(f"members: engine ids must be unique, got {ids}")
        self.block_size = block_size
        self.router_url = router_url
        self.policy = policy
        self.watches = {m.engine_id: InstanceWatch(m, interval_s, block_size) for m in members}
        self.t0 = time.time()
        self.snapshots: list[FleetSnapshot] = []

    def start(self) -> FleetCollector:
        for w in self.watches.values():
            w.start()
        return self

    def stop(self) -> None:
        for w in self.watches.values():
            w.stop()

    def __enter__(self) -> FleetCollector:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- the tree
    def tree(self) -> PrefixTree:
        nodes: dict[str, tuple] = {}
        holders: dict[str, set] = {}
        bpb = None
        for eid, w in self.watches.items():
            cached = w.cached()
            wn = w.nodes()
            bpb = bpb or w.st.bytes_per_block
            for hx in cached:
                holders.setdefault(hx, set()).add(eid)
                parent, toks = wn.get(hx, ("", None))
                if hx not in nodes or (nodes[hx][1] is None and toks is not None):
                    nodes[hx] = (parent, toks)

        parents = {hx: p for w in self.watches.values() for hx, (p, _) in w.nodes().items()}

        def depth(hx: str) -> int:
            d, cur = 0, parents.get(hx, "")
            while cur:
                if cur not in parents or d > len(parents):
                    return -1  # the chain reaches a block this collector never saw stored
                d += 1
                cur = parents[cur]
            return d

        out = tuple(
            TreeNode(hx, p, len(t) if t is not None else self.block_size, tuple(holders[hx]), depth(hx))
            for hx, (p, t) in sorted(nodes.items())
        )
        dup = sum(len(n.holders) - 1 for n in out)
        return PrefixTree(out, dup, dup * bpb if bpb else None, bpb)

    def snapshot(self, record: bool = False) -> FleetSnapshot:
        snap = FleetSnapshot(
            t=round(time.time() - self.t0, 3),
            instances=tuple(w.status() for w in self.watches.values()),
            tree=self.tree(),
            router=self.router_url,
            policy=self.policy,
        )
        if record:
            self.snapshots.append(snap)
        return snap

    # -- per-request questions
    def _content_index(self) -> dict:
        idx: dict = {}
        for w in self.watches.values():
            for hx, (parent, toks) in w.nodes().items():
                if toks is not None:
                    idx[(parent, toks)] = hx
        return idx

    def held_prefix(self, token_ids: list[int]) -> dict[str, int]:
        """{engine_id: tokens of this prompt's leading full blocks the instance holds now}."""
        idx = self._content_index()
        bs = self.block_size
        chain: list[str] = []
        parent = ""
        for k in range(len(token_ids) // bs):
            hx = idx.get((parent, tuple(token_ids[k * bs : (k + 1) * bs])))
            if hx is None:
                break
            chain.append(hx)
            parent = hx
        out = {}
        for eid, w in self.watches.items():
            cached = w.cached()
            n = 0
            for hx in chain:
                if hx not in cached:
                    break
                n += 1
            out[eid] = n * bs
        return out

    def forget_history(self) -> None:
        """Start the "ever stored" record afresh (a new measured run)."""
        for w in self.watches.values():
            with w.lock:
                w.st.ever_first_blocks = {
                    w.st.nodes[h][1] for h in w.st.cached if h in w.st.nodes and w.st.nodes[h][0] == ""
                } - {None}

    def ever_stored(self, token_ids: list[int]) -> bool:
        """Whether any instance ever stored this prompt's first block (since the collector started)."""
        first = tuple(token_ids[: self.block_size])
        if len(first) < self.block_size:
            return False
        return any(first in w.st.ever_first_blocks for w in self.watches.values())

    def verify(self, engine_id: str) -> tuple[set[str], set[str]]:
        """(the hashes rebuilt from events, the hashes the server lists at /v1/kvscope/cached_blocks)."""
        w = self.watches[engine_id]
        server = set(http_json(w.m.url + "/v1/kvscope/cached_blocks")["hashes"])
        return w.cached(), server

    def wait_quiet(self, timeout_s: float = 5.0, settle_s: float = 0.3) -> None:
        """Wait (bounded) until no instance's event count changed for settle_s."""
        end = time.monotonic() + timeout_s
        last = None
        last_change = time.monotonic()
        while time.monotonic() < end:
            cur = tuple(w.st.events for w in self.watches.values())
            if cur != last:
                last, last_change = cur, time.monotonic()
            elif time.monotonic() - last_change >= settle_s:
                return
            time.sleep(0.05)


__all__ = ["FleetCollector", "InstanceWatch", "Member", "hash_hex", "members_of", "parse_metrics"]
