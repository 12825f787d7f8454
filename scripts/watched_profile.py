"""Where the time goes while a page draws a running request (issue 32, case 3b of watched_bench).

  .venv/bin/python scripts/watched_profile.py [--process 1] [--repeats 3] [--chromium-cpus 0]

Starts the app as scripts/run.sh does, then runs case 3a (the measured API request beside the
Playground's kind of request, no browser) and case 3b (the same, the Playground generating its
request in headless Chromium) and, over each measured request, samples:
- CPU seconds of every process (the Streamlit process, the engine core, each Chromium process by
  its --type) and of each thread of the Streamlit and core processes;
- what the core was asked and what it spent (its KVSCOPE_CORE_STATS file: commands by name with
  their seconds, steps and their seconds, snapshot frames built, their seconds and bytes);
- the core's own decode rate for each finished request (its token times) next to the API's
  (streamed chunks);
- the websocket frames and bytes the Playground received (its redraw rate).
--chromium-cpus pins Chromium (taskset) to those CPUs: a measurement of the roof Chromium sets on
2 cores, not something the app needs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import watched_bench as wb  # noqa: E402


def thread_times(pid: int) -> dict[str, float]:
    """{'name/tid': cpu seconds} of every thread of `pid`."""
    out = {}
    tck = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            f = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            out[f"{name}/{tid}"] = (int(f[11]) + int(f[12])) / tck
        except OSError:
            pass
    return out


def processes(app_pid: int) -> dict[str, int]:
    """{label: pid}: the Streamlit process, the engine core, each Chromium process."""
    import psutil

    procs = {"streamlit": app_pid}
    for p in psutil.Process(app_pid).children(recursive=True):
        try:
            cl = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "spawn_main" in cl:
            procs.setdefault("core", p.pid)
    for p in psutil.Process().children(recursive=True):
        try:
            if "chrom" in p.name().lower():
                cl = p.cmdline()
                typ = next((a.split("=", 1)[1] for a in cl if a.startswith("--type=")), "browser")
                extra = next((a.split("=", 1)[1] for a in cl if a.startswith("--utility-sub-type=")), "")
                procs[f"chromium:{typ}{':' + extra if extra else ''}:{p.pid}"] = p.pid
        except psutil.Error:
            pass
    return procs


def sample(app_pid: int) -> dict:
    procs = processes(app_pid)
    out = {"proc": {}, "threads": {}}
    for label, pid in procs.items():
        try:
            out["proc"][label] = wb.proc_cpu_seconds(pid)
        except OSError:
            pass
        if label in ("streamlit", "core"):
            out["threads"][label] = thread_times(pid)
    out["t"] = time.monotonic()
    return out


def diff(a: dict, b: dict) -> dict:
    dt = b["t"] - a["t"]
    proc = {k: round(v - a["proc"].get(k, 0.0), 2) for k, v in b["proc"].items()}
    threads = {}
    for label, th in b["threads"].items():
        prev = a["threads"].get(label, {})
        d = {k: round(v - prev.get(k, 0.0), 2) for k, v in th.items()}
        threads[label] = {k: v for k, v in sorted(d.items(), key=lambda kv: -kv[1]) if v >= 0.02}
    return {"wall_s": round(dt, 2), "cpu_s": proc, "threads": threads}


def read_stats(path: str) -> dict:
    for _ in range(20):
        try:
            return json.loads(Path(path).read_text())
        except (OSError, ValueError):
            time.sleep(0.1)
    return {}


def stats_diff(a: dict, b: dict) -> dict:
    ops = {}
    for op, (n, s) in b.get("ops", {}).items():
        n0, s0 = a.get("ops", {}).get(op, (0, 0.0))
        if n - n0:
            ops[op] = {"n": n - n0, "s": round(s - s0, 4)}
    d = {k: b.get(k, 0) - a.get(k, 0) for k in ("steps", "step_s", "frames", "frame_s", "frame_bytes")}
    d["step_ms_mean"] = round(1000 * d["step_s"] / d["steps"], 2) if d["steps"] else None
    d["frame_ms_mean"] = round(1000 * d["frame_s"] / d["frames"], 2) if d["frames"] else None
    d["frame_kb_mean"] = round(d["frame_bytes"] / d["frames"] / 1024, 1) if d["frames"] else None
    return {"ops": ops, **{k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()}}


def core_decode(stats: dict, n_tokens: int) -> float | None:
    """The core's own decode rate for the last API request of n_tokens tokens."""
    for rid, origin, n, t0, t1 in reversed(stats.get("recent", [])):
        if n == n_tokens and t0 is not None and t1 > t0:
            return (n - 1) / (t1 - t0)
    return None


