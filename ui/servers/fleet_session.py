"""The Fleet page's links to live fleets, with no Streamlit: the embedded local fleet (started and
stopped through engine.fleet.launcher, one per app server) and a fleet of servers attached by URL.

Every network call and every process start runs in a thread of its own; the page only calls
`snapshot()` (the collector's last state, no I/O) and reads `status`, `error` and the results.
A LocalFleet's jobs (start, stop, a load run, a policy comparison) run one at a time.
"""

from __future__ import annotations

import atexit
import threading
import time
import urllib.parse
from pathlib import Path

from engine.fleet.state import FleetSnapshot, FleetTrace, PolicyRun, RequestRow, WhatIfRow
from ui.servers.attach import detect_kind, kv_event_sources, normalise_base_url, reachable_endpoint

MAX_ATTACH = 16
IDLE_STOP_S = 300.0  # an attached fleet nobody looks at stops its threads


def fleet_api():
    """(launcher, collector, runs, workload) modules of engine.fleet, or (None, why) when the
    fleet runtime is not importable here."""
    try:
        from engine.fleet import collector, launcher, runs, workload
    except ImportError as e:  # a checkout without the fleet runtime, or a missing dependency
        return None, f"the fleet runtime (engine.fleet) cannot be imported: {e}"
    return (launcher, collector, runs, workload), ""


def _down_if_ours(launcher, fleet) -> None:
    """Stop the fleet in fleet.state_dir if it is still the one this process started (same pids)."""
    cur = launcher.read_state(fleet.state_dir)
    if cur is not None and {i.pid for i in cur.instances} & {i.pid for i in fleet.instances if i.pid}:
        launcher.down(fleet.state_dir)


