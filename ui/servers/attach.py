"""Attach to a live server: a kvscope `serve` (its snapshot stream) or a vLLM (its /metrics in
vLLM's names and its ZeroMQ KV events). No Streamlit here: the Attach page owns one
`AttachSession` per browser session and draws what it collected.

An AttachSession runs two daemon threads, both bounded: they stop on `stop()`, when the page has
not called `touch()` for `idle_timeout` seconds (the page was closed or left), or after
`max_runtime` seconds. Scrapes happen every `interval` seconds (1 s: >= 1 Hz); the history keeps
the last `history_len` scrapes; HTTP bodies are read up to a size cap.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque

from engine.observe.kv_events import KVEventSubscriber, vllm_publisher_binds
from engine.observe.recording import append_snapshot, slim_snapshot
from engine.observe.trace_events import Event, event_from_dict, snapshot_from_dict
from ui.figures import vllm_metrics as vm
from ui.figures.prefix_tree import PrefixTree

MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_SSE_LINE = 32 * 1024 * 1024
STREAM_READ_TIMEOUT = 15.0
PROBE_TEXT = "KV cache blocks: <b>&amp;</b> ünïcode 123"
EVENT_MODES = ("auto", "bind", "connect")


def normalise_base_url(url: str) -> str:
    """'http://host:8000' (a trailing /v1 or / is dropped). ValueError naming the field."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError("base URL: enter the server's address, e.g. http://127.0.0.1:8000")
    url = url.strip()
    if len(url) > 2000:
        raise ValueError("base URL: longer than 2000 characters")
    p = urllib.parse.urlsplit(url)
    if p.scheme not in ("http", "https") or not p.hostname:
        raise ValueError(f"base URL: expected http://HOST:PORT or https://HOST:PORT, got {url[:80]!r}")
    try:
        _ = p.port
    except ValueError:
        raise ValueError(f"base URL: the port is not a number in [0, 65535] ({url[:80]!r})") from None
    path = p.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return urllib.parse.urlunsplit((p.scheme, p.netloc, path, "", ""))


