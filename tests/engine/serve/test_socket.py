"""The server's TCP connections send each write at once (Nagle's algorithm off): a streamed
response's chunks are small writes, and with Nagle on, a write after the HTTP head waits for the
client's ACK, which Linux delays up to 40 ms."""

from __future__ import annotations

import socket


def test_server_connections_have_nagle_off(server):
    with socket.create_connection(("127.0.0.1", server.port)) as c:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert c.recv(4096).startswith(b"HTTP/1.1 200")  # the connection is up on the server side
        conns = list(server.server.server_state.connections)
        socks = [p.transport.get_extra_info("socket") for p in conns if p.transport is not None]
        ours = [s for s in socks if s.getpeername() == c.getsockname()]
        assert len(ours) == 1
        assert ours[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
