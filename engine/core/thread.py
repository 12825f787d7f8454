"""EngineThread: the step loop in a background thread, shared safely by many callers (the app's
browser sessions). Every engine call happens under one lock (`lock`, between steps; a second,
`_reconf_lock`, only serialises reconfigurations and never guards the engine); callers get
RequestHandles that stream text deltas. A crashed loop is surfaced (healthy=False, error) and
wakes every waiting client with the error instead of hanging them; restart() rebuilds it."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections import deque

from engine.config import EngineConfig, SamplingParams
from engine.core.engine import LLMEngine, RequestOutput
from engine.core.inputs import MAX_PROMPT_CHARS, check_prompt_length
from engine.observe.snapshot import Snapshot

_DONE = object()
RECONFIGURE_WAIT_S = 300.0  # how long submit() waits for a reconfiguration in progress
RECENT_MAX_ITEMS = 500_000  # block + token + history entries kept in EngineThread.recent (~100 MiB)


def snapshot_items(snap: Snapshot) -> int:
    """A snapshot's size in entries: its blocks plus every request's token marks and history."""
    return len(snap.blocks) + sum(len(r.tokens) + len(r.history) for r in snap.requests)


class EngineCrashed(RuntimeError):
    pass


class RequestHandle:
    def __init__(self, owner: "EngineThread", request_id: str):
        self.owner = owner
        self.request_id = request_id
        self._q: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._sent = ""
        self.output: RequestOutput | None = None
        self.error: str | None = None
        self.listener = None  # callable() run (on the engine thread) after every update: async bridges

    # called by the loop (EngineThread, EngineClient): the handle's producer side
    def push(self, out: RequestOutput) -> None:
        """Deliver the request's latest output: queue its new text and end the stream once finished."""
        self.output = out
        text = out.outputs[0].text
        if text.startswith(self._sent):
            delta = text[len(self._sent) :]
            if not out.finished:
                delta = delta.rstrip("\ufffd")  # hold back an incomplete UTF-8 sequence
            if delta:
                self._sent += delta
                self._q.put(delta)
        if out.finished:
            if out.error:
                self.error = out.error
            self.end()
        self._tell()

    def fail(self, error: str) -> None:
        """End the stream with `error` (the loop died, the engine was rebuilt)."""
        self.error = error
        self.end()
        self._tell()

    def end(self) -> None:
        """End the stream (idempotent)."""
        if not self._done.is_set():
            self._done.set()
            self._q.put(_DONE)

    def _tell(self) -> None:
        if self.listener is not None:
            try:
                self.listener()
            except Exception:  # a closed event loop (client gone) must not hurt the engine loop
                pass

    def deltas(self) -> tuple[list[str], bool]:
        """Non-blocking: the text deltas queued so far and whether the request is done (then
        .error says if it failed)."""
        out, done = [], False
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return out, done
            if item is _DONE:
                done = True
            else:
                out.append(item)

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def stream(self, timeout: float | None = 600.0):
        """Yields text deltas until the request finishes. Raises EngineCrashed if the engine
        failed the request or the loop died."""
        while True:
            try:
                item = self._q.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no token from {self.request_id} within {timeout}s") from None
            if item is _DONE:
                if self.error:
                    raise EngineCrashed(self.error)
                return
            yield item

    def result(self, timeout: float | None = 600.0) -> RequestOutput:
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.request_id} did not finish within {timeout}s")
        if self.error and (self.output is None or not self.output.finished):
            raise EngineCrashed(self.error)
        return self.output


