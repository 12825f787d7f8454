"""The watched-engine benchmark (issue 32): the same API request three ways in one run.

  .venv/bin/python scripts/watched_bench.py [--process 0|1] [--tokens 96] [--model default]

Starts the app as scripts/run.sh does (`streamlit run app_api.py`, live mode, the API on a free
localhost port), then streams one greedy completion of --tokens tokens (ignore_eos) from the API,
three ways, each with and without a page watching, so every ratio compares the same load:
  1. alone: no browser connected;
  2. watched, idle: headless Chromium has the Playground open and idle (its live views polling);
     ratio 2 / 1;
  3. a running load of two requests: the measured one plus the Playground's kind of request (the
     Playground's example prompt, 48 tokens, greedy, chat template), started 0.5 s before it:
     3a. unwatched: that companion request sent through the API, no browser connected;
     3b. watched, drawing: the Playground generates that request itself (its page drawing it);
     ratio 3b / 3a (the same batch of two, with and without a page drawing it).
Then the Playground's own decode figure (its "Decode" metric for its 48-token answer, the engine
idle otherwise) is read off the page and compared with the API's decode for the same request,
sent with the page open and idle and again with no browser.
Each way is the median of --repeats requests. Reports TTFT and decode tokens/s (tokens after the
first, from the API's usage, / time from the first to the last streamed chunk), the ratios, the
load average, and the CPU seconds the Streamlit process, the app with its core and Chromium
spent while the page sat idle. --process 1 (the default, as the app): the engine core in its own
process; 0: the in-thread engine. Numbers are of this machine at this
moment: on a shared machine, run both settings back to back and compare ratios, not absolutes.
--chromium-cpus 0 pins the browser to CPU 0 (the front end's): the roof the browser's drawing
sets on a 2-core machine, reported as its own line (the app never pins the browser).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.serve.ports import free_port  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
PG_PROMPT = "Explain in two sentences why a KV cache makes text generation faster."  # pages/playground.py EXAMPLE
PG_TOKENS = 48  # the Playground's default "Max new tokens"
LEAD_S = 0.5  # the companion (or the Playground's request) starts this long before the measured one
START_TIMEOUT_S = 900
REQUEST_TIMEOUT_S = 600
ACTION_TIMEOUT_S = 120  # a click or a wait on the loaded page


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


def stream_request(api: str, tokens: int, prompt: str = PROMPT, ignore_eos: bool = True) -> dict:
    body = {
        "model": model_id(api),
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
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


def with_companion(api: str, tokens: int) -> dict:
    """The measured request while the Playground's kind of request (sent through the API) runs."""
    import threading

    comp: dict = {}
    t = threading.Thread(target=lambda: comp.update(stream_request(api, PG_TOKENS, PG_PROMPT, ignore_eos=False)))
    t.start()
    time.sleep(LEAD_S)
    r = stream_request(api, tokens)
    t.join(REQUEST_TIMEOUT_S)
    return {**r, "companion": comp}


def page_decode_tok_s(page) -> float | None:
    """The Playground's own "Decode" metric (tok/s) as drawn."""
    import re

    for _ in range(20):  # a rerun can replace the metrics while they are read: read again
        try:
            for el in page.locator('[data-testid="stMetric"]').all():
                txt = el.inner_text(timeout=2000)
                if txt.strip().startswith("Decode"):
                    m = re.search(r"([0-9.]+)\s*tok/s", txt)
                    return float(m.group(1)) if m else None
        except Exception:  # noqa: BLE001 - playwright's TimeoutError: the element went away
            pass
        time.sleep(0.5)
    return None


def generate(page, url: str, result: dict) -> None:
    """Click the Playground's Generate (see visible_or_reload)."""
    visible_or_reload(page, url, result)
    page.get_by_role("button", name="Generate").click()


def visible_or_reload(page, url: str, result: dict) -> None:
    """Streamlit's front end sometimes drops the whole page ("Bad delta path index" in the
    console, a blank page) after a few answers while API requests run; then the page is loaded
    again (counted in page_blank_reloads) so the measurement goes on."""
    button = page.get_by_role("button", name="Generate")
    try:
        button.wait_for(state="visible", timeout=10_000)
    except Exception:  # noqa: BLE001 - playwright's TimeoutError: the page went blank
        result["page_blank_reloads"] = result.get("page_blank_reloads", 0) + 1
        page.goto(f"{url}/playground")
        button.wait_for(state="visible", timeout=ACTION_TIMEOUT_S * 1000)
        time.sleep(3)


def taskset_wrapper(exe: str, cpus: str) -> str:
    """A script that runs `exe` pinned to `cpus` (Playwright launches an executable path)."""
    f = tempfile.NamedTemporaryFile("w", prefix="kvscope-chromium-", suffix=".sh", delete=False)
    f.write(f'#!/bin/sh\nexec taskset -c {cpus} {exe} "$@"\n')
    f.close()
    os.chmod(f.name, 0o755)
    return f.name


def median_of(runs: list[dict]) -> dict:
    out = {"runs": runs}
    for k in ("ttft_s", "decode_tok_s"):
        vals = [r[k] for r in runs if r[k] is not None]
        out[k] = statistics.median(vals) if vals else None
    return out


