"""engine/serve/ports.free_port: a port nothing listens on, never the same one twice in a process
(callers pick several before their servers bind them)."""

from __future__ import annotations

import socket

from engine.serve.ports import free_port


def test_ports_are_free_and_never_handed_out_twice():
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == 200
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports[-1]))  # free: binding it succeeds
