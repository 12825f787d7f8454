"""The packet-size lab's network: a self-signed certificate made at run time (the `openssl` command),
the server-side TLS context, and an on-path observer.

`TlsRelay` is a TCP relay on 127.0.0.1 between a client and a TLS server. It forwards bytes both
ways unchanged and keeps, per connection, what a network observer of an encrypted stream sees:
each TLS record's direction, content type, length and arrival time, read from the 5-byte record
headers (type, version, length). It never holds a key and decrypts nothing; `keep_bytes=True`
also keeps the raw bytes it forwarded, so a test can check that no plaintext went past it.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HEADER = 5  # TLS record header: content type (1), legacy version (2), length (2)
APPLICATION_DATA = 23
HANDSHAKE = 22
MAX_RECORD = 2**14 + 256  # TLSCiphertext.length limit (RFC 8446 5.2)
MAX_CONNECTIONS = 4096  # kept per relay; older ones are dropped


def make_certificate(folder: str | Path, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """A self-signed certificate for `host` (an IP address in subjectAltName), made now with the
    `openssl` command: (cert.pem, key.pem) in `folder`. RuntimeError when openssl is missing."""
    exe = shutil.which("openssl")
    if exe is None:
        raise RuntimeError("the packet-size lab needs the `openssl` command to make its certificate; none on PATH")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [exe, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        + ["-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={host}"]
        + ["-addext", f"subjectAltName=IP:{host}"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


def server_context(cert: str | Path, key: str | Path) -> ssl.SSLContext:
    """The lab server's TLS: 1.3 only, no session tickets (so every record after the handshake
    is the HTTP exchange; an observer of a server that sends tickets drops them by position)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(str(cert), str(key))
    ctx.num_tickets = 0
    return ctx


@dataclass(frozen=True, slots=True)
class Record:
    """One TLS record as the observer sees it: `seq` orders records of both directions."""

    seq: int
    direction: str  # "c2s" (client to server) or "s2c"
    content_type: int
    length: int  # the ciphertext length in the header (the 5 header bytes not counted)
    t: float  # perf_counter when its last byte arrived


class RecordParser:
    """Splits one direction's byte stream into TLS records by their headers (incremental)."""

    def __init__(self):
        self.buf = bytearray()
        self.bad = False  # set when the stream is not TLS records (a header out of range)

    def feed(self, data: bytes) -> list[tuple[int, int]]:
        """(content type, length) of every record completed by `data`."""
        self.buf += data
        out = []
        while not self.bad and len(self.buf) >= HEADER:
            ctype, length = self.buf[0], int.from_bytes(self.buf[3:5], "big")
            if not 20 <= ctype <= 24 or self.buf[1] != 3 or length > MAX_RECORD:
                self.bad = True
                break
            if len(self.buf) < HEADER + length:
                break
            del self.buf[: HEADER + length]
            out.append((ctype, length))
        return out


@dataclass
class Connection:
    """What the relay saw on one client connection."""

    index: int
    records: list[Record] = field(default_factory=list)
    raw: dict = field(default_factory=lambda: {"c2s": bytearray(), "s2c": bytearray()})
    not_tls: bool = False
    closed: threading.Event = field(default_factory=threading.Event)


class TlsRelay:
    """A TCP relay 127.0.0.1:<port> -> upstream (host, port) that records TLS record headers.
    Use as a context manager; `port` is where clients connect."""

    def __init__(self, upstream: tuple[str, int], keep_bytes: bool = False, host: str = "127.0.0.1"):
        self.upstream, self.keep_bytes = upstream, keep_bytes
        self.connections: list[Connection] = []
        self._lock = threading.Lock()
        self._seq = 0
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(16)
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._accept_loop, name=f"tls-relay-{self.port}", daemon=True)

    def __enter__(self) -> TlsRelay:
        self._accept.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._accept.is_alive():
            self._accept.join(5)
        self._sock.close()
        for t in list(self._threads):
            t.join(5)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.settimeout(0.2)
            with self._lock:
                conn = Connection(len(self.connections))
                self.connections.append(conn)
                del self.connections[:-MAX_CONNECTIONS]
            done = threading.Event()
            for src, dst, direction in ((client, server, "c2s"), (server, client, "s2c")):
                t = threading.Thread(target=self._pump, args=(conn, src, dst, direction, done), daemon=True)
                t.start()
                self._threads.append(t)
            self._threads = [t for t in self._threads if t.is_alive()]

    def _pump(self, conn: Connection, src, dst, direction: str, done: threading.Event) -> None:
        parser = RecordParser()
        try:
            while not self._stop.is_set() and not done.is_set():
                try:
                    data = src.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    break
                if not data:
                    break
                t = time.perf_counter()
                with self._lock:
                    for ctype, length in parser.feed(data):
                        conn.records.append(Record(self._seq, direction, ctype, length, t))
                        self._seq += 1
                    conn.not_tls = conn.not_tls or parser.bad
                    if self.keep_bytes:
                        conn.raw[direction] += data
                try:
                    dst.sendall(data)
                except OSError:
                    break
        finally:
            done.set()
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            if direction == "s2c":
                for s in (src, dst):
                    s.close()
                conn.closed.set()

    def wait_closed(self, conn: Connection, timeout_s: float = 10.0) -> bool:
        return conn.closed.wait(timeout_s)