def _request(url: str, api_key: str | None, data: bytes | None = None):
    headers = {"Accept": "*/*"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    if data is not None:
        headers["Content-Type"] = "application/json"
    return urllib.request.Request(url, data=data, headers=headers)


def http_get(
    url: str, api_key: str | None = None, timeout: float = 5.0, max_bytes: int = MAX_BODY_BYTES
) -> tuple[int, bytes]:
    """(status, body) — body cut at max_bytes. Network errors raise OSError."""
    try:
        with urllib.request.urlopen(_request(url, api_key), timeout=timeout) as r:
            return r.status, r.read(max_bytes)
    except urllib.error.HTTPError as e:
        return e.code, e.read(64 * 1024)


def detect_kind(base_url: str, api_key: str | None = None, timeout: float = 5.0) -> tuple[str, str]:
    """('kvscope' | 'vllm', why). ValueError when the server answers neither way (with why)."""
    try:
        status, body = http_get(base_url + "/v1/kvscope/snapshot", api_key, timeout)
    except OSError as e:
        raise ValueError(f"cannot reach {base_url}: {e}") from None
    if status == 401:
        raise ValueError("the server wants an API key (401 Unauthorized): enter it above")
    if status == 200:
        try:
            snapshot_from_dict(json.loads(body))
            return "kvscope", "GET /v1/kvscope/snapshot answered with a snapshot"
        except (ValueError, TypeError):
            pass
    try:
        status, body = http_get(base_url + "/metrics", api_key, timeout)
    except OSError as e:
        raise ValueError(f"cannot reach {base_url}/metrics: {e}") from None
    if status == 401:
        raise ValueError("the server wants an API key (401 Unauthorized): enter it above")
    if status != 200:
        raise ValueError(f"{base_url}/metrics answered HTTP {status}; not a kvscope or vLLM server")
    text = body.decode("utf-8", "replace")
    if "vllm:" not in text:
        raise ValueError(f"{base_url}/metrics has no metric named vllm:…; not a vLLM-compatible server")
    return "vllm", "GET /metrics has vLLM's metric names"


def tokenizer_matches(base_url: str, api_key: str | None, tokenizer, timeout: float = 5.0) -> tuple[bool, str]:
    """Ask the server to tokenize a probe text (vLLM's POST /tokenize) and compare with ours."""
    if tokenizer is None:
        return False, "no local tokenizer"
    body = json.dumps({"prompt": PROBE_TEXT, "add_special_tokens": False}).encode()
    try:
        with urllib.request.urlopen(_request(base_url + "/tokenize", api_key, body), timeout=timeout) as r:
            theirs = json.loads(r.read(1024 * 1024)).get("tokens")
    except (OSError, ValueError, AttributeError) as e:
        return False, f"the server's /tokenize could not be used ({type(e).__name__})"
    ours = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    if theirs == list(ours):
        return True, "the server tokenizes a probe text exactly as the local tokenizer does"
    return False, "the server's tokenizer differs from the local one"


def kv_event_sources(base_url: str, api_key: str | None = None, timeout: float = 5.0) -> list[dict] | None:
    """vLLM's GET /kv_event_sources: one entry per data-parallel rank, each {data_parallel_rank,
    endpoint, replay_endpoint, topic} as configured by --kv-events-config. vLLM 0.33 answers a
    list of those; vLLM CPU 0.32 answers an object keyed by rank whose values are the whole
    KVEventsConfig (seen on a live server); both are read. None when the server has no such route
    (older vLLM, kvscope) or answers something else."""
    try:
        status, body = http_get(base_url + "/kv_event_sources", api_key, timeout, max_bytes=256 * 1024)
        obj = json.loads(body) if status == 200 else None
    except (OSError, ValueError):
        return None
    if isinstance(obj, dict):  # vLLM 0.32: {"0": KVEventsConfig fields, ...} keyed by rank
        obj = [
            dict(v, data_parallel_rank=int(k)) for k, v in sorted(obj.items()) if isinstance(v, dict) and k.isdigit()
        ]
    if not isinstance(obj, list):
        return None
    return [d for d in obj if isinstance(d, dict) and isinstance(d.get("endpoint"), str)] or None


def reachable_endpoint(endpoint: str, base_url: str) -> str:
    """A wildcard endpoint the server bound (tcp://*:5557) as this side reaches it: the base
    URL's host (tcp://127.0.0.1:5557). Other endpoints are returned as they are."""
    if endpoint.startswith("tcp://*:"):
        host = urllib.parse.urlsplit(base_url).hostname or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return f"tcp://{host}:{endpoint.rsplit(':', 1)[1]}"
    return endpoint


def events_socket_mode(mode: str, kind: str, server_endpoint: str) -> tuple[bool, str]:
    """(bind?, why) for the SUB socket. "auto": against vLLM, bind exactly when vLLM's publisher
    connects (a concrete endpoint such as tcp://127.0.0.1:5557); kvscope's publisher binds, so
    connect to it."""
    if mode not in EVENT_MODES:
        raise ValueError(f"KV events socket: expected one of {', '.join(EVENT_MODES)}, got {str(mode)[:40]!r}")
    if mode != "auto":
        return mode == "bind", f"{mode} (chosen)"
    if kind == "vllm" and not vllm_publisher_binds(server_endpoint):
        return True, f"bind: vLLM connects its publisher to the concrete endpoint {server_endpoint}"
    return False, "connect: the server binds its publisher"


def iter_sse(lines):
    """Server-sent events: yield each event's data (data: lines joined by newlines)."""
    buf: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        line = line.rstrip("\r\n")
        if not line:
            if buf:
                yield "\n".join(buf)
                buf = []
            continue
        if line.startswith(":"):
            continue
        if line.startswith("data:"):
            buf.append(line[5:].removeprefix(" "))
    if buf:
        yield "\n".join(buf)


def parse_stream_message(data: str):
    """One kvscope stream message -> (Snapshot | None, [Event]). ValueError if malformed."""
    try:
        obj = json.loads(data)
    except json.JSONDecodeError as e:
        raise ValueError(f"stream message is not JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError("stream message: expected an object {snapshot, events}")
    snap = snapshot_from_dict(obj["snapshot"]) if obj.get("snapshot") is not None else None
    evs = obj.get("events") or []
    if not isinstance(evs, list):
        raise ValueError("stream message: events must be a list")
    return snap, [event_from_dict(e) for e in evs]


class AttachSession:
    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        events_endpoint: str | None = None,
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        events_mode: str = "auto",
        kind: str | None = None,
        interval: float = 1.0,
        idle_timeout: float = 30.0,
        max_runtime: float = 4 * 3600,
        history_len: int = 900,
        window_s: float = 10.0,
        tokenizer=None,
    ):
        self.base_url = normalise_base_url(base_url)
        self.api_key = api_key or None
        if events_endpoint:
            if not events_endpoint.startswith(("tcp://", "ipc://")):
                raise ValueError(f"KV events endpoint: expected tcp://HOST:PORT, got {events_endpoint[:80]!r}")
        if not 0.05 <= interval <= 1.0:
            raise ValueError("scrape interval must be in [0.05, 1.0] seconds (at least 1 Hz)")
        self.events_endpoint = events_endpoint or None
        self.replay_endpoint = replay_endpoint or None
        self.topic = topic
        self.interval = interval
        self.idle_timeout = idle_timeout
        self.max_runtime = max_runtime
        self.window_s = window_s
        self.tokenizer = tokenizer
        self.lock = threading.Lock()
        self.kind, self.kind_reason = (kind, "given") if kind else detect_kind(self.base_url, self.api_key)
        # vLLM lists its configured KV-event endpoints: fill in what the form left empty
        self.event_sources = kv_event_sources(self.base_url, self.api_key) if self.kind == "vllm" else None
        server_endpoint = self.events_endpoint
        if self.event_sources:
            src = self.event_sources[0]
            if not self.events_endpoint:
                server_endpoint = src["endpoint"]
                self.events_endpoint = reachable_endpoint(server_endpoint, self.base_url)
                if not self.replay_endpoint and isinstance(src.get("replay_endpoint"), str):
                    self.replay_endpoint = reachable_endpoint(src["replay_endpoint"], self.base_url)
                if not self.topic and isinstance(src.get("topic"), str):
                    self.topic = src["topic"]
        self.events_bind, self.events_mode_reason = events_socket_mode(
            events_mode, self.kind, server_endpoint or self.events_endpoint or ""
        )
        self.started = time.monotonic()
        self._touched = self.started
        self._stop = threading.Event()
        # vLLM side
        self.history: deque[vm.Scrape] = deque(maxlen=history_len)
        self.scrape_errors = 0
        self.last_error: str | None = None
        self.tree = PrefixTree()
        self.event_batches = 0
        self.event_state = None
        self.event_error: str | None = None
        self.tokenizer_ok, self.tokenizer_reason = False, "not checked"
        # kvscope side
        self.snapshot = None
        self.series: list = []
        self.events: deque[Event] = deque(maxlen=2000)
        self.last_event_seq = 0
        self.stream_mode = None
        self.stopped_by_user = False
        self.resumes = 0
        self._threads: list[threading.Thread] = []
        self._start_threads()

    def _start_threads(self) -> None:
        self._threads = [threading.Thread(target=self._run_http, name="kvscope-attach-http", daemon=True)]
        if self.events_endpoint:
            self._threads.append(threading.Thread(target=self._run_events, name="kvscope-attach-kv", daemon=True))
        for t in self._threads:
            t.start()

    # -- lifetime
    def touch(self) -> None:
        self._touched = time.monotonic()

    def stop(self) -> None:
        self.stopped_by_user = True
        self._stop.set()

    def resume(self) -> bool:
        """Start reading again after an idle stop (a browser tab in the background stops the
        page's refreshes), keeping the history, the tree and the event seq reached. False when
        it is still running or was stopped by the user."""
        if self.alive or self.stopped_by_user:
            return False
        self._stop.clear()
        self.started = self._touched = time.monotonic()
        self.resumes += 1
        self._start_threads()
        return True

    def join(self, timeout: float = 10.0) -> None:
        for t in self._threads:
            t.join(timeout)

    @property
    def alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def _should_run(self) -> bool:
        now = time.monotonic()
        if self._stop.is_set():
            return False
        if now - self._touched > self.idle_timeout or now - self.started > self.max_runtime:
            self._stop.set()
            return False
        return True

    # -- HTTP: scrape /metrics (vLLM) or read the snapshot stream (kvscope)
    def _run_http(self) -> None:
        if self.kind == "vllm":
            if self.tokenizer is not None:
                ok, why = tokenizer_matches(self.base_url, self.api_key, self.tokenizer)
                with self.lock:
                    self.tokenizer_ok, self.tokenizer_reason = ok, why
            while self._should_run():
                t0 = time.monotonic()
                self._scrape_once()
                self._stop.wait(max(0.0, self.interval - (time.monotonic() - t0)))
        else:
            while self._should_run():
                if not self._read_stream():
                    self._poll_snapshot()
                self._stop.wait(self.interval)  # between reconnects too: never a tight loop

    def _scrape_once(self) -> None:
        try:
            status, body = http_get(self.base_url + "/metrics", self.api_key, timeout=max(1.0, self.interval * 3))
            if status != 200:
                raise ValueError(f"/metrics answered HTTP {status}")
            s = vm.parse_metrics(body.decode("utf-8", "replace"), time.monotonic())
        except (OSError, ValueError) as e:
            with self.lock:
                self.scrape_errors += 1
                self.last_error = f"{type(e).__name__}: {str(e)[:200]}"
            return
        with self.lock:
            self.history.append(s)
            self.last_error = None

    def _apply_kvscope(self, snap, evs) -> None:
        with self.lock:
            if snap is not None:
                self.snapshot = snap
                self.series = append_snapshot(self.series, slim_snapshot(snap))
            for e in evs:
                if e.seq > self.last_event_seq:
                    self.events.append(e)
                    self.last_event_seq = e.seq

    def _read_stream(self) -> bool:
        """Follow GET /v1/kvscope/stream?since=N until it ends, errors or we stop. False if the
        server has no stream (then the caller polls /v1/kvscope/snapshot)."""
        url = f"{self.base_url}/v1/kvscope/stream?since={self.last_event_seq}"
        try:
            # the server sends a keepalive comment every ~10 s while idle: a read waits past that
            resp = urllib.request.urlopen(_request(url, self.api_key), timeout=STREAM_READ_TIMEOUT)
        except urllib.error.HTTPError as e:
            with self.lock:
                self.last_error = f"stream: HTTP {e.code}"
            return False
        except OSError as e:
            with self.lock:
                self.last_error = f"stream: {type(e).__name__}: {str(e)[:200]}"
            return False
        self.stream_mode = "stream"
        try:
            with resp:

                def lines():
                    while self._should_run():
                        line = resp.readline(MAX_SSE_LINE)
                        if not line:
                            return
                        yield line

                for data in iter_sse(lines()):
                    try:
                        snap, evs = parse_stream_message(data)
                    except (ValueError, KeyError, TypeError) as e:
                        with self.lock:
                            self.last_error = f"stream message: {str(e)[:200]}"
                        continue
                    self._apply_kvscope(snap, evs)
                    with self.lock:
                        self.last_error = None
        except OSError as e:  # read timeout or the server went away: reconnect from last seq
            with self.lock:
                self.last_error = f"stream: {type(e).__name__}: {str(e)[:200]}"
        return True

    def _poll_snapshot(self) -> None:
        self.stream_mode = "poll"
        try:
            status, body = http_get(self.base_url + "/v1/kvscope/snapshot", self.api_key)
            if status != 200:
                raise ValueError(f"/v1/kvscope/snapshot answered HTTP {status}")
            self._apply_kvscope(snapshot_from_dict(json.loads(body)), [])
        except (OSError, ValueError, KeyError, TypeError) as e:
            with self.lock:
                self.last_error = f"{type(e).__name__}: {str(e)[:200]}"

    # -- ZeroMQ KV events
    def _run_events(self) -> None:
        try:
            sub = KVEventSubscriber(self.events_endpoint, self.replay_endpoint, self.topic, bind=self.events_bind)
        except Exception as e:  # zmq errors for unusable endpoints: report, don't crash the page
            with self.lock:
                self.event_error = f"{type(e).__name__}: {str(e)[:200]}"
            return
        if self.event_state is not None:  # resumed: carry on from the seq already applied
            sub.state = self.event_state
        try:
            while self._should_run():
                got = sub.poll(100)
                if got:
                    with self.lock:
                        now = time.monotonic()
                        for _, b in got:
                            self.tree.apply(b.events, now)
                        self.event_batches += len(got)
                with self.lock:  # a copy: the page never sees seq numbers ahead of the tree
                    self.event_state = dataclasses.replace(sub.state, wires=set(sub.state.wires))
        finally:
            sub.close()

    # -- for the page
    def vllm_view(self) -> dict:
        """Numbers the page shows (copied under the lock)."""
        with self.lock:
            hist = list(self.history)
        rs = vm.rows(hist, self.window_s)
        last = hist[-1] if hist else None
        notes = []
        if last is not None:
            miss = vm.missing(last)
            if miss:
                notes.append("this server's /metrics has no " + ", ".join(miss) + ": those figures stay empty")
        if not self.events_endpoint:
            notes.append("no KV events endpoint given: the prefix cache tree needs the server's KV events")
        elif self.event_batches == 0:
            notes.append(
                "no KV events received yet (is the server started with --kv-events-config and is the "
                "endpoint reachable?)"
            )
        with self.lock:
            bs_events = self.tree.block_size
        bs_metrics = vm.block_size(last) if last is not None else None
        return {
            "rows": rs,
            "last": last,
            "block_size": bs_metrics or bs_events,
            "block_size_from": "vllm:cache_config_info"
            if bs_metrics
            else ("BlockStored events" if bs_events else None),
            "notes": notes,
            "acceptance": vm.acceptance_per_position(last) if last else [],
        }
