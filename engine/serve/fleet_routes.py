"""Routes a fleet of servers needs from each member (engine/fleet/): which instance answered,
what it caches, and a way to empty its prefix cache between measured runs.

* every response carries `x-kvscope-instance: ID` (the server's --instance-id) so a client
  behind a gateway (vllm-router forwards upstream headers) knows which instance served it;
* GET /v1/kvscope/cached_blocks: the block hashes in the prefix cache now, in the form the KV
  events publish them (read-only; a fleet collector checks the set it rebuilt from events);
* POST /reset_prefix_cache: vLLM's route: drops the hash of every cached block no request is
  using (each drop is published as a BlockRemoved event); blocks in use keep theirs.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from engine.observe.kv_event_wire import published_hash

router = APIRouter()
INSTANCE_HEADER = "x-kvscope-instance"


def cached_block_hashes(engine) -> list[str]:
    """The engine's cached block hashes as the KV events publish them, 16 hex digits each, sorted."""
    return sorted(f"{published_hash(h):016x}" for h in engine.bm.cached_hashes())


def reset_prefix_cache(engine) -> tuple[int, int]:
    """Uncache every cached block whose ref count is 0; returns (dropped, kept in use)."""
    return engine.bm.reset_prefix_cache()


@router.get("/v1/kvscope/cached_blocks")
async def cached_blocks(request: Request):
    th = request.app.state.kvscope.thread

    def read():
        with th.lock:
            return th.engine.bm.block_size, th.engine.num_blocks, cached_block_hashes(th.engine)

    block_size, num_blocks, hashes = await asyncio.to_thread(read)
    return {"block_size": block_size, "num_blocks": num_blocks, "count": len(hashes), "hashes": hashes}


@router.post("/reset_prefix_cache")
async def reset(request: Request):
    th = request.app.state.kvscope.thread

    def run():
        with th.lock:
            return reset_prefix_cache(th.engine)

    dropped, kept = await asyncio.to_thread(run)
    return {"reset": True, "dropped_blocks": dropped, "kept_in_use": kept}


class InstanceHeaderMiddleware:
    """Pure ASGI: adds `x-kvscope-instance: ID` to every HTTP response (streams included)."""

    def __init__(self, app, instance_id: str):
        self.app = app
        self.value = instance_id.encode("latin-1", "replace")[:200]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [*message.get("headers", []), (INSTANCE_HEADER.encode(), self.value)]
            await send(message)

        return await self.app(scope, receive, send_with_header)
