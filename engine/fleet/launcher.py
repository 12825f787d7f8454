"""Start and stop a local fleet: N `python -m engine serve` instances on 127.0.0.1 (each with its
own API, KV-event and replay ports and engine id), optionally the vLLM peer from scripts/peers.sh,
and `vllm-router` in front with a chosen policy.

    fleet = up(plan(3, policy="kv_aware", model="tiny"))   # FleetError names the cause on failure
    ...
    restart_router(fleet, "round_robin")
    down(fleet.state_dir)                                  # stops exactly what up() started

The state (pids, ports, logs) is a JSON file in the state dir (default ~/.cache/kvscope/fleet),
so `python -m engine fleet down` in another process stops the same fleet. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path

POLICIES = ("round_robin", "kv_aware", "cache_aware", "random", "power_of_two", "consistent_hash")
ROUTER_PIN = "vllm-router==0.1.17"
STATE_FILE = "fleet.json"
ROOT = Path(__file__).resolve().parents[2]


class FleetError(RuntimeError):
    """A fleet could not start or stop; the message names the cause."""


def default_state_dir() -> Path:
    base = os.environ.get("KVSCOPE_CACHE_DIR") or str(Path.home() / ".cache" / "kvscope")
    return Path(base) / "fleet"


@dataclass(frozen=True)
class InstanceSpec:
    engine_id: str
    port: int
    events_port: int
    replay_port: int
    kind: str = "kvscope"  # kvscope / vllm
    pid: int | None = None
    log: str = ""
    proc_start: int | None = None  # the process's start time (/proc/PID/stat): never stop a reused pid
    # vLLM's publisher connects (does not bind) to a concrete tcp endpoint but binds an ipc:// one,
    # so the vLLM peer publishes on ipc sockets in this folder ("" = tcp on the ports above)
    ipc_dir: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events(self) -> str:
        if self.ipc_dir:
            return f"ipc://{self.ipc_dir}/{self.engine_id}-events.sock"
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay(self) -> str:
        if self.ipc_dir:
            return f"ipc://{self.ipc_dir}/{self.engine_id}-replay.sock"
        return f"tcp://127.0.0.1:{self.replay_port}"


@dataclass(frozen=True)
class RouterSpec:
    port: int
    prometheus_port: int
    policy: str = "kv_aware"
    pid: int | None = None
    log: str = ""
    proc_start: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(frozen=True)
class Fleet:
    instances: tuple[InstanceSpec, ...]
    router: RouterSpec
    model: str = "tiny"
    block_size: int = 16
    num_blocks: int | None = 256
    state_dir: str = ""
    extra_serve_args: tuple[str, ...] = ()
    served_model_name: str = ""

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def to_dict(self) -> dict:
        d = asdict(self)
        d["instances"] = [asdict(i) for i in self.instances]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Fleet:
        return cls(
            instances=tuple(InstanceSpec(**i) for i in d["instances"]),
            router=RouterSpec(**d["router"]),
            model=d.get("model", "tiny"),
            block_size=int(d.get("block_size", 16)),
            num_blocks=d.get("num_blocks"),
            state_dir=d.get("state_dir", ""),
            extra_serve_args=tuple(d.get("extra_serve_args", ())),
            served_model_name=d.get("served_model_name", ""),
        )


def plan(
    n: int,
    *,
    policy: str = "kv_aware",
    model: str = "tiny",
    base_port: int = 18000,
    block_size: int = 16,
    num_blocks: int | None = 256,
    with_vllm: bool = False,
    state_dir: str | Path | None = None,
    extra_serve_args: tuple[str, ...] = (),
) -> Fleet:
    """The ports and names of a fleet (nothing started). Instance i uses base_port+i (API),
    base_port+100+i (events), base_port+200+i (replay); the router base_port+300 and its
    Prometheus exporter base_port+301. The vLLM peer, when asked for, is instance n."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 16:
        raise FleetError(f"instances must be an integer in [1, 16], got {n!r}")
    if policy not in POLICIES:
        raise FleetError(f"policy must be one of {POLICIES}, got {policy!r}")
    if not 1024 <= base_port <= 65535 - 400:
        raise FleetError(f"base_port must be in [1024, {65535 - 400}], got {base_port}")
    if num_blocks is not None and not 8 <= num_blocks <= 1_000_000:
        raise FleetError(f"num_blocks must be in [8, 1000000], got {num_blocks}")
    if with_vllm and model != "default":
        raise FleetError(f"--with-vllm needs --model default (the vLLM peer serves the default model), got {model!r}")
    state_dir = str(state_dir or default_state_dir())
    insts = [InstanceSpec(f"e{i}", base_port + i, base_port + 100 + i, base_port + 200 + i) for i in range(n)]
    if with_vllm:
        insts.append(
            InstanceSpec(
                "vllm", base_port + n, base_port + 100 + n, base_port + 200 + n, kind="vllm", ipc_dir=state_dir
            )
        )
    return Fleet(
        tuple(insts),
        RouterSpec(base_port + 300, base_port + 301, policy),
        model,
        block_size,
        num_blocks,
        state_dir,
        tuple(extra_serve_args),
    )


