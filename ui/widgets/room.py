"""One server, several people: whose request is whose, runs that outlive a tab, and who may
change the engine for everyone.

- Ownership: every request a page submits is recorded against the Streamlit session that sent it
  (`submit`, `submitter`), so engine-wide views can highlight "yours" and a rebuild can say whose
  requests it would abort (`inflight_counts`).
- Background runs (`start_run`, `current_run`): a page experiment runs on a daemon thread, on its own
  private engine, with its state kept here (server-side, keyed by a run id the page puts in the URL
  as ?run=...), so reloading the tab keeps showing the run and no tab is blocked while it runs.
  It queues on experiments.RUN_LOCK behind other private-engine measurements (they compete for
  the same cores), the ones pages run inline included.
- Access (`shared`, `operator_token`, `is_operator`): KVSCOPE_SHARE=1 means the app is served to
  a room (scripts/run.sh binds 0.0.0.0 then); KVSCOPE_OPERATOR_TOKEN, when set, limits the actions
  that change the engine for everyone (the sidebar's rebuild, the Load page's KV budget) to the
  sessions that entered it in the sidebar. Viewers still run their own prompts.
"""

from __future__ import annotations

import hmac
import os
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import streamlit as st

MAX_RUNS = 32  # finished runs kept for reloads (oldest dropped first)
MAX_OWNED = 20_000  # request ids remembered per server (oldest dropped first)
MAX_HANDLES = 1_000  # handles kept for outcome counts (> recording.MAX_LOAD_REQUESTS x 3)
TERMINAL = ("finished", "rejected", "aborted")


# ------------------------------------------------------------------ identity and access


def session_id() -> str:
    """This browser tab's Streamlit session id ("" outside a script run)."""
    try:
        from streamlit.runtime.scriptrunner import get_script_run_ctx

        ctx = get_script_run_ctx()
        return ctx.session_id if ctx is not None else ""
    except Exception:
        return ""


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def shared() -> bool:
    """KVSCOPE_SHARE=1: the app is served to a room, not only to this machine."""
    return _flag("KVSCOPE_SHARE")


def operator_token() -> str:
    return os.environ.get("KVSCOPE_OPERATOR_TOKEN", "")


def is_operator() -> bool:
    """True when no operator token is set, or this session entered it in the sidebar."""
    tok = operator_token()
    if not tok:
        return True
    given = str(st.session_state.get("operator_token_input", ""))
    return hmac.compare_digest(given.encode(), tok.encode())


def operator_sidebar() -> None:
    """The sidebar's access line and, when a token is set, the field to enter it."""
    sb = st.sidebar
    if operator_token():
        sb.text_input(
            "Operator token",
            type="password",
            key="operator_token_input",
            help="Set with KVSCOPE_OPERATOR_TOKEN when the server started. Without it you can run "
            "your own prompts; rebuilds, the KV budget, evictions and aborting other people's "
            "requests are for the operator.",
        )
        sb.caption(
            "Operator: you can change the engine for everyone."
            if is_operator()
            else "Viewer: your own prompts only; engine-wide changes need the operator token."
        )
    elif shared():
        sb.caption("Shared with the room; no operator token set, so anyone may change the engine.")


def operator_only(what: str) -> bool:
    """Show why `what` is refused and return False for a viewer; True for an operator."""
    if is_operator():
        return True
    st.warning(f"{what} changes the engine for everyone: enter the operator token in the sidebar.")
    return False


# ------------------------------------------------------------------ the room (one per server)


@dataclass
class Run:
    """A background experiment. `progress` is a line for the page; `result` its outcome."""

    run_id: str
    kind: str
    owner: str
    started: float
    status: str = "queued"  # queued -> running -> done | error
    progress: str = "waiting for the previous experiment to finish"
    result: object = None
    error: str | None = None
    finished_at: float | None = None
    live: object = None  # what the page and the running experiment share (e.g. engine.watch.WatchControl)
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def finished(self) -> bool:
        return self.status in ("done", "error")

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def mark_done(self) -> None:
        """Wakes every wait(): the run ended (status done or error)."""
        self._done.set()