class EngineThread:
    def __init__(
        self,
        engine: LLMEngine | None = None,
        config: EngineConfig | None = None,
        snapshot_interval: float = 0.05,
        keep_snapshots: int = 600,
    ):
        self.engine = engine if engine is not None else LLMEngine(config or EngineConfig())
        self.lock = threading.RLock()
        self._wake = threading.Condition(self.lock)
        self.handles: dict[str, RequestHandle] = {}
        self.snapshot_interval = snapshot_interval
        self.recent: deque[Snapshot] = deque(maxlen=keep_snapshots)  # for traces / over-time charts
        self._recent_items = 0
        self.error: str | None = None
        self._ready = threading.Event()  # cleared while reconfigure() swaps engines
        self._reconf_lock = threading.Lock()
        self._ready.set()
        self._stop = False
        self._counter = 0
        self._snap = self.engine.snapshot()
        self._snap_t = 0.0
        self._thread: threading.Thread | None = None
        self._start()

    # ------------------------------------------------------------------ loop
    def _start(self) -> None:
        self._stop = False
        self.error = None
        self._thread = threading.Thread(target=self._loop, name="kvscope-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while True:
                with self.lock:
                    if self._stop:
                        return
                    if not self.engine.has_unfinished_requests():
                        self._publish(force=True)
                        self._wake.wait(timeout=0.2)
                        continue
                    outs = self.engine.step()
                    for out in outs:
                        h = self.handles.get(out.request_id)
                        if h is not None:
                            h.push(out)
                            if out.finished:
                                self.handles.pop(out.request_id, None)
                    self._publish()
                time.sleep(0)  # let submitters take the lock between steps
        except Exception as e:  # the loop itself died: surface it, wake every client
            with self.lock:
                self.error = f"engine loop crashed: {type(e).__name__}: {str(e)[:500]}"
                for h in self.handles.values():
                    h.fail(self.error)
                self.handles.clear()
                try:
                    snap = self.engine.snapshot()
                except Exception:
                    snap = self._snap
                self._snap = dataclasses.replace(snap, healthy=False, error=self.error)

    def _publish(self, force: bool = False) -> None:
        now = time.perf_counter()
        if force and self._snap.step == self.engine.step_num and self._snap_t:
            return
        if force or now - self._snap_t >= self.snapshot_interval:
            self._snap = self.engine.snapshot()
            self._snap_t = now
            if len(self.recent) == self.recent.maxlen:
                self._recent_items -= snapshot_items(self.recent[0])
            self.recent.append(self._snap)
            self._recent_items += snapshot_items(self._snap)
            while self._recent_items > RECENT_MAX_ITEMS and len(self.recent) > 1:  # big pools: fewer
                self._recent_items -= snapshot_items(self.recent.popleft())

    # ------------------------------------------------------------------ API
    @property
    def loop_running(self) -> bool:
        """The step loop's thread is alive (it exits on a crash, shutdown or reconfigure)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        return self.error is None and self.loop_running

    @property
    def events(self):
        return self.engine.events

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def step_num(self) -> int:
        """Steps the current engine has run (changes while it works)."""
        return self.engine.step_num

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
        """Queues a request; raises ValueError (field + limit) for bad input, EngineCrashed if
        the loop is down. `origin` tags it in snapshots ("app", "http"); `listener()` is called on
        the engine thread after each update of the handle."""
        deadline = time.monotonic() + RECONFIGURE_WAIT_S
        while True:  # during a reconfiguration, wait for the new engine instead of failing
            if not self._ready.wait(max(0.0, deadline - time.monotonic())):
                raise EngineCrashed("the engine is being reconfigured; try again")
            with self.lock:
                if self._ready.is_set():
                    return self._submit_locked(prompt, params, request_id, chat, origin, listener)

    def submit_many(self, items) -> list:
        """Each (prompt, params, kwargs) submitted as submit() would, under ONE acquisition of the
        lock, so one step admits them all; returns each one's handle or the exception it raised."""
        out = []
        with self.lock:
            for prompt, params, kw in items:
                try:
                    out.append(self.submit(prompt, params, **kw))
                except Exception as e:  # noqa: BLE001 - handed to its own request
                    out.append(e)
        return out

    def _submit_locked(self, prompt, params, request_id, chat, origin="app", listener=None) -> RequestHandle:
        with self.lock:
            self._check_alive()  # under the lock: a loop that crashed meanwhile has set error
            if chat:
                if not isinstance(prompt, str) or not prompt.strip():
                    raise ValueError("prompt must be a non-empty string")
                check_prompt_length(prompt)
                prompt_in = self.engine.apply_chat_template(prompt)
            else:
                prompt_in = prompt
            if request_id is None:
                self._counter += 1
                request_id = f"r{self._counter}"
                while request_id in self.engine.requests or request_id in self.handles:
                    self._counter += 1
                    request_id = f"r{self._counter}"
            self.engine.add_request(request_id, prompt_in, params, origin=origin, prompt_text=prompt if chat else None)
            h = RequestHandle(self, request_id)
            h.listener = listener
            self.handles[request_id] = h
            self._wake.notify_all()
            return h

    def preview(self, user: str, params: SamplingParams | None = None, system: str | None = None):
        """What submitting `user` (chat template applied, optional system prompt) would do now,
        without submitting it: engine.preview.PromptPreview. Changes nothing in the engine."""
        from engine.core.preview import preview, template_ids

        params = params if params is not None else SamplingParams()
        for field, text in (("prompt", user), ("system prompt", system or "")):
            if not isinstance(text, str) or len(text) > MAX_PROMPT_CHARS:
                raise ValueError(f"{field} must be a string of at most {MAX_PROMPT_CHARS} characters")
        with self.lock:
            self._check_alive()
            ids, content = template_ids(self.engine.tokenizer, user, system) if user.strip() else ([], 0)
            return preview(self.engine, ids, content, params)

    def abort(self, request_id: str) -> bool:
        with self.lock:
            done = self.engine.abort_request(request_id)
            h = self.handles.pop(request_id, None)
            if h is not None:
                req = self.engine.get_request(request_id)
                if req is not None:
                    h.push(self.engine.request_output(req))
                h.end()
            self._publish(force=True)
            return done

    def evict(self, request_id: str) -> dict:
        with self.lock:
            r = self.engine.evict(request_id)
            self._publish(force=True)
            self._wake.notify_all()
            return r

    def set_kv_budget(self, num_blocks: int) -> None:
        with self.lock:
            self.engine.set_num_blocks(num_blocks)
            self._publish(force=True)

    def snapshot(self) -> Snapshot:
        return self._snap

    def snapshot_now(self) -> Snapshot:
        with self.lock:
            self._snap = self.engine.snapshot()
            return self._snap

    def recent_snapshots(self) -> list[Snapshot]:
        with self.lock:
            return list(self.recent)

    def shutdown(self, timeout: float = 30.0, reason: str = "engine shut down") -> int:
        """Stop and join the loop; abort every in-flight request (freeing its blocks) and fail
        waiting clients with `reason`. Returns the number of requests aborted."""
        with self.lock:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        with self.lock:
            n = sum(1 for rid in list(self.engine.requests) if self.engine.abort_request(rid))
            for rid in list(self.handles):
                self.handles.pop(rid).fail(reason)
            return n

    def restart(self, config: EngineConfig | None = None) -> str:
        return self.reconfigure(config or self.engine.config)

    def reconfigure(self, config: EngineConfig) -> str:
        """Rebuild the engine with a new config. In-flight requests are aborted cleanly (their
        clients get an error saying why). Returns a message for the UI."""
        if not isinstance(config, EngineConfig):
            raise ValueError("config must be an EngineConfig")
        with self._reconf_lock:  # one rebuild at a time: never two loops
            new_engine = LLMEngine(config)  # build first: a bad config leaves the old engine serving
            self._ready.clear()
            try:
                return self._swap_engine(new_engine)
            finally:
                self._ready.set()

    def _swap_engine(self, new_engine: LLMEngine) -> str:
        n = self.shutdown(reason="aborted: the engine was reconfigured")
        with self.lock:
            for rid in list(self.engine.requests):
                self.engine.abort_request(rid)
                n += 1
            for h in list(self.handles.values()):
                h.fail("aborted: the engine was reconfigured")
            self.handles.clear()
            for fn in self.engine.metrics.subscribers():  # e.g. the /metrics exporter
                new_engine.metrics.subscribe(fn)
            self.engine = new_engine
            self.recent.clear()
            self._recent_items = 0
            self._snap = self.engine.snapshot()
        self._start()
        return f"engine rebuilt; {n} in-flight request(s) aborted" if n else "engine rebuilt"
