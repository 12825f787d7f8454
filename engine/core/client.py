"""EngineClient: EngineThread's public behaviour with the engine core in its own process
(engine/core/core_proc.py). The app, the API and the pages hold one of these instead of an
EngineThread: the default of the app (`bash scripts/run.sh`); KVSCOPE_ENGINE_PROCESS=0 keeps the
in-thread engine.

What stays the same: submit() returns a RequestHandle that streams text deltas; abort, evict,
set_kv_budget, preview, snapshot / snapshot_now / recent_snapshots, events.since, reconfigure,
restart, shutdown; a crashed core is surfaced (healthy False, `error` the reason) and wakes every
waiting request with it; nothing waits forever (every call is bounded and fails when the core
process is gone).

What is different: the step loop runs in another interpreter, so drawing and HTTP work never
hold its GIL; snapshots arrive as published frames (the latest kept; frames a busy client did
not read in time are dropped by the core and counted in `dropped_snapshot_frames`; outputs never
are); `engine` is an EngineView, the few read-only engine calls the API needs, forwarded. The
process itself, its sockets and reader thread: engine/core/core_link.py (CoreLink).
"""

from __future__ import annotations

import os
import threading
from collections import deque

from engine.config import EngineConfig, SamplingParams
from engine.core import core_proc as wire
from engine.core.core_link import CoreLink
from engine.core.inputs import MAX_PROMPT_CHARS
from engine.core.thread import RECONFIGURE_WAIT_S, EngineCrashed, RequestHandle
from engine.observe.snapshot import Snapshot, from_plain
from engine.observe.trace_events import event_from_dict


def process_enabled() -> bool:
    """KVSCOPE_ENGINE_PROCESS: the shared engine's core runs in its own process unless it is
    "0" (or "false" / "no"): then the old in-thread EngineThread."""
    return os.environ.get("KVSCOPE_ENGINE_PROCESS", "1").strip().lower() not in ("0", "false", "no")


class _Listeners(list):
    pass


class _Metrics:
    """The client's side of engine.metrics: `listeners` get a FinishedRequest per finished request."""

    def __init__(self):
        self.listeners: list = _Listeners()

    def subscribe(self, fn) -> None:  # MetricsTracker's interface
        self.listeners.append(fn)

    def unsubscribe(self, fn) -> None:
        if fn in self.listeners:
            self.listeners.remove(fn)


class PoolView:
    """engine.bm as the API reads it (/get_server_info, the fleet routes), read from the core
    when `engine.bm` is asked for; cached_hashes / reset_prefix_cache are calls."""

    def __init__(self, client: "EngineClient", info: dict):
        from types import SimpleNamespace

        self._client = client
        self.block_size = info["block_size"]
        self.enable_prefix_caching = info["enable_prefix_caching"]
        self.hasher = SimpleNamespace(algo=info["hash_algo"], seed=info["hash_seed"])

    def cached_hashes(self) -> list[bytes]:
        return self._client.call("cached_hashes")

    def reset_prefix_cache(self) -> tuple[int, int]:
        """Uncache every cached block no request holds; (dropped, kept in use). Each drop is a
        BlockRemoved on the core's KV events."""
        return tuple(self._client.call("reset_prefix_cache"))


