"""The watched-engine benchmark (issue 32): the same API request three ways in one run.

  .venv/bin/python scripts/watched_bench.py [--process 0|1] [--tokens 96] [--model default]

Starts the app as scripts/run.sh does (`streamlit run app_api.py`, live mode, the API on a free
localhost port), then streams one greedy completion of --tokens tokens (ignore_eos) from the API:
  1. alone: no browser connected;
  2. watched, idle: headless Chromium has the Playground open and idle (its live views polling);
  3. watched, drawing: the Playground generates its own 48-token answer at the same time.
Each is the median of --repeats requests. Reports TTFT and decode tokens/s (tokens after the
first, from the API's usage, / time from the first to the last streamed chunk) per way, the
watched / alone decode ratios, and the CPU seconds the Streamlit process, the app with its core
and Chromium spent while the page sat idle. KVSCOPE_ENGINE_PROCESS=--process chooses the
in-thread engine (0) or the engine-core process (1). Numbers are of this machine at this
moment: on a shared machine, run both settings back to back and compare ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
START_TIMEOUT_S = 900
REQUEST_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its threads (children excluded), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def model_id(api: str) -> str:
    with urllib.request.urlopen(f"{api}/v1/models", timeout=60) as r:
        return json.loads(r.read())["data"][0]["id"]


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and all its descendants (the app with its engine core; Chromium)."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return total


def chromium_cpu_seconds() -> float:
    """CPU seconds of this script's Chromium processes (children of Playwright's driver)."""
    import psutil

    total = 0.0
    for p in psutil.Process().children(recursive=True):
        try:
            if "chrom" in p.name().lower():
                t = p.cpu_times()
                total += t.user + t.system
        except psutil.Error:
            pass
    return total


def stream_request(api: str, tokens: int) -> dict:
    body = {
        "model": model_id(api),
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        f"{api}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    times, tokens_out = [], None
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens_out = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                times.append(time.perf_counter())
    n = tokens_out if tokens_out is not None else len(times)  # a chunk can carry several tokens
    return {
        "chunks": len(times),
        "tokens": n,
        "ttft_s": times[0] - t0 if times else None,
        "decode_tok_s": (n - 1) / (times[-1] - times[0]) if n > 1 and times[-1] > times[0] else None,
    }


def median_of(runs: list[dict]) -> dict:
    out = {"runs": runs}
    for k in ("ttft_s", "decode_tok_s"):
        vals = [r[k] for r in runs if r[k] is not None]
        out[k] = statistics.median(vals) if vals else None
    return out


def wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} did not answer within {timeout}s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--process", choices=("0", "1"), default=os.environ.get("KVSCOPE_ENGINE_PROCESS", "0"))
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model", default="default")
    ap.add_argument("--idle-s", type=float, default=20.0, help="how long the idle page is watched for CPU time")
    ap.add_argument("--out", help="write the result JSON here")
    a = ap.parse_args()

    port, api_port = free_port(), free_port()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "KVSCOPE_MODEL": a.model,
        "KVSCOPE_API_PORT": str(api_port),
        "KVSCOPE_ENGINE_PROCESS": a.process,
    }
    env.pop("KVSCOPE_TEST_MODE", None)
    log = tempfile.NamedTemporaryFile("w+", prefix="kvscope-watched-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "streamlit", "run", "app_api.py", "--server.headless", "true"]
    cmd += ["--server.port", str(port), "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false"]
    cmd += ["--server.fileWatcherType", "none", "--client.toolbarMode", "minimal", "--runner.postScriptGC", "false"]
    app = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url, api = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{api_port}"
    result: dict = {"engine_process": a.process == "1", "model": a.model, "tokens": a.tokens, "cpus": os.cpu_count()}
    try:
        wait_http(f"{api}/v1/models", START_TIMEOUT_S)
        stream_request(api, 8)  # warm-up
        result["alone"] = median_of([stream_request(api, a.tokens) for _ in range(a.repeats)])

        from playwright.sync_api import sync_playwright

        with sync_playwright() as pw:
            exe = os.environ.get("KVSCOPE_CHROMIUM", "/usr/bin/chromium")
            browser = pw.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(START_TIMEOUT_S * 1000)
            page.goto(f"{url}/playground")
            page.get_by_role("button", name="Generate").wait_for()
            time.sleep(3)
            c0, t0 = proc_cpu_seconds(app.pid), time.monotonic()
            all0, br0 = tree_cpu_seconds(app.pid), chromium_cpu_seconds()
            time.sleep(a.idle_s)
            per20 = 20 / (time.monotonic() - t0)
            result["idle_page_frontend_cpu_s_per_20s"] = (proc_cpu_seconds(app.pid) - c0) * per20
            result["idle_page_app_and_core_cpu_s_per_20s"] = (tree_cpu_seconds(app.pid) - all0) * per20
            result["idle_page_chromium_cpu_s_per_20s"] = (chromium_cpu_seconds() - br0) * per20
            result["watched_idle"] = median_of([stream_request(api, a.tokens) for _ in range(a.repeats)])
            runs = []
            for _ in range(a.repeats):
                page.get_by_role("button", name="Generate").click()
                time.sleep(0.5)  # the page's own request is under way and drawing
                runs.append(stream_request(api, a.tokens))
                page.get_by_role("button", name="Generate").wait_for(state="visible")
                time.sleep(8)  # let the page's answer finish before the next repeat
            result["watched_drawing"] = median_of(runs)
            browser.close()
        alone = result["alone"]["decode_tok_s"]
        for k in ("watched_idle", "watched_drawing"):
            d = result[k]["decode_tok_s"]
            result[f"{k}_ratio"] = d / alone if d and alone else None
    finally:
        os.killpg(app.pid, signal.SIGTERM)
        try:
            app.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(app.pid, signal.SIGKILL)
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
