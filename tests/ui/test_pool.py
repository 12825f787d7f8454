"""Pool map and block table figures carry the snapshot's numbers (hand-built snapshots)."""

from tests.factories import request, snapshot
from ui.figures import pool, theme


def _cells(fig):
    hm = fig.data[0]
    return [v for row in hm.z for v in row if v is not None], hm


def test_every_block_is_one_cell_coloured_by_owner():
    a = request("req-a", table=(0, 3, 5))
    b = request("req-b", table=(1, 2))
    snap = snapshot(16, [a, b], cached=(7, 8))
    colors = theme.request_colors_for(snap)
    fig = pool.pool_map_figure(snap, colors)
    z, hm = _cells(fig)
    assert len(z) == 16
    flat = [v for row in hm.z for v in row]
    cat_a, cat_b = 2 + colors.index("req-a"), 2 + colors.index("req-b")
    assert [flat[i] for i in (0, 3, 5)] == [cat_a] * 3
    assert [flat[i] for i in (1, 2)] == [cat_b] * 2
    assert flat[7] == flat[8] == 1  # cached-free
    assert flat[4] == flat[6] == 0  # free
    assert cat_a != cat_b
    # cached-free cells carry a symbol too, not just a shade
    assert hm.text[0][7] == "c"
    assert "16" in fig.layout.title.text and "2 cached-free" in fig.layout.title.text


def test_shared_blocks_show_ref_count():
    a = request("a", table=(0, 1, 2))
    b = request("b", table=(0, 1, 4))
    c = request("c", table=(0, 6))
    snap = snapshot(8, [a, b, c])
    fig = pool.pool_map_figure(snap)
    texts = [
        t
        for tr in fig.data
        if tr.type == "scatter" and tr.mode == "text" and tr.x and tr.x[0] is not None
        for t in tr.text
    ]
    assert sorted(texts) == ["×2", "×3"]
    cells, group = pool.pool_cells(snap)
    assert group == 1
    assert cells[0].state == theme.SHARED and cells[0].ref_count == 3
    assert cells[1].state == theme.SHARED and cells[1].ref_count == 2
    assert cells[2].state == theme.USED


def test_large_pool_is_aggregated_to_the_cap():
    reqs = [request(f"r{i}", table=tuple(range(i * 100, i * 100 + 100))) for i in range(50)]
    snap = snapshot(10000, reqs)
    cells, group = pool.pool_cells(snap, max_cells=4096)
    assert group == 3 and len(cells) <= 4096
    assert sum(c.blocks for c in cells) == 10000
    assert sum(c.n_used for c in cells) == 5000
    fig = pool.pool_map_figure(snap)
    z, _ = _cells(fig)
    assert len(z) == len(cells) <= 4096
    assert "one cell = 3 blocks" in fig.layout.title.text


def test_hover_text_is_escaped():
    evil = "<img src=x onerror=alert(1)>"
    snap = snapshot(4, [request(evil, table=(0,))])
    fig = pool.pool_map_figure(snap)
    hover = fig.data[0].customdata[0][0]
    assert "<img" not in hover and "&lt;img" in hover
    names = [tr.name for tr in fig.data if tr.name]
    assert all("<img" not in n for n in names)


def test_block_table_logical_to_physical():
    a = request("a", table=(9, 2, 5))
    b = request("b", table=(9, 3))
    snap = snapshot(12, [a, b], fills={9: 4, 2: 4, 5: 1})
    rows = pool.block_table_rows(snap, "a")
    assert [(r["logical"], r["physical"]) for r in rows] == [(0, 9), (1, 2), (2, 5)]
    assert rows[0]["ref_count"] == 2 and rows[2]["fill"] == 1
    fig = pool.block_table_figure(snap, "a", per_row=16)
    hm = fig.data[0]
    assert hm.text[0][:3] == ("9 ×2", "2", "5") or list(hm.text[0][:3]) == ["9 ×2", "2", "5"]
    assert "logical 2 → physical 5" in hm.customdata[0][2]
    assert "3 logical blocks" in fig.layout.title.text


def test_block_table_of_unknown_request():
    snap = snapshot(4, [])
    fig = pool.block_table_figure(snap, "gone")
    assert "not in the engine" in fig.layout.title.text
    assert pool.block_table_rows(snap, "gone") == []


def test_empty_pool_does_not_crash():
    snap = snapshot(0, [])
    fig = pool.pool_map_figure(snap)
    assert fig.layout.height > 0


def test_pool_map_hover_shows_the_pools_real_bytes():
    """A block's hover gives its filled and total bytes at the pool's bytes per token and names the
    KV dtype (the tiny model's int8 pool: 160 B per token, scales included)."""
    import dataclasses

    from engine import EngineConfig, LLMEngine, SamplingParams
    from ui.figures import pool

    eng = LLMEngine(EngineConfig(model="tiny", kv_cache_dtype="int8", block_size=4, num_kv_blocks=16, num_threads=1))
    eng.add_request("r", "hello world and more", SamplingParams(max_tokens=2, ignore_eos=True))
    eng.step()
    snap = eng.snapshot()
    assert snap.info.kv_cache_dtype == "int8" and snap.info.bytes_per_token == 160
    fig = pool.pool_map_figure(snap, max_cells=64)
    hovers = [h for row in fig.data[0].customdata for h in row if h]
    n = eng.bm.num_tokens("r")
    first = next(h for h in hovers if "owners: r" in h)
    assert f"fill: {min(n, 4)}/4 slots · {min(n, 4) * 160:,} of 640 bytes (int8)" in first
    old = dataclasses.replace(snap, info=dataclasses.replace(snap.info, kv_cache_dtype="<b>"))
    assert "(&lt;b&gt;)" in [h for row in pool.pool_map_figure(old).data[0].customdata for h in row if h][0]


def test_pool_map_outlines_this_sessions_other_requests():
    """`mine` marks blocks of the viewer's other requests (dotted), apart from the highlighted one."""
    from engine import LLMEngine
    from engine.config import EngineConfig, SamplingParams
    from ui.figures import pool as P

    eng = LLMEngine(
        EngineConfig(
            model="tiny",
            device="cpu",
            dtype="float32",
            block_size=4,
            num_kv_blocks=32,
            max_num_seqs=4,
            max_model_len=64,
            seed=0,
            num_threads=1,
        )
    )
    for rid in ("a", "b", "c"):
        eng.add_request(rid, [7, 8, 9, 10, 11, 12], SamplingParams(max_tokens=4, ignore_eos=True))
    eng.step()
    snap = eng.snapshot()
    fig = P.pool_map_figure(snap, highlight="a", mine={"a", "b"})
    mine = [t for t in fig.data if t.name == "your other requests' blocks"]
    assert len(mine) == 1
    want = {i for i, b in enumerate(snap.blocks) if "b" in b.owners}
    assert len(mine[0].x) == len(want) == len(snap.request("b").block_table)
    assert not [
        t for t in P.pool_map_figure(snap, highlight="a", mine={"a"}).data if t.name == "your other requests' blocks"
    ]
