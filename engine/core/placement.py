"""Where the engine core and the front end run on this machine's CPUs (issue 32).

On a machine with few cores the step loop and the drawing must not fight: `plan()` gives the core
process every allowed CPU but the first and the front end (the Streamlit process: pages, charts,
the API) the first one; KVSCOPE_CORE_CPUS ("1" or "2,3") names the core's CPUs instead. With a
single allowed CPU nothing is pinned. `pin()` applies a set to every thread of this process
(os.sched_setaffinity where the OS allows; a container may refuse: then nothing changes and the
process still runs). `prioritize()` (called first in the core and the lab process) gives that process a session of its
own and a lower nice value where the OS allows (CORE_NICE; KVSCOPE_CORE_NICE, 0 = unchanged), so a
browser drawing on the same CPUs does not take half of the core's time. `describe()` reads what a
process really has from the OS: its pid, the CPUs it may run on, its OS threads, its nice value and
scheduler group and, for this process, torch's intra-op thread count.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Plan:
    core: list[int] | None  # CPUs of the core process (None: wherever the OS puts it)
    front: list[int] | None  # CPUs of the front end


def allowed_cpus(pid: int = 0) -> list[int] | None:
    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        return sorted(os.sched_getaffinity(pid))
    except OSError:
        return None


INITIAL_CPUS = None  # this process's CPUs before pin() changed them (set below)


def cpus_from_env(name: str = "KVSCOPE_CORE_CPUS") -> list[int] | None:
    """A CPU list from the environment ("1" or "2,3"): KVSCOPE_CORE_CPUS, the CPUs the core
    process is pinned to, or KVSCOPE_FRONT_CPUS, the front end's; unset: the default plan.
    ValueError naming the variable if malformed."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        cpus = sorted({int(x) for x in raw.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"{name} must be CPU numbers separated by commas, got {raw[:40]!r}") from None
    if not cpus or cpus[0] < 0:
        raise ValueError(f"{name} must name at least one CPU >= 0, got {raw[:40]!r}")
    return cpus


def plan(allowed: list[int] | None = None, core: list[int] | None = None, front: list[int] | None = None) -> Plan:
    """The core on every allowed CPU but the first, the front end on the first (`core` given:
    the core there, the front end on the rest, or everywhere if the core took them all;
    `front` given: the front end there, whatever the core got)."""
    allowed = INITIAL_CPUS if allowed is None else sorted(allowed)
    core = cpus_from_env("KVSCOPE_CORE_CPUS") if core is None else core
    front = cpus_from_env("KVSCOPE_FRONT_CPUS") if front is None else front
    if core:
        rest = [c for c in (allowed or []) if c not in core]
        return Plan(core=sorted(core), front=front or rest or None)
    if not allowed or len(allowed) < 2:
        return Plan(core=None, front=front or None)
    return Plan(core=allowed[1:], front=front or allowed[:1])


CORE_NICE = -10  # the core's (and the lab process's) nice value; KVSCOPE_CORE_NICE overrides, 0 = leave it


def core_nice_from_env() -> int:
    """KVSCOPE_CORE_NICE: the nice value the core asks for (-20..19; 0 leaves the priority as it
    is); unset: CORE_NICE. ValueError naming the variable if malformed."""
    raw = os.environ.get("KVSCOPE_CORE_NICE", "").strip()
    if not raw:
        return CORE_NICE
    try:
        nice = int(raw)
    except ValueError:
        raise ValueError(f"KVSCOPE_CORE_NICE must be an integer in [-20, 19], got {raw[:40]!r}") from None
    if not -20 <= nice <= 19:
        raise ValueError(f"KVSCOPE_CORE_NICE must be in [-20, 19], got {nice}")
    return nice


def prioritize(nice: int | None = None) -> bool:
    """Put this process (the engine core, or the lab process) ahead of the front end and a browser
    on the same machine when they want the same CPU. Call it first thing in the child, before it
    starts threads (they inherit it). It first leaves the parent's session (os.setsid): with
    sched_autogroup on (most desktop and server kernels) the scheduler shares CPU time between
    sessions before threads, so a busy browser's session took half of the core's CPU, and raising
    the core's own session raises nothing else. Then it lowers that session's nice value
    (/proc/self/autogroup) and this thread's (setpriority) to `nice`. Lowering needs CAP_SYS_NICE
    (root without dropped capabilities); where it is refused the priority stays as it was and the
    process runs all the same. True if a lower nice value took effect; describe() says what holds."""
    nice = core_nice_from_env() if nice is None else nice
    if nice == 0 or not hasattr(os, "setsid"):
        return False
    try:
        os.setsid()
    except OSError:
        pass  # already a session leader: its session is its own
    ok = False
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
        ok = True
    except OSError:
        pass  # no autogroup here, or not allowed
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        ok = True
    except (OSError, AttributeError):
        pass
    return ok


def autogroup(pid: int) -> str | None:
    """The scheduler group a process shares CPU time in and its nice value ("/autogroup-12 nice -10"),
    None where the kernel has no autogroups."""
    try:
        with open(f"/proc/{pid}/autogroup") as f:
            return f.read().strip() or None
    except OSError:
        return None


def pin(cpus: list[int] | None) -> bool:
    """Pin every thread of this process (and the threads it starts later) to `cpus`. False where
    the OS refuses or there is nothing to pin."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return False
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    ok = False
    for tid in tids:
        try:
            os.sched_setaffinity(tid, set(cpus))
            ok = True
        except OSError:
            pass  # not allowed here (container limits), or the thread ended meanwhile
    return ok


def os_threads(pid: int) -> int | None:
    """The number of OS threads of process `pid` (/proc/<pid>/status), None where unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def torch_threads() -> int | None:
    """torch's intra-op thread count in this process (None when torch is not loaded here)."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


def describe(pid: int | None = None) -> dict:
    """What the OS says about a process now: pid, cpus (the CPUs it may run on), os_threads and,
    for this process, torch_threads."""
    own = pid is None or pid == os.getpid()
    pid = os.getpid() if pid is None else pid
    d = {"pid": pid, "cpus": allowed_cpus(0 if own else pid), "os_threads": os_threads(pid)}
    try:
        d["nice"] = os.getpriority(os.PRIO_PROCESS, pid)
    except (OSError, AttributeError):
        d["nice"] = None
    d["autogroup"] = autogroup(pid)
    if own:
        d["torch_threads"] = torch_threads()
    return d


def tell_front_end(cpus: list[int] | None) -> dict:
    """The front end's share: pinned to `cpus` where allowed and torch told to use as many
    threads (the front end's torch work is small: snapshots, tokenizers). Returns describe()."""
    if cpus:
        pin(cpus)
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_num_threads(len(cpus))
    return describe()


INITIAL_CPUS = allowed_cpus()