# ------------------------------------------------------------------ helpers


def router_binary() -> str:
    """vllm-router next to this Python (the venv's bin), else on PATH."""
    here = Path(sys.executable).parent / "vllm-router"
    if here.exists():
        return str(here)
    import shutil

    found = shutil.which("vllm-router")
    if found:
        return found
    raise FleetError(
        f"the router binary vllm-router is missing (looked next to {sys.executable} and on PATH): "
        f"pip install {ROUTER_PIN}"
    )


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def log_tail(path: str, lines: int = 20) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return 200 <= r.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child counts as dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def proc_start(pid: int | None) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _same_process(pid: int | None, start: int | None) -> bool:
    return pid_alive(pid) and (start is None or proc_start(pid) == start)


_CHILDREN: dict[int, subprocess.Popen] = {}  # what this process started (reaped on stop)


def _spawn(cmd: list[str], log: Path, env: dict | None = None) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as f:
        p = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env
        )
    _CHILDREN[p.pid] = p
    return p.pid


def _reap(pid: int, wait_s: float = 0.0) -> None:
    """Collect our child's exit status. A multi-threaded process shows as a zombie before its
    other threads are gone and cannot be reaped until then: wait_s bounds that wait."""
    p = _CHILDREN.get(pid)
    if p is None:
        return
    try:
        done = p.wait(timeout=wait_s) is not None if wait_s > 0 else p.poll() is not None
    except subprocess.TimeoutExpired:
        done = False
    if done:
        _CHILDREN.pop(pid, None)


def _stop_pid(pid: int | None, start: int | None, timeout: float = 15.0) -> bool:
    """SIGTERM then SIGKILL the process group of pid, only if it is still the process we started
    (same start time: never a pid the OS reused for something else). True if it was running."""
    if pid:
        _reap(pid)
    if not _same_process(pid, start):
        return False
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                _reap(pid, 5.0)  # exited meanwhile (a zombie group leader answers ESRCH)
                return True
        end = time.monotonic() + wait
        while time.monotonic() < end:
            _reap(pid)
            if not pid_alive(pid):
                _reap(pid, 5.0)
                return True
            time.sleep(0.1)
    _reap(pid, 5.0)
    return True


def _serve_env() -> dict:
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONHASHSEED", "0")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def serve_command(fleet: Fleet, inst: InstanceSpec) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "engine",
        "serve",
        "--model",
        fleet.model,
        "--port",
        str(inst.port),
        "--instance-id",
        inst.engine_id,
        "--kv-events-endpoint",
        inst.events,
        "--kv-events-replay-endpoint",
        inst.replay,
        "--block-size",
        str(fleet.block_size),
    ]
    if fleet.num_blocks is not None:
        cmd += ["--num-kv-blocks", str(fleet.num_blocks)]
    return cmd + list(fleet.extra_serve_args)


def router_command(fleet: Fleet, policy: str) -> list[str]:
    insts = [i for i in fleet.instances]
    cmd = [
        router_binary(),
        "--host",
        "127.0.0.1",
        "--port",
        str(fleet.router.port),
        "--prometheus-port",
        str(fleet.router.prometheus_port),
        "--policy",
        policy,
        "--worker-urls",
        *[i.url for i in insts],
        "--worker-startup-timeout-secs",
        "60",
        "--health-check-interval-secs",
        "2",
        "--health-failure-threshold",
        "2",
        "--log-level",
        "debug",  # the kv_aware decision lines (credited prefix tokens) are debug
    ]
    if policy == "kv_aware":
        for i in insts:
            cmd += ["--kv-event-source", f"{i.url}={i.events}", "--kv-event-replay-source", f"{i.url}={i.replay}"]
        cmd += ["--kv-event-block-size", str(fleet.block_size), "--kv-event-model", fleet.model_name]
    return cmd


