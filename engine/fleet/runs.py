"""The same workload under several routing policies, one after the other, on cleared caches:
restart vllm-router with the policy, empty every instance's prefix cache (POST
/reset_prefix_cache), send the workload through the gateway, summarize. Collects a FleetTrace
(snapshots during the runs, the ledger, the summaries, the what-if replays)."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.fleet import launcher, whatif
from engine.fleet.collector import FleetCollector, http_json, members_of
from engine.fleet.state import FleetSnapshot, FleetTrace, PolicyRun, RequestRow, WhatIfRow
from engine.fleet.workload import attach_router_credits, router_credits, run_workload, summarize


def clear_caches(fleet) -> dict[str, int | str]:
    """POST /reset_prefix_cache on every instance; {engine_id: blocks dropped, or the error}."""
    out: dict[str, int | str] = {}
    for i in fleet.instances:
        try:
            out[i.engine_id] = int(http_json(i.url + "/reset_prefix_cache", "POST", {}).get("dropped_blocks", 0))
        except Exception as e:  # noqa: BLE001 - vLLM answers 200 with no body; a dead instance an error
            out[i.engine_id] = f"{type(e).__name__}: {str(e)[:120]}"
    return out


def _preemptions(snap: FleetSnapshot) -> int:
    return sum(i.preemptions or 0 for i in snap.instances)


@dataclass
class Session:
    """What compare_policies() gathered."""

    fleet: object
    runs: list[PolicyRun] = field(default_factory=list)
    rows: list[RequestRow] = field(default_factory=list)
    snapshots: list[FleetSnapshot] = field(default_factory=list)
    whatif: list[WhatIfRow] = field(default_factory=list)
    streams: dict[str, list] = field(default_factory=dict)

    def trace(self, meta: dict | None = None) -> FleetTrace:
        return FleetTrace(
            snapshots=tuple(self.snapshots),
            requests=tuple(self.rows),
            runs=tuple(self.runs),
            whatif=tuple(self.whatif),
            meta=dict(meta or {}),
        )


def compare_policies(
    fleet,
    policies,
    requests,
    *,
    concurrency: int = 4,
    sample_every_s: float = 1.0,
    workload: str = "release-freeze",
    on_row=None,
    after_start=None,
) -> Session:
    """Run `requests` under each policy in turn (router restarted, caches cleared). `after_start(
    fleet, collector, policy)` is called (in a thread) when the run's first request has finished,
    so the load is flowing (fault injection)."""
    sess = Session(fleet)
    urls = [i.url for i in fleet.instances]
    collector = FleetCollector(members_of(fleet), router_url=fleet.router.url, block_size=fleet.block_size).start()
    try:
        for policy in policies:
            if fleet.router.policy != policy or not launcher.pid_alive(fleet.router.pid):
                fleet = launcher.restart_router(fleet, policy)
            clear_caches(fleet)
            collector.wait_quiet(timeout_s=5.0)
            collector.policy = policy
            collector.forget_history()
            before = collector.snapshot()
            stop = threading.Event()

            def sampler(stop=stop):
                while not stop.wait(sample_every_s):
                    sess.snapshots.append(collector.snapshot())

            th = threading.Thread(target=sampler, name="fleet-sampler", daemon=True)
            th.start()
            stream: list = []
            t0 = time.perf_counter()
            first_row = threading.Event()

            def row_done(row, policy=policy, first_row=first_row, fleet=fleet):
                if after_start is not None and not first_row.is_set():
                    first_row.set()  # the load is flowing: start the fault clock now
                    threading.Thread(target=after_start, args=(fleet, collector, policy), daemon=True).start()
                if on_row is not None:
                    on_row(row)

            rows = run_workload(
                fleet.router.url,
                fleet.model_name,
                requests,
                instance_urls=urls,
                collector=collector,
                policy=policy,
                concurrency=concurrency,
                block_size=fleet.block_size,
                on_row=row_done,
                stream_out=stream,
            )
            wall = time.perf_counter() - t0
            stop.set()
            th.join(timeout=5)
            collector.wait_quiet(timeout_s=5.0)
            after = collector.snapshot()
            sess.snapshots.append(after)
            if policy == "kv_aware" and fleet.router.log:
                try:
                    text = Path(fleet.router.log).read_text(errors="replace")
                    url_of = {i.engine_id: i.url for i in fleet.instances}
                    rows = attach_router_credits(rows, router_credits(text), url_of)
                except OSError:
                    pass
            sess.rows.extend(rows)
            sess.streams[policy] = stream
            sess.runs.append(
                summarize(
                    policy,
                    rows,
                    wall,
                    duplicated_blocks=after.tree.duplicated_blocks,
                    preemptions=_preemptions(after) - _preemptions(before),
                    workload=workload,
                    model=fleet.model,
                )
            )
        ids = [i.engine_id for i in fleet.instances]
        first = next(iter(sess.streams), None)
        if first is not None:
            cap = fleet.num_blocks or 256
            sess.whatif = whatif.replay_all(
                sess.streams[first], ids, capacity_blocks=cap, block_size=fleet.block_size, source=first
            )
    finally:
        collector.stop()
    sess.fleet = fleet
    return sess


def free_base_port(n_instances: int = 3, tries: int = 50) -> int:
    """A base port whose fleet ports (see launcher.plan) are all free on 127.0.0.1."""
    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(tries):
        base = rng.randrange(20000, 60000 - 400)
        ports = [base + off + k for off in (0, 100, 200) for k in range(n_instances + 1)] + [base + 300, base + 301]
        if not any(launcher.port_in_use(p) for p in ports):
            return base
    raise launcher.FleetError("no free range of ports for the fleet on 127.0.0.1")


def run_session(
    *,
    model: str = "tiny",
    n_instances: int = 3,
    n_requests: int = 24,
    num_blocks: int = 128,
    concurrency: int = 4,
    output_median: int = 16,
    seed: int = 0,
    policies=("round_robin", "kv_aware"),
    base_port: int | None = None,
    sample_every_s: float = 1.0,
    kill: str = "",
    kill_after_s: float = 2.0,
) -> Session:
    """Start a fleet on free ports, run the release-freeze workload under each policy, stop the
    fleet (always); returns the Session. `kill` (an engine id): SIGKILL that instance
    `kill_after_s` seconds into the last policy's run (a fault)."""
    from engine.fleet import workload

    state = tempfile.mkdtemp(prefix="kvscope-fleet-")
    fleet = launcher.plan(
        n_instances,
        policy=policies[0],
        model=model,
        base_port=base_port or free_base_port(n_instances),
        num_blocks=num_blocks,
        state_dir=state,
    )
    reqs = workload.release_freeze(
        n_requests,
        seed,
        turns=4,
        output_median=output_median,
        output_min=max(1, output_median // 4),
        output_max=output_median * 3,
    )
    if kill and kill not in {i.engine_id for i in fleet.instances}:
        ids = [i.engine_id for i in fleet.instances]
        raise launcher.FleetError(f"kill: no instance {kill!r} in this fleet ({ids})")
    last = list(policies)[-1]

    def fault(fl, _collector, policy):
        if kill and policy == last:
            time.sleep(kill_after_s)
            launcher.kill_instance(fl, kill)

    fleet = launcher.up(fleet, timeout_s=600)
    try:
        sess = compare_policies(
            fleet,
            list(policies),
            reqs,
            concurrency=concurrency,
            sample_every_s=sample_every_s,
            after_start=fault if kill else None,
        )
    finally:
        launcher.down(state)
    shutil.rmtree(state, ignore_errors=True)  # logs are kept when a run fails
    return sess


__all__ = ["Session", "clear_caches", "compare_policies", "free_base_port", "run_session"]
