"""Hand-built engine records for tests that need no engine: EngineInfo (make_engine_info, the one
place tests build one), and Snapshots, requests, token marks and history points for the ui/
figure tests (test data only; the app shows engine data)."""

from __future__ import annotations

from engine.observe.snapshot import (
    BlockInfo,
    EngineInfo,
    EngineMetrics,
    HistoryPoint,
    RequestInfo,
    Snapshot,
    SpecMetrics,
    TokenMark,
)


def make_engine_info(**overrides) -> EngineInfo:
    """An EngineInfo with every field filled; keyword arguments replace fields.

    Defaults describe a 2-layer model with 3 KV heads of 64 dims in bf16, so bytes_per_token =
    2 (K and V) x 2 layers x 3 heads x 64 x 2 B = 1536, with 64 blocks of 16 tokens. Unless given,
    bytes_per_block is bytes_per_token x block_size and kv_cache_bytes is num_blocks x
    bytes_per_block, as the engine reports them.
    """
    d = dict(
        model="test-model",
        device="cpu",
        dtype="bfloat16",
        num_layers=2,
        num_kv_heads=3,
        head_dim=64,
        block_size=16,
        num_blocks=64,
        bytes_per_token=1536,
        max_model_len=2048,
        max_num_seqs=32,
        max_num_batched_tokens=512,
        allocator="paged",
        kv_cache=True,
        enable_prefix_caching=True,
        preemption_mode="recompute",
        victim_policy="lru",
        speculative=None,
    )
    d.update(overrides)
    d.setdefault("bytes_per_block", d["bytes_per_token"] * d["block_size"])
    d.setdefault("kv_cache_bytes", d["num_blocks"] * d["bytes_per_block"])
    return EngineInfo(**d)


def request(rid, table=(), state="running", prompt_len=6, output_len=3, tokens=(), history=(), **kw) -> RequestInfo:
    d = dict(
        request_id=rid,
        state=state,
        tier=None,
        prompt_len=prompt_len,
        output_len=output_len,
        num_computed_tokens=prompt_len + output_len,
        num_cached_tokens=0,
        block_table=tuple(table),
        slots_allocated=len(table) * 4,
        kv_bytes=(prompt_len + output_len) * 1000,
        tokens=tuple(tokens),
        history=tuple(history),
    )
    d.update(kw)
    return RequestInfo(**d)


_SNAPSHOT_INFO = dict(
    block_size=4,
    bytes_per_token=1000,
    max_model_len=256,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    victim_policy="last_admitted",
)


def snapshot(num_blocks=16, requests=(), shared=None, cached=(), fills=None, spec=None, **info_kw) -> Snapshot:
    """Blocks are derived from the requests' block tables; `cached` lists cached-free block ids.
    The EngineInfo has 4-token blocks and 1000 B per token (round numbers for the figure tests)
    unless info_kw says otherwise."""
    owners: dict[int, list[str]] = {}
    for r in requests:
        for b in r.block_table:
            owners.setdefault(b, []).append(r.request_id)
    blocks = []
    for i in range(num_blocks):
        o = tuple(owners.get(i, ()))
        if o:
            state = "used"
        elif i in cached:
            state = "cached"
        else:
            state = "free"
        fill = (fills or {}).get(i, 4 if o else 0)
        blocks.append(BlockInfo(block_id=i, state=state, ref_count=len(o), owners=o, fill=fill))
    n_used = sum(1 for b in blocks if b.state == "used")
    n_cached = sum(1 for b in blocks if b.state == "cached")
    metrics = EngineMetrics(
        num_running=len(requests),
        num_blocks_used=n_used,
        num_blocks_cached=n_cached,
        num_blocks_free=num_blocks - n_used - n_cached,
        kv_cache_usage_perc=n_used / num_blocks if num_blocks else 0.0,
        spec=spec or SpecMetrics(),
    )
    info = make_engine_info(**{**_SNAPSHOT_INFO, "num_blocks": num_blocks, **info_kw})
    return Snapshot(
        step=10,
        time=1.0,
        info=info,
        blocks=tuple(blocks),
        requests=tuple(requests),
        metrics=metrics,
        running_ids=tuple(r.request_id for r in requests),
    )


def tok(tid, text, kind="plain", step=0, rejected_text=None) -> TokenMark:
    return TokenMark(
        token_id=tid,
        text=text,
        kind=kind,
        step=step,
        rejected_id=(999 if rejected_text is not None else None),
        rejected_text=rejected_text,
    )


def hist(step, cached, blocks, phase, time=None, bpt=1000) -> HistoryPoint:
    return HistoryPoint(
        step=step,
        time=step * 0.1 if time is None else time,
        num_cached_tokens=cached,
        num_blocks=blocks,
        kv_bytes=cached * bpt,
        phase=phase,
    )