def _wait_instances(fleet: Fleet, timeout_s: float) -> None:
    pending = {i.engine_id: i for i in fleet.instances}
    end = time.monotonic() + timeout_s
    while pending:
        for eid, i in list(pending.items()):
            if not pid_alive(i.pid):
                raise FleetError(
                    f"instance {eid} ({i.url}) exited before it came up; its log ({i.log}) ends:\n{log_tail(i.log)}"
                )
            if http_ok(i.url + "/health"):
                pending.pop(eid)
        if not pending:
            return
        if time.monotonic() > end:
            i = next(iter(pending.values()))
            raise FleetError(
                f"instance {i.engine_id} ({i.url}) not up after {timeout_s:.0f}s; its log ({i.log}) ends:\n"
                f"{log_tail(i.log)}"
            )
        time.sleep(0.5)


def _wait_router(fleet: Fleet, timeout_s: float) -> None:
    r = fleet.router
    end = time.monotonic() + timeout_s
    while not http_ok(r.url + "/health"):
        if not pid_alive(r.pid):
            raise FleetError(f"vllm-router exited at start; its log ({r.log}) ends:\n{log_tail(r.log)}")
        if time.monotonic() > end:
            raise FleetError(f"vllm-router not up after {timeout_s:.0f}s; its log ({r.log}) ends:\n{log_tail(r.log)}")
        time.sleep(0.3)


def _write_state(fleet: Fleet) -> None:
    d = Path(fleet.state_dir)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(fleet.to_dict(), indent=1))
    tmp.replace(d / STATE_FILE)


def read_state(state_dir: str | Path | None = None) -> Fleet | None:
    p = Path(state_dir or default_state_dir()) / STATE_FILE
    if not p.exists():
        return None
    return Fleet.from_dict(json.loads(p.read_text()))


def _check_ports(fleet: Fleet) -> None:
    for i in fleet.instances:
        ports = [("API", i.port)] + ([] if i.ipc_dir else [("KV-event", i.events_port), ("replay", i.replay_port)])
        for what, port in ports:
            if port_in_use(port):
                raise FleetError(f"port {port} ({i.engine_id}'s {what} port) is taken on 127.0.0.1")
    for what, port in (("router", fleet.router.port), ("router metrics", fleet.router.prometheus_port)):
        if port_in_use(port):
            raise FleetError(f"port {port} (the {what} port) is taken on 127.0.0.1")


def start_router(fleet: Fleet, policy: str, timeout_s: float = 60.0) -> Fleet:
    if policy not in POLICIES:
        raise FleetError(f"policy must be one of {POLICIES}, got {policy!r}")
    cmd = router_command(fleet, policy)
    for what, port in (("router", fleet.router.port), ("router metrics", fleet.router.prometheus_port)):
        end = time.monotonic() + 10  # a router just stopped may hold its port a moment
        while port_in_use(port):
            if time.monotonic() > end:
                raise FleetError(f"port {port} (the {what} port) is taken on 127.0.0.1")
            time.sleep(0.2)
    log = Path(fleet.state_dir) / f"router-{policy}.log"
    pid = _spawn(cmd, log)
    fleet = replace(
        fleet, router=replace(fleet.router, pid=pid, policy=policy, log=str(log), proc_start=proc_start(pid))
    )
    _write_state(fleet)
    try:
        _wait_router(fleet, timeout_s)
    except FleetError:
        _stop_pid(pid, fleet.router.proc_start)
        raise
    return fleet


def stop_router(fleet: Fleet) -> Fleet:
    _stop_pid(fleet.router.pid, fleet.router.proc_start)
    fleet = replace(fleet, router=replace(fleet.router, pid=None, proc_start=None))
    _write_state(fleet)
    return fleet


def restart_router(fleet: Fleet, policy: str, timeout_s: float = 60.0) -> Fleet:
    return start_router(stop_router(fleet), policy, timeout_s)


def vllm_peer_installed() -> bool:
    base = Path(os.environ.get("KVSCOPE_CACHE_DIR") or Path.home() / ".cache" / "kvscope")
    return (base / "peers" / "vllm" / "bin" / "vllm").exists()


