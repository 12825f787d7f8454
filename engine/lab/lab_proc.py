"""Measurements in a process of their own (issue 32): the private engines the comparison pages
build (engine/lab/experiments.py) and the Claims page's live measurement run in one spawned
"lab" process per front end, so a measurement never shares an interpreter with drawing.

`run(fn, *args, **kwargs)` calls the module-level function `fn` there and returns its result
(pickled back). Every callable keyword argument (on_step, on_sample, busy, progress, ...) stays in
the caller: the lab process gets a stand-in that sends the call's arguments back, waits for the
caller to run it, and returns its value, so a page's progress bar and its `busy` probe work as
before. An exception in `fn` is raised again here with its type (ValueError, KeyError,
TypeError, TimeoutError; others as RuntimeError naming their type) and message.

The process starts on first use (it loads torch and the model once, then serves every later
measurement; models.load_model keeps one copy per process), runs on the engine core's CPUs
(engine/core/placement.py) and is started again if it died. With KVSCOPE_ENGINE_PROCESS=0 (the
in-thread engine) `run` calls `fn` in this process, as before. One job at a time: callers hold
experiments.RUN_LOCK already; `run` also serializes on its own lock.
"""

from __future__ import annotations

import importlib
import multiprocessing
import threading
import traceback

from engine.core import core_proc as wire

ERRORS = {**wire.ERRORS, "TimeoutError": TimeoutError}
POLL_S = 0.1
PLAIN = (int, float, str, bool, type(None), tuple, list, dict)


def _child(conn, cpus) -> None:
    """The lab process: take jobs, run them, send results; callbacks go back over `conn`."""
    from engine.core.placement import pin, prioritize

    prioritize()
    pin(cpus)
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the front end is gone
            return
        if job is None:
            return
        mod, name, args, kwargs, cb_names = job

        def stand_in(cb):
            def call(*a):
                conn.send(("cb", cb, a))
                kind, value = conn.recv()
                if kind == "raise":
                    raise RuntimeError(value)
                return value

            return call

        kwargs = {**kwargs, **{k: stand_in(k) for k in cb_names}}
        try:
            fn = getattr(importlib.import_module(mod), name)
            result = fn(*args, **kwargs)
            conn.send(("done", result))
        except Exception as e:  # noqa: BLE001 - sent to the caller, the process keeps serving
            traceback.print_exc()
            conn.send(("error", type(e).__name__, str(e)[:2000]))


class LabProcess:
    def __init__(self):
        self.lock = threading.Lock()
        self.proc = None
        self.conn = None

    def _ensure(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            return
        from engine.core.placement import plan

        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child, plan().core), name="kvscope-lab", daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.is_alive() else None

    def run(self, fn, *args, **kwargs):
        cbs = {k: v for k, v in kwargs.items() if callable(v)}
        plain = {k: v for k, v in kwargs.items() if k not in cbs}
        with self.lock:
            self._ensure()
            conn, proc = self.conn, self.proc
            conn.send((fn.__module__, fn.__qualname__, args, plain, list(cbs)))
            while True:
                if not conn.poll(POLL_S):
                    if not proc.is_alive():
                        self._lost(proc)
                        raise RuntimeError(
                            f"the measurement process exited (exit code {proc.exitcode}); the next "
                            "measurement starts a new one"
                        )
                    continue
                try:
                    msg = conn.recv()
                    if msg[0] == "cb":
                        try:
                            value = cbs[msg[1]](*msg[2])
                            # a plain value goes back (busy's count); a page element (what a
                            # progress bar's update returns) stays here
                            reply = ("ret", value if isinstance(value, PLAIN) else None)
                        except Exception as e:  # noqa: BLE001 - the measurement sees it as its callback's error
                            reply = ("raise", f"{type(e).__name__}: {e}")
                        except BaseException:  # the caller is stopped (a page rerun): end the job
                            proc.kill()
                            self._lost(proc)
                            raise
                        conn.send(reply)
                        continue
                except (EOFError, OSError):
                    self._lost(proc)
                    raise RuntimeError(
                        "the measurement process exited mid-measurement; the next measurement starts a new one"
                    ) from None
                if msg[0] == "done":
                    return msg[1]
                else:
                    _, typ, text = msg
                    raise wire.remote_error(typ, text, ERRORS)

    def _lost(self, proc) -> None:
        proc.join(5)
        self.conn.close()
        self.proc = self.conn = None

    def stop(self) -> None:
        with self.lock:
            if self.proc is not None and self.proc.is_alive():
                try:
                    self.conn.send(None)
                except OSError:
                    pass
                self.proc.join(10)
                if self.proc.is_alive():
                    self.proc.kill()
                    self.proc.join(5)
            self.proc = None


LAB = LabProcess()


def enabled() -> bool:
    """Measurements go to the lab process unless the engine runs in-thread (KVSCOPE_ENGINE_PROCESS=0)."""
    from engine.core.client import process_enabled

    return process_enabled()


def run(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` in the lab process (see the module doc), or here with the in-thread engine."""
    if not enabled():
        return fn(*args, **kwargs)
    return LAB.run(fn, *args, **kwargs)


def pid() -> int | None:
    """The lab process's pid while it runs (None before the first measurement)."""
    return LAB.pid
