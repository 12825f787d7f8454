"""One engine, two doors: the API door (ui/servers/api_door.py, what app_api.py's lifespan opens for
scripts/run.sh) serves the app's shared engine; a request sent over HTTP shows on the Playground
and Load pages tagged as coming from the HTTP API, and its blocks are the engine's own."""

from __future__ import annotations

import httpx
import pytest

from engine.serve.ports import free_port
from tests.app import helpers as H


@pytest.fixture(scope="module")
def door(tiny_test_mode):
    """The API door on a free port, opened on the module's shared engine (tiny_test_mode shuts
    the engine down after the door)."""
    from ui.servers.api_door import ApiDoor
    from ui.widgets import engine_access as ea

    port = free_port()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSCOPE_API_PORT", str(port))
        d = ApiDoor().start(ea.shared_engine())
        assert d.error is None, d.error
        yield d, port
        d.stop()


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


def test_http_requests_show_on_the_pages_of_the_same_engine(door, app_test):
    d, port = door
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
        at = H.run_ok(app_test(page=page))
        html = H.html(at)
        assert "From the HTTP API (http)" in html and http[0].request_id in html, page
