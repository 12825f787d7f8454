"""Reproduces a blank Playground: Streamlit's front end drops the whole page with
"Bad delta path index N (should be between [0, M])" after a few answers while API requests run.

  .venv/bin/python scripts/playground_blank_repro.py [ROUNDS=10] [PAUSE_S=2]

Starts the app as scripts/run.sh does (live mode, default model, the API on a free port), opens the
Playground in headless Chromium and, ROUNDS times, clicks Generate and streams a 96-token API
request on the same engine 0.5 s later. Prints "ok N" per round or "STUCK at N" (the Generate
button gone: the page is blank), and the browser's page errors. Seen on 2026-12-04 (Streamlit
1.67.0): stuck at round 3 to 11 in 4 of 4 runs; with the Playground's redraws during streaming
removed, or with a fixed fragment refresh instead of the busy/idle switch, it still got stuck.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import watched_bench as W  # noqa: E402 - the same app start and API client


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    pause = float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
    app, url, api = W.start_app({"KVSCOPE_MODEL": "default"}, subprocess.DEVNULL)
    errors: list[str] = []
    stuck = None
    try:
        W.wait_http(f"{api}/v1/models", W.START_TIMEOUT_S)
        from playwright.sync_api import sync_playwright

        with sync_playwright() as pw:
            exe = os.environ.get("KVSCOPE_CHROMIUM", "/usr/bin/chromium")
            browser = pw.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{url}/playground")
            button = page.get_by_role("button", name="Generate")
            button.wait_for(timeout=W.START_TIMEOUT_S * 1000)
            for i in range(rounds):
                button.click(timeout=60_000)
                time.sleep(W.LEAD_S)
                W.stream_request(api, 96)
                try:
                    button.wait_for(state="visible", timeout=30_000)
                except Exception:  # noqa: BLE001 - playwright's TimeoutError
                    stuck = i
                    print(f"STUCK at {i}", flush=True)
                    break
                time.sleep(pause)
                print(f"ok {i}", flush=True)
            browser.close()
    finally:
        W.stop_app(app)
    for e in errors[:5]:
        print("page error:", e[:300])
    return 1 if stuck is not None else 0


if __name__ == "__main__":
    raise SystemExit(main())