class EngineView:
    """The read-only engine calls the API makes (engine/serve), forwarded to the core."""

    def __init__(self, client: "EngineClient"):
        self._client = client
        self.metrics = _Metrics()
        self._vocab_size = None

    def _call(self, name, *args):
        return self._client.call("call", name=name, args=args)

    def max_completion_tokens(self, prompt_len: int, tier: str | None = None) -> int:
        return self._call("max_completion_tokens", prompt_len, tier)

    def has_unfinished_requests(self) -> bool:
        """Every request reaches this core through this client: unfinished ones have a handle
        (no round trip, so an event loop may ask)."""
        return bool(self._client.handles)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._call("decode", list(ids), skip_special_tokens)

    def apply_chat_template(self, text: str) -> list[int]:
        return self._call("apply_chat_template", text)

    def admission_check(self, ids: list[int], params: SamplingParams):
        """The checks submit() would make (ValueError naming the limit); changes nothing."""
        return self._call("admission_check", list(ids), params)

    @property
    def bm(self) -> PoolView:
        return PoolView(self._client, self._client.call("pool_info"))

    def check_invariants(self) -> None:
        self._client.call("check_invariants")

    def info(self):
        return self._client.snapshot().info

    @property
    def config(self) -> EngineConfig:
        return self._client.config

    @property
    def tokenizer(self):
        return self._client.tokenizer

    def forget_vocab_size(self) -> None:
        """A rebuilt core may load another model: ask it again."""
        self._vocab_size = None

    @property
    def vocab_size(self) -> int:
        if self._vocab_size is None:
            self._vocab_size = self._client.call("attr", name="vocab_size")
        return self._vocab_size

    @property
    def cpu_threads(self):
        return self._client.placement.get("torch_threads")

    @property
    def device(self) -> str:
        return self._client.snapshot().info.device

    @property
    def num_blocks(self) -> int:
        return self._client.snapshot().info.num_blocks

    @property
    def step_num(self) -> int:
        return self._client.step_num

    @property
    def events(self):
        return self._client.events


class RemoteEvents:
    """engine.events across the boundary: since(seq, kinds) and last_seq, read from the core
    between two steps."""

    def __init__(self, client: "EngineClient"):
        self._client = client

    def since(self, seq: int = 0, kinds=None):
        evs, _ = self._client.call("events_since", seq=seq, kinds=list(kinds) if kinds is not None else None)
        return [event_from_dict(e) for e in evs]

    def __iter__(self):
        return iter(self.since(0))

    def __len__(self) -> int:
        return self._client.call("events_info")[1]

    @property
    def last_seq(self) -> int:
        return self._client.call("events_info")[0]

    @property
    def maxlen(self) -> int:
        return self._client.call("events_info")[2]


