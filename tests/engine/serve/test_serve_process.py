"""`python -m engine serve` runs its engine core in a child process by default (issue 32): the
server's process has the core as a child, completions work through it, vLLM's KV events come
from the core (the publisher lives there), the fleet routes reach its block pool, a busy KV
events endpoint is still a clear error with exit code 2, and a core that dies makes in-flight
and new requests fail with a clear error instead of hanging."""

import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from engine.observe.kv_events import BlockStored, KVEventSubscriber
from engine.serve.ports import free_port
from tests.waiting import wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the child process")

ENV = dict(
    os.environ,
    HF_HUB_OFFLINE="1",
    TRANSFORMERS_OFFLINE="1",
    TOKENIZERS_PARALLELISM="false",
    KVSCOPE_API_KEY="",
    KVSCOPE_ENGINE_PROCESS="1",
)
TINY = ["--model", "tiny", "--num-kv-blocks", "64", "--block-size", "8", "--max-model-len", "256", "--num-threads", "1"]


def children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def listener_inode(port: int) -> str:
    """The inode of the socket listening on 127.0.0.1:port (/proc/net/tcp)."""
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if cols[1].endswith(f":{port:04X}") and cols[3] == "0A":
                return cols[9]
    raise AssertionError(f"nothing listens on port {port}")


def socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(link[8:-1])
    return out


def start(port: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "engine", "serve", *TINY, "--port", str(port), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=ENV,
    )


def wait_up(p: subprocess.Popen, port: int) -> None:
    def up_or_exited() -> bool:
        if p.poll() is not None:
            return True
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(up_or_exited, "the server to start its core and answer /health", 600, 0.2)
    assert p.poll() is None, p.stdout.read().decode()[-3000:]


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
    p.stdout.close()


def core_child(p: subprocess.Popen) -> int:
    """The engine core process (a multiprocessing spawn child) among the server's children."""
    kids = [c for c in children(p.pid) if "multiprocessing" in cmdline(c) and "resource_tracker" not in cmdline(c)]
    assert len(kids) == 1, [(c, cmdline(c)) for c in children(p.pid)]
    return kids[0]


def complete(port: int, prompt: str, max_tokens: int = 4, timeout: float = 120) -> httpx.Response:
    return httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        timeout=timeout,
        json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    )


def test_core_runs_in_a_child_process_and_publishes_kv_events():
    port, events, replay = free_port(), free_port(), free_port()
    p = start(
        port,
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{events}",
        "--kv-events-replay-endpoint",
        f"tcp://127.0.0.1:{replay}",
    )
    sub = None
    try:
        wait_up(p, port)
        core = core_child(p)
        # the publisher lives in the core: it, not the server's own process, listens on the ports
        for port_ in (events, replay):
            assert listener_inode(port_) in socket_inodes(core)
            assert listener_inode(port_) not in socket_inodes(p.pid)
        sub = KVEventSubscriber(f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}")
        sources = httpx.get(f"http://127.0.0.1:{port}/kv_event_sources").json()
        assert sources["0"]["endpoint"] == f"tcp://127.0.0.1:{events}"
        assert sources["0"]["replay_endpoint"] == f"tcp://127.0.0.1:{replay}"
        info = httpx.get(f"http://127.0.0.1:{port}/get_server_info").json()
        assert info["kv_events"] is True and info["kv_block_size"] == 8 and info["enable_prefix_caching"] is True
        r = complete(port, "the quick brown fox jumps over the lazy dog " * 3, max_tokens=4)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        stored: set[str] = set()

        def got_stored() -> bool:
            for _, batch in sub.poll(timeout_ms=50):
                for ev in batch.events:
                    if isinstance(ev, BlockStored):
                        stored.update(f"{h:016x}" for h in ev.block_hashes)
            return bool(stored)

        wait_until(got_stored, "BlockStored events from the core's publisher", 60)
        cached = httpx.get(f"http://127.0.0.1:{port}/v1/kvscope/cached_blocks").json()
        assert cached["block_size"] == 8 and cached["num_blocks"] == 64
        assert set(cached["hashes"]) <= stored and cached["count"] > 0
        reset = httpx.post(f"http://127.0.0.1:{port}/reset_prefix_cache").json()
        assert reset["dropped_blocks"] == cached["count"] and reset["kept_in_use"] == 0
        assert httpx.get(f"http://127.0.0.1:{port}/v1/kvscope/cached_blocks").json()["count"] == 0
        assert "vllm:request_success_total" in httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert os.path.exists(f"/proc/{core}")
    finally:
        if sub is not None:
            sub.close()
        stop(p)
    # the core went with its server
    wait_until(lambda: not os.path.exists(f"/proc/{core}") or _zombie(core), "the core process to exit", 60)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_a_busy_kv_events_endpoint_is_a_clear_error():
    import zmq

    events = free_port()
    sock = zmq.Context.instance().socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{events}")
    p = start(free_port(), "--kv-events-endpoint", f"tcp://127.0.0.1:{events}")
    try:
        out, _ = p.communicate(timeout=600)
    finally:
        sock.close()
        if p.poll() is None:
            p.kill()
    text = out.decode()
    assert p.returncode == 2, text[-3000:]
    assert f"error: --kv-events-endpoint tcp://127.0.0.1:{events}: ZMQError" in text, text[-3000:]


def test_a_killed_core_fails_requests_clearly_instead_of_hanging():
    port = free_port()
    p = start(port)
    try:
        wait_up(p, port)
        core = core_child(p)
        result: dict = {}

        def in_flight():  # a long completion, streaming, still running when the core dies
            try:
                with httpx.stream(
                    "POST",
                    f"http://127.0.0.1:{port}/v1/completions",
                    timeout=120,
                    json={"model": "tiny", "prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True},
                ) as r:
                    result["status"] = r.status_code
                    result["body"] = "".join(r.iter_text())
            except httpx.HTTPError as e:  # a server that cut the stream is a clear failure too
                result["error"] = repr(e)

        t = threading.Thread(target=in_flight, daemon=True)
        t.start()
        wait_until(lambda: _running(port) > 0, "the streamed request to be running in the core", 120)
        os.kill(core, signal.SIGKILL)
        t.join(60)
        assert not t.is_alive(), "the in-flight request hung after the core died"
        assert "error" in result or "exited unexpectedly" in result.get("body", ""), result
        r = complete(port, "after", timeout=60)
        assert r.status_code == 503, r.text
        assert "engine is down" in r.json()["error"]["message"]
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 503
        assert p.poll() is None  # the server itself keeps answering
    finally:
        stop(p)


def _running(port: int) -> float:
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
