"""free_port(): a TCP port that nothing listens on now, for a server this process is about to start
(the bench's kvscope and vLLM servers and their ZMQ endpoints, the packet lab's TLS relay, the
tests' servers).

A port is handed out once per process: the kernel may give a just-released ephemeral port to the
next bind(0), so a caller that picks several ports before its servers bind them (a vLLM peer's API
port and two ZMQ endpoints; two kvscope servers with theirs) could otherwise get one port twice and
see "Address already in use" from the server that binds second (a fresh-clone test run,
2026-12-06)."""

from __future__ import annotations

import socket

_handed_out: set[tuple[str, int]] = set()


def free_port(host: str = "127.0.0.1") -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if (host, port) not in _handed_out:
            _handed_out.add((host, port))
            return port
