"""ui/figures/drafters.py: every drafter choice maps to the engine config it names; pool.kv_bar_html:
the KV bar's numbers are the snapshot's; spec.py's tick timeline."""

from __future__ import annotations

import pytest

from tests.factories import make_engine_info
from ui.figures import drafters as W
from ui.figures import pool as P
from ui.figures import spec as S


def test_each_drafter_is_what_its_label_says():
    c = W.drafter_config("n-gram (prompt lookup)", 16)
    assert (c.method, c.num_speculative_tokens) == ("ngram", 16)
    c = W.drafter_config("self-draft: early exit", 3, exit_layers=2)
    assert (c.method, c.draft_layers, c.draft_quantize) == ("self_draft", 2, None)
    c = W.drafter_config("self-draft: int8 copy", 4)
    assert (c.method, c.draft_layers, c.draft_quantize) == ("self_draft", None, "int8")
    c = W.drafter_config("draft model", 5, draft_model=" tiny ")
    assert (c.method, c.draft_model) == ("draft_model", "tiny")
    for label in W.DRAFTERS:
        assert W.label_of(W.drafter_config(label, 2, draft_model="tiny")) == label


def test_bad_choices_name_the_field():
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, 16\]"):
        W.drafter_config("self-draft: int8 copy", 17)
    with pytest.raises(ValueError, match="draft model: give a local path or hub id"):
        W.drafter_config("draft model", 4, draft_model="  ")
    with pytest.raises(ValueError, match="drafter must be one of"):
        W.drafter_config("<script>", 4)


def test_kv_bar_reads_the_snapshot():
    from engine.observe.snapshot import EngineMetrics, Snapshot

    info = make_engine_info(num_blocks=64)
    snap = Snapshot(
        step=1,
        time=0.0,
        info=info,
        blocks=(),
        requests=(),
        metrics=EngineMetrics(num_blocks_used=16, num_blocks_cached=8),
    )
    out = P.kv_bar_html(snap)
    assert "16 of 64 blocks used" in out and "8 cached-free" in out
    assert "width:25.00%" in out and "width:12.50%" in out


def test_tick_timeline_replays_the_request():
    from tests.factories import hist, request, tok

    req = request(
        "r1",
        tokens=(tok(5, "a", "plain", step=2), tok(6, "b", "accepted", step=3), tok(7, "c", "bonus", step=3)),
        history=(hist(0, 0, 0, "waiting"), hist(1, 4, 1, "prefill"), hist(3, 7, 2, "decode")),
    )
    assert S.tick_steps(req) == [0, 1, 2, 3]
    toks, p = S.at_tick(req, 2)
    assert [t.token_id for t in toks] == [5] and p.step == 1
    assert S.tick_caption(req, 3, 100) == (
        "Step 3: decode, 7 tokens' K/V in 2 block(s) (200 bytes of blocks). "
        "Tokens so far: 1 accepted, 1 bonus, 1 plain."
    )
