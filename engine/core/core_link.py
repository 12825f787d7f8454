"""The link to one engine-core process (engine/core/core_proc.py): spawning it, its three ZMQ
sockets, the reader thread that routes what the core sends (outputs, replies, snapshot frames, a
crash) to its EngineClient, and bounded calls that never wait on a core that is gone. The wire
forms are core_proc's; the client-side behaviour (handles, snapshots, reconfigure) is
engine/core/client.py's."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import pickle
import shutil
import tempfile
import threading
import time

from engine.config import EngineConfig
from engine.core import core_proc as wire
from engine.core.thread import EngineCrashed

START_TIMEOUT_S = 900.0  # loading a model on a busy machine; a hang guard, not a speed limit
CALL_TIMEOUT_S = 300.0
POLL_MS = 100


class CoreLink:
    """One core process and the sockets to it. The reader thread owns the receiving sockets and
    hands what arrives to its client (on_outputs, on_snapshot, on_core_died)."""

    def __init__(self, client, config: EngineConfig, cpus, kv_events: dict | None = None):
        """kv_events: op_kv_events_open's arguments: the core publishes vLLM's KV events from
        its start (engine serve --kv-events-endpoint)."""
        import zmq

        self.client = client
        self.config = config
        self.dir = tempfile.mkdtemp(prefix="kvscope-core-")
        os.chmod(self.dir, 0o700)
        addrs = tuple(f"ipc://{self.dir}/{n}" for n in ("cmd", "out", "pub"))
        self.ctx = zmq.Context()
        self.cmd = self.ctx.socket(zmq.PUSH)
        self.cmd.setsockopt(zmq.LINGER, 0)
        self.cmd.bind(addrs[0])
        self.out = self.ctx.socket(zmq.PULL)
        self.out.setsockopt(zmq.LINGER, 0)
        self.out.bind(addrs[1])
        self.pub = self.ctx.socket(zmq.PULL)
        self.pub.setsockopt(zmq.RCVHWM, 1)
        self.pub.setsockopt(zmq.RCVBUF, wire.SNAPSHOT_SOCKET_BUFFER)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(addrs[2])
        self.send_lock = threading.Lock()
        self.pending: dict[int, list] = {}  # call id -> [Event, ok, value]
        self.ids = itertools.count(1)
        self.error: str | None = None
        self.closed = threading.Event()
        self.placement: dict = {}
        ctx = multiprocessing.get_context("spawn")
        self.proc = ctx.Process(
            target=wire.core_main,
            args=(
                pickle.dumps(config),
                addrs,
                os.getpid(),
                client.snapshot_interval,
                cpus,
                client.push_snapshots,
                kv_events,
            ),
            name="kvscope-engine-core",
            daemon=True,
        )
        self.proc.start()
        self._wait_ready()
        self.reader = threading.Thread(target=self._read, name="kvscope-core-reader", daemon=True)
        self.reader.start()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.out.poll(POLL_MS):
                kind, payload = self.out.recv_multipart()
                if kind == b"ready":
                    self.placement, self.config = pickle.loads(payload)
                    return
                if kind == b"build_failed":
                    typ, msg = pickle.loads(payload)
                    self._cleanup()
                    raise wire.remote_error(typ, msg)
            elif not self.proc.is_alive():
                self._cleanup()
                raise RuntimeError(f"the engine core process exited while starting (exit code {self.proc.exitcode})")
        self.proc.kill()
        self._cleanup()
        raise RuntimeError(f"the engine core did not start within {START_TIMEOUT_S:.0f}s")

    # -------------------------------------------------------------- reading
    def _read(self) -> None:
        try:
            reason = self._read_loop()
        except Exception as e:  # noqa: BLE001 - a reader that died must not leave callers waiting
            reason = f"the engine client's reader failed: {type(e).__name__}: {e}"
        self._die(reason)

    def _read_loop(self) -> str:
        import zmq

        poller = zmq.Poller()
        poller.register(self.out, zmq.POLLIN)
        poller.register(self.pub, zmq.POLLIN)
        client = self.client
        reason = None
        while reason is None:
            events = dict(poller.poll(POLL_MS))
            if self.out in events:
                while reason is None:
                    try:
                        kind, payload = self.out.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    reason = self._on_frame(kind, payload)
            if self.pub in events:
                latest = None
                while True:  # keep only the newest frame
                    try:
                        latest = self.pub.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                if latest is not None:
                    client.on_snapshot(self, wire.unpack(latest))
            if reason is None and not events and not self.proc.is_alive():
                reason = f"the engine core process exited unexpectedly (exit code {self.proc.exitcode})"
        return reason

    def _on_frame(self, kind: bytes, payload: bytes) -> str | None:
        if kind == b"out":
            self.client.on_outputs(self, wire.unpack(payload))
        elif kind == b"reply":
            cid, ok, value = pickle.loads(payload)
            slot = self.pending.pop(cid, None)
            if slot is not None:
                slot[1], slot[2] = ok, value
                slot[0].set()
        elif kind == b"crash":
            return pickle.loads(payload)
        elif kind == b"bye":
            return ""
        return None

    def _die(self, reason: str) -> None:
        """The core is gone (crashed, killed, or shut down): fail every waiting call and request."""
        if reason:
            self.error = reason
        self.closed.set()  # from here on calls fail at once
        for cid in list(self.pending):
            slot = self.pending.pop(cid, None)
            if slot is not None:
                slot[1], slot[2] = False, ("EngineCrashed", reason or "the engine core was shut down")
                slot[0].set()
        if reason:
            self.client.on_core_died(self, reason)

    def _send(self, frame: bytes, deadline: float) -> None:
        """Send a command without ever blocking on a core that is gone (a PUSH socket without a
        peer would wait forever)."""
        import zmq

        with self.send_lock:
            while True:
                try:
                    self.cmd.send(frame, zmq.NOBLOCK)
                    return
                except zmq.Again:
                    if self.closed.is_set() or not self.proc.is_alive():
                        raise EngineCrashed(self.error or "the engine core is not running") from None
                    if time.monotonic() > deadline:
                        raise TimeoutError("the engine core did not take a command in time") from None
                    time.sleep(0.01)

    # -------------------------------------------------------------- calling
    def call(self, op: str, timeout: float = CALL_TIMEOUT_S, **args):
        if self.closed.is_set():
            raise EngineCrashed(self.error or "the engine core was shut down")
        cid = next(self.ids)
        slot = [threading.Event(), False, None]
        self.pending[cid] = slot
        try:
            self._send(pickle.dumps((cid, op, args)), time.monotonic() + timeout)
        except BaseException:
            self.pending.pop(cid, None)
            raise
        if self.closed.is_set() and cid in self.pending:  # died between the check and the send
            self.pending.pop(cid, None)
            raise EngineCrashed(self.error or "the engine core was shut down")
        deadline = time.monotonic() + timeout
        while not slot[0].wait(0.5):
            if self.closed.is_set() and not slot[0].is_set():  # the reader is gone
                self.pending.pop(cid, None)
                raise EngineCrashed(self.error or "the engine core was shut down")
            if time.monotonic() > deadline:
                self.pending.pop(cid, None)
                raise TimeoutError(f"the engine core did not answer {op!r} within {timeout:.0f}s")
        ok, value = slot[1], slot[2]
        if ok:
            return value
        typ, msg = value
        if typ == "EngineCrashed":
            raise EngineCrashed(msg)
        raise wire.remote_error(typ, msg)

    def notify(self, op: str, **args) -> None:
        """A command without a reply (nothing waits for it); dropped when the core is gone."""
        import zmq

        if self.closed.is_set() or not self.send_lock.acquire(timeout=0.1):
            return
        try:
            self.cmd.send(pickle.dumps((None, op, args)), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the core is gone or not reading: nothing waits for this
        finally:
            self.send_lock.release()

    def stop(self, timeout: float = 30.0) -> int:
        """Abort every request (invariants checked in the core), end the process. Returns the
        number aborted (0 when the core was already gone)."""
        n = 0
        if self.ctx.closed:
            return 0
        try:
            n = self.call("shutdown", timeout=timeout)
        except (EngineCrashed, TimeoutError, RuntimeError):
            pass
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.closed.wait(timeout)
        self._cleanup()
        return n

    def _cleanup(self) -> None:
        if self.ctx.closed:
            return
        for s in (self.cmd, self.out, self.pub):
            s.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)
