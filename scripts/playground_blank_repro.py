"""Reproduces the blank Playground of issue 32 (fixed): Streamlit's front end dropped the whole page
with "Bad delta path index N (should be between [0, M])" after a few answers while API requests ran.

  .venv/bin/python scripts/playground_blank_repro.py [ROUNDS=10] [PAUSE_S=2]

Starts the app as scripts/run.sh does (live mode, default model, the API on a free port), opens the
Playground in headless Chromium and, ROUNDS times, clicks Generate and streams a 96-token API
request on the same engine 0.5 s later. Prints "ok N" per round or "STUCK at N" (the Generate
button gone: the page is blank), and the browser's page errors.

The cause, read from the websocket's decoded frames: a fragment run of the live views, cut short by
the next timer rerun of the same fragment, had its queued elements 10-12 cleared, but element 13,
sent as a reference to a cached message ("ref_hash", which carries no fragment id), stayed in the
queue; the browser got index 13 of a block holding 10. Seen on 2026-12-04 (Streamlit 1.67.0):
stuck at round 3 to 11 in 5 of 5 runs. With cached references off (--global.minCachedMessageSize
1e18, .streamlit/config.toml): 16 of 16 rounds, with 33 cut fragment runs and no page error.
tests/app/test_streamlit_settings.py pins the mechanism on Streamlit's own queue.
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
