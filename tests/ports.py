"""free_port(): a TCP port on 127.0.0.1 that nothing listens on now, for a test server (the
serve tests, the API door, the browser tests' Streamlit servers, the vLLM peer).

A port is handed out once per test process: the kernel may give a just-released ephemeral port to
the next bind(0), so a test that picks several ports before its servers bind them (two kvscope
servers, each with an HTTP port and two ZMQ endpoints) could otherwise get one port twice and see
"Address already in use" from the server that binds second (a fresh-clone run, 2026-12-06)."""

from __future__ import annotations

import socket

_handed_out: set[int] = set()


def free_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
