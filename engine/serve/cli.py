"""python -m engine serve [--model M] [--host 127.0.0.1] [--port 8000] [--api-key K] [--FIELD V ...]
[--set FIELD=VALUE ...] [--kv-events-endpoint tcp://...] [--save-tokenizer DIR]

Every EngineConfig field is an option (--block-size 8, --enable-prefix-caching false, ...) or a
--set FIELD=VALUE (values parsed as JSON when they parse: numbers, true/false, null, objects).
The engine core runs in a process of its own (KVSCOPE_ENGINE_PROCESS=0: in a thread of this one)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from engine.config import EngineConfig

SKIP_FIELDS = ("model", "tiers", "speculative")  # model has its own option; the others via --set / JSON


def _value(text: str):
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m engine serve",
        description=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--model",
        default=os.environ.get("KVSCOPE_MODEL", "default"),
        help="as LLM(model=...): 'default' (embedded SmolLM2-135M), 'tiny', a local folder",
    )
    ap.add_argument("--served-model-name", default=None, help="the id /v1/models reports (default: --model)")
    ap.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument(
        "--api-key",
        default=os.environ.get("KVSCOPE_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' on every route but /health (or KVSCOPE_API_KEY)",
    )
    ap.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="413 above this (default 4 MiB)")
    ap.add_argument("--max-waiting", type=int, default=1024, help="429 when this many requests are queued")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="any EngineConfig field")
    ap.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="publish KV cache events in vLLM's ZMQ wire format (e.g. tcp://127.0.0.1:5557)",
    )
    ap.add_argument("--kv-events-replay-endpoint", default=None, help="the replay (ROUTER) socket's endpoint")
    ap.add_argument(
        "--kv-events-format",
        choices=("current", "legacy"),
        default="current",
        help="event encoding: vLLM's current tagged maps or the older positional arrays",
    )
    ap.add_argument(
        "--save-tokenizer",
        metavar="DIR",
        default=None,
        help="write the model's tokenizer to DIR (for guidellm / vllm bench serve) and keep serving",
    )
    ap.add_argument(
        "--instance-id",
        default=None,
        help="name sent in the x-kvscope-instance response header (a fleet's engine id; default HOST:PORT)",
    )
    ap.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    for f in dataclasses.fields(EngineConfig):
        if f.name in SKIP_FIELDS:
            continue
        ap.add_argument(
            "--" + f.name.replace("_", "-"),
            dest="cfg_" + f.name,
            type=_value,
            default=None,
            metavar="V",
            help=argparse.SUPPRESS if f.name == "speculative_config" else None,
        )
    return ap


def build_config(a) -> EngineConfig:
    """argparse namespace -> EngineConfig; ValueError names the field."""
    kw: dict = {}
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    for f in dataclasses.fields(EngineConfig):
        v = getattr(a, "cfg_" + f.name, None)
        if v is not None:
            kw[f.name] = v
    for item in a.set:
        if "=" not in item:
            raise ValueError(f"--set needs FIELD=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        k = k.strip().replace("-", "_")
        if k not in names or k in ("tiers",):
            raise ValueError(
                f"--set: {k!r} is not an EngineConfig field one can set here (known: {sorted(names - {'tiers'})})"
            )
        kw[k] = _value(v)
    if isinstance(kw.get("speculative"), dict):
        kw["speculative_config"] = kw.pop("speculative")
    return EngineConfig(model=a.model, **kw)


def attach_kv_events(thread, endpoint: str, replay_endpoint: str | None, wire: str):
    """engine.observe.kv_events (the events helper's module) publishes the engine's prefix-cache
    events (an in-process EngineThread's; a core process opens its own: kv_events_options)."""
    try:
        from engine.observe import kv_events
    except ImportError as e:
        raise ValueError(f"--kv-events-endpoint: this build has no engine.kv_events module ({e})") from None
    pub = kv_events.open_publisher(endpoint, replay_endpoint, wire)
    try:
        pub.attach(thread)
    except BaseException:
        pub.close()
        raise
    return pub


def start_engine(cfg: EngineConfig, a):
    """(engine, KV events publisher or None). By default the engine core runs in a process of
    its own (engine/core/client.py's EngineClient, EngineThread's API), so HTTP work (uvicorn,
    JSON, SSE) never holds the step loop's interpreter lock; the core then owns the KV events
    publisher (it is attached to the core's engine; the server keeps its PublisherInfo).
    KVSCOPE_ENGINE_PROCESS=0: the in-thread EngineThread, its publisher attached by main().
    The core is pinned only where KVSCOPE_CORE_CPUS names CPUs (several servers share a machine
    in a fleet). ValueError: a bad config, or a KV events endpoint the core could not open."""
    from engine.core.client import EngineClient, process_enabled

    if not process_enabled():
        from engine.core.thread import EngineThread

        return EngineThread(config=cfg), None
    from engine.core.placement import cpus_from_env

    kv = None
    if a.kv_events_endpoint:
        kv = {"endpoint": a.kv_events_endpoint, "replay_endpoint": a.kv_events_replay_endpoint}
        kv["wire"] = a.kv_events_format
    th = EngineClient(config=cfg, cpus=cpus_from_env("KVSCOPE_CORE_CPUS"), kv_events=kv)
    try:
        # the client loads its own tokenizer on first use: before serving, so the first request
        # (a router's render, with its short deadline) does not wait seconds for it
        th.tokenizer  # noqa: B018
        return th, th.kv_events_info()
    except BaseException:
        th.shutdown()
        raise


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        cfg = build_config(a)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not 1 <= a.port <= 65535:
        print(f"error: --port must be in [1, 65535], got {a.port}", file=sys.stderr)
        return 2
    import uvicorn

    from engine.serve.app import create_app

    try:
        th, pub = start_engine(cfg, a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.save_tokenizer:
        th.tokenizer.save_pretrained(a.save_tokenizer)
        print(f"kvscope serve: tokenizer written to {a.save_tokenizer}", file=sys.stderr)
    try:
        app = create_app(
            th,
            a.served_model_name,
            a.api_key,
            a.max_body_bytes,
            a.max_waiting,
            instance_id=a.instance_id or f"{a.host}:{a.port}",
        )
        if a.kv_events_endpoint and pub is None:  # the in-thread engine: the publisher lives here
            pub = attach_kv_events(th, a.kv_events_endpoint, a.kv_events_replay_endpoint, a.kv_events_format)
        app.state.kvscope.kv_events = pub
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        if pub is not None:
            pub.close()
        th.shutdown()
        return 2
    name = app.state.kvscope.model_name
    unset = "" if cfg.max_model_len is not None else " (unset: the model's own limit, memory permitting)"
    print(
        f"kvscope serve: {name} on {th.engine.device}, {th.engine.num_blocks} KV blocks of "
        f"{cfg.block_size} tokens, max_model_len {th.config.max_model_len}{unset}"
        f"; OpenAI API at http://{a.host}:{a.port}/v1 "
        f"(metrics: /metrics{', API key required' if a.api_key else ''})",
        file=sys.stderr,
        flush=True,
    )
    try:
        uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level, timeout_graceful_shutdown=3)
    finally:
        pub = app.state.kvscope.kv_events
        if pub is not None and hasattr(pub, "close"):
            pub.close()
        th.shutdown()
    return 0
