"""One engine, two doors: the API door (ui/servers/api_door.py, what app_api.py's lifespan opens for
scripts/run.sh) serves the app's shared engine; a request sent over HTTP shows on the Playground
and Load pages tagged as coming from the HTTP API, and its blocks are the engine's own."""

from __future__ import annotations

import os
import socket

import httpx
import pytest

from tests.conftest import REPO_ROOT

APP = str(REPO_ROOT / "app.py")
TIMEOUT = 600  # a hang guard on 2 busy cores, not a speed assertion


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def door():
    keys = ("KVSCOPE_TEST_MODE", "KVSCOPE_MODEL", "KVSCOPE_API_PORT")
    old = {k: os.environ.get(k) for k in keys}
    port = _free_port()
    os.environ.update({"KVSCOPE_TEST_MODE": "1", "KVSCOPE_MODEL": "tiny", "KVSCOPE_API_PORT": str(port)})
    from ui.servers.api_door import ApiDoor
    from ui.widgets import engine_access as ea

    ea.shared_engine.clear()
    d = ApiDoor().start(ea.shared_engine())
    assert d.error is None, d.error
    yield d, port
    d.stop()
    holder = ea.shared_engine()
    if holder.thread is not None:
        holder.thread.shutdown()
    ea.shared_engine.clear()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_api_port_settings(monkeypatch):
    from ui.servers.api_door import api_settings

    monkeypatch.setenv("KVSCOPE_API_PORT", "off")
    assert api_settings()[1] is None
    monkeypatch.setenv("KVSCOPE_API_PORT", "70000")
    with pytest.raises(ValueError, match="KVSCOPE_API_PORT"):
        api_settings()
    monkeypatch.delenv("KVSCOPE_API_PORT")
    monkeypatch.delenv("KVSCOPE_API_HOST", raising=False)
    assert api_settings() == ("127.0.0.1", 8000)


def test_http_requests_show_on_the_pages_of_the_same_engine(door):
    d, port = door
    from streamlit.testing.v1 import AppTest

    from ui.widgets import engine_access as ea

    th = ea.shared_engine().get()
    assert d.server.config.app.state.kvscope.thread is th  # the API serves the app's engine
    r = httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        timeout=300,
        json={"prompt": "one engine, two doors", "max_tokens": 5, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    snap = th.snapshot_now()
    http = [q for q in snap.requests if q.origin == "http"]
    assert len(http) == 1 and http[0].state == "finished" and http[0].output_len == 5
    for page in ("pages/playground.py", "pages/load.py"):
        at = AppTest.from_file(APP, default_timeout=TIMEOUT)
        at.switch_page(page)
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        html = " ".join(h.proto.body for h in at.get("html"))
        assert "From the HTTP API (http)" in html and http[0].request_id in html, page