def measured(app_pid: int, stats_path: str, run) -> dict:
    """run() -> the API result; sampled around it."""
    s0, c0 = sample(app_pid), read_stats(stats_path)
    r = run()
    time.sleep(1.2)  # the core rewrites its stats file about once a second
    s1, c1 = sample(app_pid), read_stats(stats_path)
    return {
        "api_decode_tok_s": r["decode_tok_s"],
        "core_decode_tok_s": core_decode(c1, r["tokens"]),
        "ttft_s": r["ttft_s"],
        "cpu": diff(s0, s1),
        "core": stats_diff(c0, c1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--process", choices=("0", "1"), default="1")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--chromium-cpus", default="", help="taskset Chromium to these CPUs (a roof measurement)")
    ap.add_argument("--out")
    a = ap.parse_args()
    stats_path = tempfile.mktemp(prefix="kvscope-core-stats-", suffix=".json")
    log = tempfile.NamedTemporaryFile("w+", prefix="kvscope-profile-", suffix=".log", delete=False)
    app, url, api = wb.start_app({"KVSCOPE_ENGINE_PROCESS": a.process, "KVSCOPE_CORE_STATS": stats_path}, log)
    res: dict = {"process": a.process, "loadavg_start": os.getloadavg(), "chromium_cpus": a.chromium_cpus or None}
    try:
        wb.wait_http(f"{api}/v1/models", wb.START_TIMEOUT_S)
        wb.stream_request(api, 8)
        res["alone"] = [
            measured(app.pid, stats_path, lambda: wb.stream_request(api, a.tokens)) for _ in range(a.repeats)
        ]
        res["3a"] = [measured(app.pid, stats_path, lambda: wb.with_companion(api, a.tokens)) for _ in range(a.repeats)]
        from playwright.sync_api import sync_playwright

        with sync_playwright() as pw:
            exe = os.environ.get("KVSCOPE_CHROMIUM", "/usr/bin/chromium")
            launch = [exe]
            if a.chromium_cpus:
                wrapper = tempfile.NamedTemporaryFile("w", suffix=".sh", delete=False)
                wrapper.write(f'#!/bin/sh\nexec taskset -c {a.chromium_cpus} {exe} "$@"\n')
                wrapper.close()
                os.chmod(wrapper.name, 0o755)
                launch = [wrapper.name]
            browser = pw.chromium.launch(executable_path=launch[0], headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            ws = {"frames": 0, "bytes": 0}

            def on_ws(w):
                def got(payload):
                    ws["frames"] += 1
                    ws["bytes"] += len(payload)

                w.on("framereceived", got)

            page.on("websocket", on_ws)
            page.set_default_timeout(wb.START_TIMEOUT_S * 1000)
            page.goto(f"{url}/playground")
            page.get_by_role("button", name="Generate").wait_for()
            page.set_default_timeout(wb.ACTION_TIMEOUT_S * 1000)
            time.sleep(3)
            idle0 = sample(app.pid)
            w0 = dict(ws)
            time.sleep(10)
            res["idle_page_10s"] = {**diff(idle0, sample(app.pid)), "ws_frames": ws["frames"] - w0["frames"]}
            runs = []
            for _ in range(a.repeats):
                w0 = dict(ws)
                t0 = time.monotonic()

                def run():
                    page.get_by_role("button", name="Generate").click()
                    time.sleep(wb.LEAD_S)
                    return wb.stream_request(api, a.tokens)

                m = measured(app.pid, stats_path, run)
                dt = time.monotonic() - t0
                m["ws_frames"], m["ws_kb"] = ws["frames"] - w0["frames"], round((ws["bytes"] - w0["bytes"]) / 1024)
                m["ws_frames_per_s"] = round(m["ws_frames"] / dt, 1)
                runs.append(m)
                try:
                    page.get_by_role("button", name="Generate").wait_for(state="visible")
                except Exception as e:  # noqa: BLE001 - playwright's TimeoutError: note it, go on
                    m["page_wait_error"] = str(e).splitlines()[0]
                time.sleep(6)
            res["3b"] = runs
            browser.close()
        res["loadavg_end"] = os.getloadavg()
    finally:
        wb.stop_app(app)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "profile"
    sys.exit(main())
