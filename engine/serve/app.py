"""create_app(thread, ...): the FastAPI app over one shared EngineThread; run_in_background()
serves it from a daemon thread (how the Streamlit app opens its second door on the same engine)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from fastapi import FastAPI

from engine.serve import errors
from engine.serve.metrics import MetricsExporter

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_WAITING = 1024


@dataclass
class ServerState:
    thread: object  # engine.thread.EngineThread
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_waiting: int = DEFAULT_MAX_WAITING  # queued requests (engine waiting + being submitted) before 429
    stream_interval_s: float = 0.25  # /v1/kvscope/stream rate
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: MetricsExporter | None = None
    kv_events: object | None = None  # engine.kv_events publisher, when --kv-events-endpoint is given
    in_flight: int = 0  # HTTP requests being served (not yet finished)
    bridge: tuple | None = None  # (Waker, Submitter) of the serving loop (engine/serve/bridge.py)

    @property
    def aliases(self) -> set[str]:
        return {self.model_name, self.thread.config.model}


def create_app(
    thread,
    model_name: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_waiting: int = DEFAULT_MAX_WAITING,
    stream_interval_s: float = 0.25,
    instance_id: str | None = None,
) -> FastAPI:
    from engine.serve import fleet_routes, routes, vllm_routes

    if max_body_bytes < 1024:
        raise ValueError(f"max_body_bytes must be >= 1024, got {max_body_bytes}")
    if max_waiting < 1:
        raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
    if not 0.02 <= stream_interval_s <= 10:
        raise ValueError(f"stream_interval_s must be in [0.02, 10], got {stream_interval_s}")
    state = ServerState(
        thread, model_name or thread.config.model, api_key or None, max_body_bytes, max_waiting, stream_interval_s
    )
    state.metrics = MetricsExporter(thread, state.model_name)
    app = FastAPI(title="kvscope OpenAI-compatible server", version="1", docs_url=None, redoc_url=None)
    app.state.kvscope = state
    errors.install(app)
    app.include_router(routes.router)
    app.include_router(vllm_routes.router)  # render, get_server_info, kv_event_sources
    app.include_router(fleet_routes.router)  # cached_blocks, reset_prefix_cache (engine/fleet/ uses them)
    app.add_middleware(errors.GuardMiddleware, api_key=state.api_key, max_body_bytes=max_body_bytes)
    if instance_id:  # which fleet member answered, through a gateway; also /get_server_info's id
        app.state.kvscope_instance_id = instance_id
        app.add_middleware(fleet_routes.InstanceHeaderMiddleware, instance_id=instance_id)
    return app


def run_in_background(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning", ssl_context=None):
    """Serves `app` with uvicorn from a daemon thread; returns the uvicorn.Server (stop it with
    server.should_exit = True). Raises OSError when the port cannot be bound. `ssl_context` (an
    ssl.SSLContext for the server side): HTTPS (the packet-size lab, engine/lab/tls_relay.py)."""
    import socket

    import uvicorn

    # IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on connections whose
    # socket says TCP, and accepted sockets inherit the listener's. With proto 0 each response's
    # first SSE chunk waited behind its HTTP head for the client's delayed ACK: 40 ms more TTFT
    # (a 3-token prompt over a kept-alive connection: 44 ms, 7 ms of it the engine's step)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))  # bind here so a busy port fails loudly in the caller
    tls = {} if ssl_context is None else {"ssl_context_factory": lambda _cfg, _default: ssl_context}
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=3, lifespan="off", **tls)
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # not the main thread
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"kvscope-api-{port}", daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    server.thread = t
    return server