class LocalFleet:
    """The embedded fleet of one app server: N kvscope servers and vllm-router on 127.0.0.1."""

    def __init__(self):
        self.lock = threading.Lock()
        self.fleet = None  # engine.fleet.launcher.Fleet while up
        self.collector = None
        self.status = "stopped"  # stopped / starting / up / stopping / running a load / comparing
        self.error = ""
        self.job: threading.Thread | None = None
        self.rows: list[RequestRow] = []  # the ledger of the latest load or comparison
        self.runs: list[PolicyRun] = []
        self.whatif: list[WhatIfRow] = []
        self.snapshots: list[FleetSnapshot] = []
        self.progress = ""

    # -- jobs
    @property
    def busy(self) -> bool:
        return self.job is not None and self.job.is_alive()

    def _run(self, status: str, fn) -> bool:
        with self.lock:
            if self.busy:
                return False
            self.status, self.error = status, ""

            def body():
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 - shown on the page, never a traceback
                    with self.lock:
                        self.error = f"{type(e).__name__}: {e}"
                        self.status = "up" if self.fleet is not None else "stopped"

            self.job = threading.Thread(target=body, name=f"kvscope-fleet-{status}", daemon=True)
            self.job.start()
        return True

    def start(self, n: int, policy: str, model: str, num_blocks: int, block_size: int = 16) -> bool:
        api, why = fleet_api()
        if api is None:
            self.error = why
            return False
        launcher, collector, _, _ = api

        def go():
            running = launcher.read_state()
            if running is not None and any(launcher.pid_alive(i.pid) for i in running.instances):
                fleet = running  # `python -m engine fleet up` already started one: watch it
            else:
                fleet = launcher.up(
                    launcher.plan(n, policy=policy, model=model, num_blocks=num_blocks, block_size=block_size)
                )
                # the servers are processes of their own: stop them when this app server exits
                atexit.register(_down_if_ours, launcher, fleet)
            c = collector.FleetCollector(
                collector.members_of(fleet),
                router_url=fleet.router.url,
                policy=fleet.router.policy,
                block_size=fleet.block_size,
            ).start()
            with self.lock:
                self.fleet, self.collector, self.status = fleet, c, "up"

        return self._run("starting", go)

    def stop(self) -> bool:
        api, why = fleet_api()
        if api is None:
            self.error = why
            return False
        launcher = api[0]

        def go():
            with self.lock:
                c, fleet = self.collector, self.fleet
            if c is not None:
                c.stop()
            launcher.down(fleet.state_dir if fleet is not None else None)
            with self.lock:
                self.fleet, self.collector, self.status = None, None, "stopped"

        return self._run("stopping", go)

    def _on_row(self, row: RequestRow) -> None:
        with self.lock:
            self.rows.append(row)
            self.progress = f"{len(self.rows)} requests answered"

    def run_load(self, policy: str, n: int, concurrency: int = 4, seed: int = 0) -> bool:
        """The release-freeze workload through the gateway under one policy (router restarted if
        it runs another); its ledger and summary replace the previous results."""
        api, why = fleet_api()
        if api is None or self.fleet is None:
            self.error = why or "start the fleet first"
            return False
        launcher, _, _, workload = api

        def go():
            with self.lock:
                fleet, c = self.fleet, self.collector
                self.rows, self.runs, self.whatif, self.snapshots, self.progress = [], [], [], [], ""
            if fleet.router.policy != policy or not launcher.pid_alive(fleet.router.pid):
                fleet = launcher.restart_router(fleet, policy)
                with self.lock:
                    self.fleet = fleet
            c.policy = policy
            before = c.snapshot()
            t0 = time.perf_counter()
            rows = workload.run_workload(
                fleet.router.url,
                fleet.model_name,
                workload.release_freeze(n, seed),
                instance_urls=[i.url for i in fleet.instances],
                collector=c,
                policy=policy,
                concurrency=concurrency,
                block_size=fleet.block_size,
                on_row=self._on_row,
            )
            wall = time.perf_counter() - t0
            if policy == "kv_aware" and fleet.router.log:  # the router logs the prefix tokens it credited
                try:
                    text = Path(fleet.router.log).read_text(errors="replace")
                    url_of = {i.engine_id: i.url for i in fleet.instances}
                    rows = workload.attach_router_credits(rows, workload.router_credits(text), url_of)
                except OSError:
                    pass
            c.wait_quiet(timeout_s=5.0)
            after = c.snapshot()
            pre = sum(i.preemptions or 0 for i in after.instances) - sum(i.preemptions or 0 for i in before.instances)
            run = workload.summarize(
                policy,
                rows,
                wall,
                duplicated_blocks=after.tree.duplicated_blocks,
                preemptions=pre,
                model=fleet.model,
            )
            with self.lock:
                self.rows, self.runs, self.snapshots, self.status = list(rows), [run], [before, after], "up"

        return self._run("running a load", go)

    def compare(self, policies, n: int, concurrency: int = 4, seed: int = 0) -> bool:
        """The same workload under each policy, one after the other on cleared caches, then the
        what-if replays of the first run's recorded stream."""
        api, why = fleet_api()
        if api is None or self.fleet is None:
            self.error = why or "start the fleet first"
            return False
        _, _, runs, workload = api

        def go():
            with self.lock:
                fleet = self.fleet
                self.rows, self.runs, self.whatif, self.snapshots, self.progress = [], [], [], [], ""
            sess = runs.compare_policies(
                fleet, list(policies), workload.release_freeze(n, seed), concurrency=concurrency, on_row=self._on_row
            )
            with self.lock:
                self.fleet = sess.fleet
                if self.collector is not None:
                    self.collector.policy = sess.fleet.router.policy
                self.rows, self.runs, self.whatif = list(sess.rows), list(sess.runs), list(sess.whatif)
                self.snapshots, self.status = list(sess.snapshots), "up"

        return self._run("comparing policies", go)

    # -- for the page
    def snapshot(self) -> FleetSnapshot | None:
        with self.lock:
            c = self.collector
        return c.snapshot() if c is not None else None

    def results(self) -> tuple[list[RequestRow], list[PolicyRun], list[WhatIfRow]]:
        with self.lock:
            return list(self.rows), list(self.runs), list(self.whatif)

    def trace(self, meta: dict | None = None) -> FleetTrace:
        """What this fleet measured, as a FleetTrace (the latest snapshot appended)."""
        snap = self.snapshot()
        with self.lock:
            snaps = list(self.snapshots) + ([snap] if snap is not None else [])
            return FleetTrace(tuple(snaps), tuple(self.rows), tuple(self.runs), tuple(self.whatif), dict(meta or {}))


# ----------------------------------------------------------------------------- attach