class EngineClient:
    """The engine through its core process, with EngineThread's API (see the module doc)."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        snapshot_interval: float = wire.SNAPSHOT_INTERVAL_S,
        keep_snapshots: int = 600,
        cpus=None,
        push_snapshots: bool = False,
        kv_events: dict | None = None,
    ):
        """push_snapshots: the core publishes a frame every snapshot_interval while it works,
        read or not (default: as fast as they are read, at least one a second). kv_events
        ({"endpoint", "replay_endpoint", "wire"}): the core publishes vLLM's KV events there
        (a ValueError naming the endpoint when it cannot open it)."""
        self.snapshot_interval = snapshot_interval
        self.push_snapshots = push_snapshots
        self.cpus = cpus
        self.lock = threading.RLock()  # callers that batch calls (the API bridge) take it
        self.handles: dict[str, RequestHandle] = {}
        self.recent: deque[Snapshot] = deque(maxlen=keep_snapshots)
        self.error: str | None = None
        self.dropped_snapshot_frames = 0
        self.engine = EngineView(self)
        self.events = RemoteEvents(self)
        self._config = config or EngineConfig()
        self._tokenizer = None
        self._state_lock = threading.Lock()
        self._snap: Snapshot | None = None
        self._snap_raw: dict | None = None
        self._step = 0
        self._counter = 0
        self._asked = False  # a want_snapshot is outstanding
        self._ready = threading.Event()
        self._reconf_lock = threading.Lock()
        self.kv_events = dict(kv_events) if kv_events else None
        self._core = CoreLink(self, self._config, cpus, self.kv_events)
        self._ready.set()
        self._snap = from_plain(Snapshot, self._core.call("snapshot"))

    # -------------------------------------------------------------- from the reader thread
    def on_outputs(self, core: CoreLink, frame: dict) -> None:
        if core is not getattr(self, "_core", None):
            return  # a core being replaced: its requests were failed already
        self._step = frame["step"]
        for d in frame["outs"]:
            out = wire.output_from_wire(d)
            with self._state_lock:
                h = self.handles.get(out.request_id)
                if h is not None and out.finished:
                    self.handles.pop(out.request_id, None)
            if h is not None:
                h.push(out)
        for rec in frame["fin"]:
            fr = wire.FinishedRequest(rec)
            for fn in list(self.engine.metrics.listeners):
                try:
                    fn(fr)
                except Exception:  # noqa: BLE001 - a listener must not stop the outputs
                    pass

    def on_snapshot(self, core: CoreLink, frame: dict) -> None:
        if core is not getattr(self, "_core", None):  # a core still starting, or being replaced
            return
        self.dropped_snapshot_frames = frame["dropped"]
        with self._state_lock:
            self._snap_raw = frame["snap"]
            self._snap = None

    def on_core_died(self, core: CoreLink, reason: str) -> None:
        if core is not getattr(self, "_core", None):
            return
        self.error = reason
        with self._state_lock:
            handles, self.handles = list(self.handles.values()), {}
        for h in handles:
            h.fail(reason)
        snap = self.snapshot()
        import dataclasses

        with self._state_lock:
            self._snap = dataclasses.replace(snap, healthy=False, error=reason)
            self._snap_raw = None

    # -------------------------------------------------------------- API
    def call(self, op: str, **args):
        return self._core.call(op, **args)

    @property
    def healthy(self) -> bool:
        return self.error is None and self._core.error is None and self._core.proc.is_alive()

    @property
    def config(self) -> EngineConfig:
        """The core's config as its engine resolved it (max_model_len None -> the model's limit)."""
        return self._core.config

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from engine.model.models import load_tokenizer

            self._tokenizer = load_tokenizer(self._config.model)
        return self._tokenizer

    @property
    def step_num(self) -> int:
        snap = self.snapshot()
        return max(self._step, snap.step if snap is not None else 0)

    @property
    def placement(self) -> dict:
        """Where the core runs, as it said when it started: pid, cpus, os_threads, torch_threads."""
        return dict(self._core.placement)

    def placement_now(self) -> dict:
        """Where the core runs, read by the core from the OS now (the start-time reading if the
        core cannot answer)."""
        try:
            return self.call("placement", timeout=10)
        except (EngineCrashed, TimeoutError, RuntimeError):
            return self.placement

    def kv_events_info(self):
        """The core's KV events publisher (engine.observe.kv_events.PublisherInfo), None if none."""
        from engine.observe.kv_events import PublisherInfo

        d = self.call("kv_events_info")
        return PublisherInfo(**d) if d is not None else None

    def hold(self, seconds: float) -> None:
        """Ask the core to take no step for up to `seconds` (0: resume now); see core_proc.op_hold."""
        self.call("hold", seconds=seconds)

    def _check_alive(self) -> None:
        if not self.healthy:
            raise EngineCrashed(self.error or "engine is not running")

    def submit(
        self,
        prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        chat: bool = False,
        origin: str = "app",
        listener=None,
    ) -> RequestHandle:
        """As EngineThread.submit: ValueError (field + limit) for bad input, EngineCrashed if the
        core is down. `listener()` runs on the client's reader thread after each update."""
        if not self._ready.wait(RECONFIGURE_WAIT_S):
            raise EngineCrashed("the engine is being reconfigured; try again")
        self._check_alive()
        with self._state_lock:
            if request_id is not None and request_id in self.handles:
                raise ValueError(f"request_id {request_id!r} is already in use")
        for _ in range(10_000):
            h = self._reserve(request_id, listener)
            rid = h.request_id
            try:
                self.call("submit", prompt=prompt, params=params, request_id=rid, chat=chat, origin=origin)
                return h
            except KeyError:  # the engine holds that id already (submitted by another caller)
                self._forget(rid)
                if request_id is not None:
                    raise ValueError(f"request_id {request_id!r} is already in use") from None
            except BaseException:
                self._forget(rid)
                raise
        raise EngineCrashed("no free request id")

    def _reserve(self, request_id: str | None, listener) -> RequestHandle:
        """The handle exists before the core can produce an output for it: the id is chosen here
        (r1, r2, ... as EngineThread does; the next free one), or the caller's if not in use."""
        with self._state_lock:
            if request_id is None:
                while True:
                    self._counter += 1
                    request_id = f"r{self._counter}"
                    if request_id not in self.handles:
                        break
            elif request_id in self.handles:
                raise ValueError(f"request_id {request_id!r} is already in use")
            h = RequestHandle(self, request_id)
            h.listener = listener
            self.handles[request_id] = h
        return h

    def _forget(self, request_id: str) -> None:
        with self._state_lock:
            self.handles.pop(request_id, None)

    def submit_many(self, items) -> list:
        """Each (prompt, params, kwargs) as submit() would, in ONE command, so the core adds
        them all between two steps and one step admits them (as EngineThread's lock does);
        returns each one's handle or the exception it raised."""
        if not self._ready.wait(RECONFIGURE_WAIT_S):
            err = EngineCrashed("the engine is being reconfigured; try again")
            return [err for _ in items]
        out: list = []
        sent: list = []  # (index in out, handle, kwargs) of what goes to the core
        for prompt, params, kw in items:
            kw = dict(kw)
            try:
                self._check_alive()
                h = self._reserve(kw.get("request_id"), kw.pop("listener", None))
            except Exception as e:  # noqa: BLE001 - handed to its own request
                out.append(e)
                continue
            kw["request_id"] = h.request_id
            kw.setdefault("chat", False)
            kw.setdefault("origin", "app")
            sent.append((len(out), h, {"prompt": prompt, "params": params, **kw}))
            out.append(h)
        if not sent:
            return out
        try:
            results = self.call("submit_many", items=[item for _, _, item in sent])
        except Exception as e:  # noqa: BLE001 - the core is gone: every one of them fails
            results = [(False, e) for _ in sent]
        for (i, h, item), (ok, value) in zip(sent, results):
            if ok:
                continue
            self._forget(h.request_id)
            err = value if isinstance(value, BaseException) else wire.remote_error(*value)
            if isinstance(err, KeyError):  # the engine holds that id already
                if items[i][2].get("request_id") is None:  # an id chosen here: submit() takes the next
                    kw = {k: v for k, v in item.items() if k not in ("prompt", "params", "request_id")}
                    try:
                        out[i] = self.submit(item["prompt"], item["params"], listener=h.listener, **kw)
                    except Exception as e:  # noqa: BLE001 - handed to its own request
                        out[i] = e
                    continue
                err = ValueError(f"request_id {h.request_id!r} is already in use")
            out[i] = err
        return out

    def preview(self, user: str, params: SamplingParams | None = None, system: str | None = None):
        params = params if params is not None else SamplingParams()
        for field, text in (("prompt", user), ("system prompt", system or "")):
            if not isinstance(text, str) or len(text) > MAX_PROMPT_CHARS:
                raise ValueError(f"{field} must be a string of at most {MAX_PROMPT_CHARS} characters")
        self._check_alive()
        return self.call("preview", user=user, params=params, system=system)

    def abort(self, request_id: str) -> bool:
        done, out = self.call("abort", request_id=request_id)
        with self._state_lock:
            h = self.handles.pop(request_id, None)
        if h is not None:
            if out is not None:
                h.push(wire.output_from_wire(out))
            h.end()
        self._refresh()
        return done

    def evict(self, request_id: str) -> dict:
        r = self.call("evict", request_id=request_id)
        self._refresh()
        return r

    def set_kv_budget(self, num_blocks: int) -> None:
        self.call("set_kv_budget", num_blocks=num_blocks)
        self._refresh()

    def _refresh(self) -> None:
        try:
            self.snapshot_now()
        except (EngineCrashed, TimeoutError):
            pass

    def snapshot(self) -> Snapshot:
        """The core's latest published snapshot (decoded once per frame, on first read). Reading
        a new frame asks the core for the next one: frames follow the pace of their readers."""
        with self._state_lock:
            fresh = self._snap_raw is not None
            if self._snap is None and fresh:
                self._snap = from_plain(Snapshot, self._snap_raw)
                self._snap_raw = None
                self.recent.append(self._snap)
            ask, self._asked = not self._asked or fresh, True
            snap = self._snap
        if ask:
            self._core.notify("want_snapshot")
        return snap

    def snapshot_now(self) -> Snapshot:
        """A snapshot taken by the core now (between two steps)."""
        snap = from_plain(Snapshot, self.call("snapshot"))
        with self._state_lock:
            self._snap, self._snap_raw = snap, None
            self.recent.append(snap)
        return snap

    def recent_snapshots(self) -> list[Snapshot]:
        self.snapshot()
        with self._state_lock:
            return list(self.recent)

    def check_invariants(self) -> None:
        self.call("check_invariants")

    def shutdown(self, timeout: float = 30.0, reason: str = "engine shut down") -> int:
        """Abort every in-flight request (their blocks freed, invariants checked in the core),
        stop the core process, fail waiting clients with `reason`. Returns the number aborted."""
        with self._state_lock:
            handles, self.handles = list(self.handles.values()), {}
        for h in handles:
            h.fail(reason)
        n = self._core.stop(timeout)
        if self.error is None:
            self.error = reason
        return n

    def restart(self, config: EngineConfig | None = None) -> str:
        return self.reconfigure(config or self._config)

    def reconfigure(self, config: EngineConfig) -> str:
        """A new core with `config` (built first: a bad config leaves the old one serving), then
        the old one stopped, its in-flight requests aborted with a reason."""
        if not isinstance(config, EngineConfig):
            raise ValueError("config must be an EngineConfig")
        with self._reconf_lock:
            new_core = CoreLink(self, config, self.cpus)
            self._ready.clear()
            try:
                old = self._core
                with self._state_lock:
                    handles, self.handles = list(self.handles.values()), {}
                reason = "aborted: the engine was reconfigured"
                for h in handles:
                    h.fail(reason)
                self._core = new_core
                seq = self._close_kv_events(old) if self.kv_events else 0
                n = old.stop()  # also closes the sockets of a core that crashed
                n = max(n, len(handles))
                new_core.client = self
                self._config = config
                self._tokenizer = None
                self.engine.forget_vocab_size()
                self.error = None
                with self._state_lock:
                    self.recent.clear()
                    self._snap_raw = None
                    self._step = 0
                self._snap = from_plain(Snapshot, new_core.call("snapshot"))
                if self.kv_events:  # the old core's endpoints are free now: the new one takes them over
                    new_core.call("kv_events_open", **self.kv_events, first_seq=seq, cleared=True)
            finally:
                self._ready.set()
        return f"engine rebuilt; {n} in-flight request(s) aborted" if n else "engine rebuilt"

    @staticmethod
    def _close_kv_events(core: CoreLink) -> int:
        """Close a core's KV events publisher; the seq number its successor continues from (0
        when the core cannot say: it crashed)."""
        try:
            return core.call("kv_events_close", timeout=30) or 0
        except (EngineCrashed, TimeoutError, RuntimeError):
            return 0

    def close(self) -> None:
        """Stop the core (idempotent; a crashed core's sockets are closed too)."""
        self.shutdown(reason="engine client closed")

    @property
    def core_pid(self) -> int | None:
        return self._core.proc.pid
