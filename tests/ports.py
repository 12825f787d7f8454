"""free_port(): a TCP port on 127.0.0.1 that nothing listens on now, for a test server (the
serve tests, the API door, the browser tests' Streamlit servers, the vLLM peer)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
