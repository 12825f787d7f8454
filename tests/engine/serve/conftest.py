"""One kvscope server for the serve tests: the tiny model on an EngineThread, served by uvicorn
from a background thread on 127.0.0.1 and a free port, with an API key. Session-scoped: every
test leaves the engine idle (no request running or waiting) and checks that it did."""

import socket

import pytest

API_KEY = "sk-kvscope-test"
TINY_SERVE = {
    "model": "tiny",
    "device": "cpu",
    "num_kv_blocks": 160,
    "block_size": 8,
    "max_model_len": 256,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 512,
    "num_threads": 1,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, thread, app, server, port):
        self.thread, self.app, self.server, self.port = thread, app, server, port
        self.base = f"http://127.0.0.1:{port}"
        self.headers = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="session")
def server():
    from engine.config import EngineConfig
    from engine.serve import create_app, run_in_background
    from engine.thread import EngineThread

    th = EngineThread(config=EngineConfig(**TINY_SERVE))
    app = create_app(th, model_name="kvscope-tiny", api_key=API_KEY, max_body_bytes=64 * 1024, max_waiting=512)
    port = free_port()
    srv = run_in_background(app, "127.0.0.1", port)
    assert srv.started
    yield Server(th, app, srv, port)
    srv.should_exit = True
    srv.thread.join(10)
    th.shutdown()


@pytest.fixture(scope="session")
def llm():
    """In-process reference on the same config (same seeded tiny weights)."""
    from engine import LLM

    return LLM(**TINY_SERVE)
