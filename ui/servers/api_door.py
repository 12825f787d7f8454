"""The app's second door: kvscope's OpenAI-compatible API (engine/serve) served from the Streamlit
process on the app's own shared engine, so HTTP clients and the pages drive ONE engine.

Started by app_api.py's st.App lifespan (scripts/run.sh) before any browser connects: it builds
the shared engine (ui.widgets.engine_access.shared_engine) and serves the API with uvicorn from a daemon
thread. Environment: KVSCOPE_API_PORT (default 8000; "off" disables), KVSCOPE_API_HOST (default
127.0.0.1), KVSCOPE_API_KEY (then every API route but /health needs the bearer key)."""

from __future__ import annotations

import os
import sys

DEFAULT_PORT = 8000


def api_settings() -> tuple[str, int | None]:
    host = os.environ.get("KVSCOPE_API_HOST", "127.0.0.1").strip() or "127.0.0.1"
    raw = os.environ.get("KVSCOPE_API_PORT", str(DEFAULT_PORT)).strip().lower()
    if raw in ("", "0", "off", "no", "false"):
        return host, None
    port = int(raw)
    if not 1 <= port <= 65535:
        raise ValueError(f"KVSCOPE_API_PORT must be in [1, 65535] or 'off', got {raw!r}")
    return host, port


class ApiDoor:
    def __init__(self):
        self.server = None
        self.url: str | None = None
        self.error: str | None = None

    def start(self, holder) -> ApiDoor:
        """holder: the app's SharedEngine. Never raises: a failure is kept in .error and printed."""
        try:
            host, port = api_settings()
            if port is None:
                self.error = "disabled (KVSCOPE_API_PORT=off)"
                return self
            th = holder.get()
            if th is None:
                raise RuntimeError(f"the engine could not be built: {holder.build_error}")
            from engine.serve import create_app, run_in_background

            app = create_app(th, api_key=os.environ.get("KVSCOPE_API_KEY") or None)
            self.server = run_in_background(app, host, port)
            self.url = f"http://{host}:{port}/v1"
            print(
                f"kvscope: OpenAI-compatible API on {self.url} (same engine as the app; metrics at "
                f"http://{host}:{port}/metrics)",
                file=sys.stderr,
                flush=True,
            )
        except Exception as e:  # noqa: BLE001 - the app keeps running without its second door
            self.error = f"{type(e).__name__}: {e}"
            print(f"kvscope: the API could not be started: {self.error}", file=sys.stderr, flush=True)
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self.server.thread.join(5)
            self.server = None


DOOR = ApiDoor()