def parse_attach_lines(text: str) -> list[tuple[str, str, str]]:
    """One server per line: `BASE_URL [EVENTS_ENDPOINT [REPLAY_ENDPOINT]]` -> (url, events, replay).
    ValueError naming the line and the limit."""
    if not isinstance(text, str):
        raise ValueError("servers: expected text, one base URL per line")
    out = []
    for k, line in enumerate(text.splitlines(), 1):
        parts = line.split("#", 1)[0].split()
        if not parts:
            continue
        if len(parts) > 3:
            raise ValueError(f"servers, line {k}: expected `URL [events endpoint [replay endpoint]]`")
        try:
            url = normalise_base_url(parts[0])
        except ValueError as e:
            raise ValueError(f"servers, line {k}: {e}") from None
        eps = parts[1:] + ["", ""]
        for ep in eps[:2]:
            if ep and not ep.startswith(("tcp://", "ipc://")):
                raise ValueError(f"servers, line {k}: an events endpoint is tcp://HOST:PORT, got {ep[:60]!r}")
        out.append((url, eps[0], eps[1]))
    if not out:
        raise ValueError("servers: enter at least one base URL")
    if len(out) > MAX_ATTACH:
        raise ValueError(f"servers: at most {MAX_ATTACH} servers, got {len(out)}")
    if len({u for u, _, _ in out}) != len(out):
        raise ValueError("servers: a base URL is listed twice")
    return out


def instance_name(url: str, urls) -> str:
    """A short engine id for an attached server: `:PORT` when every server is on one host."""
    hosts = {urllib.parse.urlsplit(u).hostname for u in urls}
    p = urllib.parse.urlsplit(url)
    return f":{p.port}" if len(hosts) == 1 and p.port else p.netloc


class AttachedFleet:
    """Servers already running, attached by URL: their /metrics and KV events through a
    FleetCollector. Endpoints not given are read from GET /kv_event_sources (in the discovery
    thread, never on the page). Stops itself when the page stops calling touch()."""

    def __init__(self, text: str, router_url: str = "", idle_stop_s: float = IDLE_STOP_S):
        self.servers = parse_attach_lines(text)  # ValueError before any thread starts
        self.router_url = normalise_base_url(router_url) if router_url.strip() else ""
        self.idle_stop_s = idle_stop_s
        self.lock = threading.Lock()
        self.collector = None
        self.notes: list[str] = []
        self.error = ""
        self.status = "discovering"
        self._touched = time.monotonic()
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="kvscope-fleet-attach", daemon=True).start()

    def touch(self) -> None:
        self._touched = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        api, why = fleet_api()
        if api is None:
            with self.lock:
                self.error, self.status = why, "stopped"
            return
        collector = api[1]
        urls = [u for u, _, _ in self.servers]
        members, notes = [], []
        for url, ev, rp in self.servers:
            if not ev:
                src = kv_event_sources(url)
                if src:
                    ev = reachable_endpoint(src[0]["endpoint"], url)
                    if not rp and isinstance(src[0].get("replay_endpoint"), str):
                        rp = reachable_endpoint(src[0]["replay_endpoint"], url)
                    notes.append(f"{url}: events {ev} from its /kv_event_sources")
                else:
                    notes.append(f"{url}: no events endpoint given and no /kv_event_sources: no prefix tree for it")
            try:
                kind = detect_kind(url, timeout=3.0)[0]
            except ValueError as e:  # unreachable now: the collector marks it down with its reason
                kind = "unknown"
                notes.append(f"{url}: {e}")
            members.append(collector.Member(instance_name(url, urls), url, ev, rp, kind))
        try:
            c = collector.FleetCollector(members, router_url=self.router_url).start()
        except Exception as e:  # noqa: BLE001 - a bad endpoint: shown on the page
            with self.lock:
                self.error, self.status, self.notes = f"{type(e).__name__}: {e}", "stopped", notes
            return
        with self.lock:
            self.collector, self.notes, self.status = c, notes, "watching"
        while not self._stop.wait(1.0):
            if time.monotonic() - self._touched > self.idle_stop_s:
                break
        c.stop()
        with self.lock:
            self.status = "stopped"

    def snapshot(self) -> FleetSnapshot | None:
        with self.lock:
            c = self.collector
        return c.snapshot() if c is not None else None