class Room:
    def __init__(self):
        self.lock = threading.Lock()
        self.owners: OrderedDict[str, str] = OrderedDict()  # request id -> session id
        self.handles: OrderedDict[str, object] = OrderedDict()  # request id -> RequestHandle (recent)
        self.runs: OrderedDict[str, Run] = OrderedDict()

    # ownership
    def own(self, request_id: str, sid: str) -> None:
        with self.lock:
            self.owners[request_id] = sid
            while len(self.owners) > MAX_OWNED:
                self.owners.popitem(last=False)

    def keep(self, handle) -> None:
        with self.lock:
            self.handles[handle.request_id] = handle
            while len(self.handles) > MAX_HANDLES:
                self.handles.popitem(last=False)

    def handle(self, request_id: str):
        with self.lock:
            return self.handles.get(request_id)

    def owner(self, request_id: str) -> str | None:
        with self.lock:
            return self.owners.get(request_id)

    # runs
    def start(
        self,
        kind: str,
        owner: str,
        fn: Callable[[Callable[[str], None]], object],
        lock: threading.Lock | None = None,
        live: object = None,
    ) -> Run:
        run = Run(run_id=f"{kind[:4]}-{uuid.uuid4().hex[:8]}", kind=kind, owner=owner, started=time.time(), live=live)

        def progress(text: str) -> None:
            run.progress = str(text)

        def body():
            try:
                if lock is not None:
                    with lock:
                        run.status, run.progress = "running", "starting"
                        run.result = fn(progress)
                else:
                    run.status, run.progress = "running", "starting"
                    run.result = fn(progress)
                run.status = "done"
            except Exception as e:  # noqa: BLE001 - shown on the page that started it
                run.error = f"{type(e).__name__}: {e}"
                run.status = "error"
            finally:
                run.finished_at = time.time()
                run.mark_done()

        with self.lock:
            self.runs[run.run_id] = run
            while len(self.runs) > MAX_RUNS:
                oldest = next((k for k, r in self.runs.items() if r.finished), None)
                if oldest is None:
                    break
                self.runs.pop(oldest)
        threading.Thread(target=body, name=f"kvscope-run-{run.run_id}", daemon=True).start()
        return run

    def get(self, run_id: str | None) -> Run | None:
        if not run_id:
            return None
        with self.lock:
            return self.runs.get(str(run_id))


@st.cache_resource(show_spinner=False)
def room() -> Room:
    return Room()


# ------------------------------------------------------------------ page helpers


def submit(th, prompt, params=None, request_id: str | None = None, **kw):
    """th.submit, recording this session as the request's owner."""
    return submitter(th)(prompt, params, request_id=request_id, **kw)


def submitter(th) -> Callable:
    """A submit function (for LoadFeeder) that records this session as owner of what it submits
    (the feeder's thread has no session of its own)."""
    sid, rm = session_id(), room()

    def _submit(prompt, params=None, request_id=None, **kw):
        h = th.submit(prompt, params, request_id=request_id, **kw)
        rm.own(h.request_id, sid)
        rm.keep(h)
        return h

    return _submit


def mine(snapshot) -> set[str]:
    """Ids of this session's requests among the snapshot's."""
    if snapshot is None:
        return set()
    sid, rm = session_id(), room()
    return {r.request_id for r in snapshot.requests if sid and rm.owner(r.request_id) == sid}


def inflight_counts(snapshot) -> tuple[int, int]:
    """(this session's, everyone else's) unfinished requests in the snapshot."""
    if snapshot is None:
        return 0, 0
    sid, rm = session_id(), room()
    live = [r for r in snapshot.requests if getattr(r.state, "value", r.state) not in TERMINAL]
    mine_n = sum(1 for r in live if sid and rm.owner(r.request_id) == sid)
    return mine_n, len(live) - mine_n


def rebuild_warning(snapshot) -> str:
    """What a rebuild of the shared engine would abort, for the confirmation."""
    m, o = inflight_counts(snapshot)
    if m + o == 0:
        return "No request is in flight: nothing would be aborted."
    return (
        f"Rebuilding aborts {m + o} in-flight request(s): {m} from this tab and {o} from other sessions "
        "(and stops load feeders bound to this engine)."
    )


def start_run(
    kind: str, fn: Callable[[Callable[[str], None]], object], *, private: bool = True, live: object = None
) -> Run:
    """Start a background experiment owned by this session and put its id in the URL (?run=...),
    so a reload finds it. `private`: queue behind other private-engine experiments. `live`: an
    object the page and the experiment share while it runs (kept on the Run)."""
    from engine.lab.experiments import RUN_LOCK

    run = room().start(kind, session_id(), fn, lock=RUN_LOCK if private else None, live=live)
    st.query_params["run"] = run.run_id
    return run


def current_run(kind: str) -> Run | None:
    """The run named in the URL, when it is of this page's kind."""
    run = room().get(st.query_params.get("run"))
    return run if run is not None and run.kind == kind else None


def outcomes(request_ids) -> dict[str, int]:
    """{"finished", "aborted", "failed", "in_flight"} counts of these requests, from the handles
    their submitter kept (the engine's final word on each: its output's finish reason, or the
    error a rebuild or a crash failed it with). Ids without a kept handle count as "unknown"."""
    out = {"finished": 0, "aborted": 0, "failed": 0, "in_flight": 0, "unknown": 0}
    rm = room()
    for rid in request_ids:
        h = rm.handle(rid)
        if h is None:
            out["unknown"] += 1
        elif not h.finished:
            out["in_flight"] += 1
        else:
            reason = getattr(getattr(h, "output", None), "outputs", None)
            reason = reason[0].finish_reason if reason else None
            if reason == "abort" or (h.error and "abort" in h.error):
                out["aborted"] += 1
            elif h.error or reason in ("error", "rejected"):
                out["failed"] += 1
            else:
                out["finished"] += 1
    return out