def start_app(extra_env: dict, log) -> tuple[subprocess.Popen, str, str]:
    """The app as scripts/run.sh starts it (`streamlit run app_api.py`, live mode, the API on a
    free localhost port), its output to `log`: (the process, the app's URL, the API's URL)."""
    port, api_port = free_port(), free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.update(extra_env, KVSCOPE_API_PORT=str(api_port))
    env.pop("KVSCOPE_TEST_MODE", None)
    cmd = [sys.executable, "-m", "streamlit", "run", "app_api.py", "--server.headless", "true"]
    cmd += ["--server.port", str(port), "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false"]
    cmd += ["--server.fileWatcherType", "none", "--client.toolbarMode", "minimal", "--runner.postScriptGC", "false"]
    cmd += ["--global.minCachedMessageSize", "1e18"]  # .streamlit/config.toml says why
    app = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return app, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{api_port}"


def stop_app(app: subprocess.Popen) -> None:
    """Stop start_app's process group (SIGKILL after 30 s)."""
    os.killpg(app.pid, signal.SIGTERM)
    try:
        app.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(app.pid, signal.SIGKILL)


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
    ap.add_argument("--process", choices=("0", "1"), default=os.environ.get("KVSCOPE_ENGINE_PROCESS", "1"))
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model", default="default")
    ap.add_argument("--idle-s", type=float, default=20.0, help="how long the idle page is watched for CPU time")
    ap.add_argument("--out", help="write the result JSON here")
    ap.add_argument(
        "--chromium-cpus",
        default="",
        help="run Chromium under `taskset -c CPUS` (a measurement of the roof Chromium sets on few cores; "
        "the app does not need it)",
    )
    a = ap.parse_args()

    log = tempfile.NamedTemporaryFile("w+", prefix="kvscope-watched-", suffix=".log", delete=False)
    app, url, api = start_app({"KVSCOPE_MODEL": a.model, "KVSCOPE_ENGINE_PROCESS": a.process}, log)
    result: dict = {"engine_process": a.process == "1", "model": a.model, "tokens": a.tokens, "cpus": os.cpu_count()}
    result["loadavg_start"] = os.getloadavg()
    try:
        wait_http(f"{api}/v1/models", START_TIMEOUT_S)
        stream_request(api, 8)  # warm-up
        result["alone"] = median_of([stream_request(api, a.tokens) for _ in range(a.repeats)])
        result["load_unwatched"] = median_of([with_companion(api, a.tokens) for _ in range(a.repeats)])

        from playwright.sync_api import sync_playwright

        with sync_playwright() as pw:
            exe = os.environ.get("KVSCOPE_CHROMIUM", "/usr/bin/chromium")
            if a.chromium_cpus:
                exe = taskset_wrapper(exe, a.chromium_cpus)
                result["chromium_cpus"] = a.chromium_cpus
            browser = pw.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(START_TIMEOUT_S * 1000)
            try:
                page.goto(f"{url}/playground")
                page.get_by_role("button", name="Generate").wait_for()
                page.set_default_timeout(ACTION_TIMEOUT_S * 1000)  # loaded: a stuck click fails, not hangs
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
                    generate(page, url, result)
                    time.sleep(LEAD_S)  # the page's own request is under way and drawing
                    runs.append(stream_request(api, a.tokens))
                    visible_or_reload(page, url, result)
                    time.sleep(8)  # let the page's answer finish before the next repeat
                result["load_watched_drawing"] = median_of(runs)
                # the Playground's own decode figure vs the API's, same request, engine otherwise idle
                pg = []
                for _ in range(a.repeats):
                    generate(page, url, result)
                    time.sleep(2)
                    visible_or_reload(page, url, result)
                    time.sleep(6)  # the answer done and its views drawn
                    pg.append(page_decode_tok_s(page))
                result["playground_decode_tok_s"] = statistics.median([x for x in pg if x] or [0]) or None
                result["playground_decode_runs"] = pg
                # the same request through the API with the page open (idle), then with no browser
                same = [stream_request(api, PG_TOKENS, PG_PROMPT, ignore_eos=False) for _ in range(a.repeats)]
                result["api_same_request_page_open"] = median_of(same)
            except Exception:  # a stuck page: keep what it showed, for the report
                stem = Path(a.out).with_suffix("") if a.out else Path(tempfile.gettempdir()) / "kvscope-watched"
                page.screenshot(path=f"{stem}.fail.png", full_page=True)
                Path(f"{stem}.fail.txt").write_text(page.inner_text("body"))
                print(f"the page at the failure: {stem}.fail.png / .fail.txt", file=sys.stderr)
                raise
            browser.close()
        same = median_of([stream_request(api, PG_TOKENS, PG_PROMPT, ignore_eos=False) for _ in range(a.repeats)])
        result["api_same_request"] = same
        p = result["playground_decode_tok_s"]
        for key, q in (("", same), ("_page_open", result["api_same_request_page_open"])):
            q = q["decode_tok_s"]
            result[f"playground_vs_api{key}"] = p / q if p and q else None
        alone = result["alone"]["decode_tok_s"]
        d = result["watched_idle"]["decode_tok_s"]
        result["watched_idle_ratio"] = d / alone if d and alone else None
        d, u = result["load_watched_drawing"]["decode_tok_s"], result["load_unwatched"]["decode_tok_s"]
        result["watched_drawing_ratio"] = d / u if d and u else None
        result["loadavg_end"] = os.getloadavg()
    finally:
        stop_app(app)
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