def _start_vllm(fleet: Fleet, inst: InstanceSpec) -> InstanceSpec:
    peers = ROOT / "scripts" / "peers.sh"
    log = Path(fleet.state_dir) / f"{inst.engine_id}.log"
    pidfile = Path(fleet.state_dir) / "vllm.pid"
    env = dict(os.environ)
    env.update(
        VLLM_PORT=str(inst.port),
        VLLM_EVENTS=inst.events,
        VLLM_REPLAY=inst.replay,
        VLLM_PIDFILE=str(pidfile),
        VLLM_LOG=str(log),
        VLLM_WAIT_S="600",
    )
    r = subprocess.run(["bash", str(peers), "vllm-start"], env=env, capture_output=True, text=True, timeout=660)
    if r.returncode != 0:
        raise FleetError(f"the vLLM peer did not come up: {(r.stderr or r.stdout).strip()[-2000:]}")
    pid = int(pidfile.read_text().strip())
    return replace(inst, pid=pid, log=str(log), proc_start=proc_start(pid))


def up(fleet: Fleet, timeout_s: float = 300.0, router_timeout_s: float = 60.0) -> Fleet:
    """Start every instance, wait (bounded) until each answers /health, then the router.
    On any failure stops what it started and raises FleetError naming the cause."""
    old = read_state(fleet.state_dir)
    if old is not None and (
        any(_same_process(i.pid, i.proc_start) for i in old.instances)
        or _same_process(old.router.pid, old.router.proc_start)
    ):
        raise FleetError(f"a fleet is already running from {fleet.state_dir}: `python -m engine fleet down` first")
    router_binary()  # fail before starting anything
    if any(i.kind == "vllm" for i in fleet.instances) and not vllm_peer_installed():
        raise FleetError("the vLLM peer is not installed: scripts/peers.sh install-vllm")
    _check_ports(fleet)
    started: list[InstanceSpec] = []
    try:
        for inst in fleet.instances:
            if inst.kind == "vllm":
                continue
            log = Path(fleet.state_dir) / f"{inst.engine_id}.log"
            pid = _spawn(serve_command(fleet, inst), log, _serve_env())
            started.append(replace(inst, pid=pid, log=str(log), proc_start=proc_start(pid)))
            _write_state(replace(fleet, instances=tuple(started)))
        fleet = replace(
            fleet,
            instances=tuple(next((s for s in started if s.engine_id == i.engine_id), i) for i in fleet.instances),
        )
        _write_state(fleet)
        _wait_instances(replace(fleet, instances=tuple(started)), timeout_s)
        vllm = [i for i in fleet.instances if i.kind == "vllm"]
        if vllm:
            v = _start_vllm(fleet, vllm[0])
            fleet = replace(fleet, instances=tuple(v if i.kind == "vllm" else i for i in fleet.instances))
            _write_state(fleet)
        fleet = start_router(fleet, fleet.router.policy, router_timeout_s)
    except BaseException:
        down(fleet.state_dir)
        raise
    return fleet


def down(state_dir: str | Path | None = None) -> list[str]:
    """Stop exactly what up() started (from the state file); returns what was stopped."""
    fleet = read_state(state_dir)
    if fleet is None:
        return []
    stopped = []
    if _stop_pid(fleet.router.pid, fleet.router.proc_start):
        stopped.append(f"router (pid {fleet.router.pid}, port {fleet.router.port})")
    for i in fleet.instances:
        if i.kind == "vllm" and i.pid:
            env = dict(os.environ, VLLM_PIDFILE=str(Path(fleet.state_dir) / "vllm.pid"))
            subprocess.run(
                ["bash", str(ROOT / "scripts" / "peers.sh"), "vllm-stop"], env=env, capture_output=True, timeout=60
            )
            stopped.append(f"{i.engine_id} (pid {i.pid}, port {i.port})")
        elif _stop_pid(i.pid, i.proc_start):
            stopped.append(f"{i.engine_id} (pid {i.pid}, port {i.port})")
    (Path(fleet.state_dir) / STATE_FILE).unlink(missing_ok=True)
    return stopped


def kill_instance(fleet: Fleet, engine_id: str) -> None:
    """SIGKILL one instance (a fault, as a crash would be)."""
    inst = next((i for i in fleet.instances if i.engine_id == engine_id), None)
    if inst is None or not inst.pid:
        raise FleetError(f"no running instance {engine_id!r} in this fleet")
    if _same_process(inst.pid, inst.proc_start):
        os.killpg(inst.pid, signal.SIGKILL)
        end = time.monotonic() + 10
        while pid_alive(inst.pid) and time.monotonic() < end:
            _reap(inst.pid)
            time.sleep(0.05)
        _reap(inst.pid, 5.0)


__all__ = [
    "POLICIES",
    "Fleet",
    "FleetError",
    "InstanceSpec",
    "RouterSpec",
    "default_state_dir",
    "down",
    "kill_instance",
    "plan",
    "read_state",
    "restart_router",
    "router_binary",
    "start_router",
    "stop_router",
    "up",
]
