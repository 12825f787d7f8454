"""The Speculative page's watch mode (engine/lab/watch.py): an eviction in the middle of a speculative
run frees the request's blocks, the engine recomputes prompt + generated tokens, and greedy output
stays token-for-token that of plain decoding; the button and the scheduled trigger both work."""

import threading

import pytest

from engine import EngineConfig, SpeculativeConfig
from engine.lab.watch import WatchControl, token_ids, watch_speculative

BASE = EngineConfig(model="tiny", num_threads=1)
SPEC = SpeculativeConfig(method="self_draft", draft_quantize="int8", num_speculative_tokens=4)
PROMPT = "the cat sat on the mat and the cat sat on the"


METHODS = {
    "self_draft_int8": SPEC,
    "self_draft_early_exit": SpeculativeConfig(method="self_draft", draft_layers=1, num_speculative_tokens=4),
    "draft_model": SpeculativeConfig(method="draft_model", draft_model="tiny", num_speculative_tokens=4),
    "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=4),
}


@pytest.mark.parametrize("method", list(METHODS))
def test_scheduled_eviction_mid_run_recomputes_and_keeps_greedy_output(method):
    res = watch_speculative(BASE, PROMPT, METHODS[method], 40, WatchControl(evict_after_tokens=12), chat=False)
    r = res.request
    assert r.state == "finished" and r.output_len == 40
    assert len(res.evictions) == 1
    e = res.evictions[0]
    assert e.trigger == "after 12 tokens" and 12 <= e.output_tokens < 12 + SPEC.num_speculative_tokens + 1
    assert e.blocks_freed > 0 and e.tokens_to_recompute == r.prompt_len + e.output_tokens
    assert r.num_preemptions == 1
    # the history shows the drop: at the eviction nothing is cached, then the recompute refills it
    after = [p for p in r.history if p.step > e.step]
    assert after and after[0].num_cached_tokens >= e.tokens_to_recompute
    assert res.matches_plain is True and token_ids(r) == res.plain_token_ids
    if method == "self_draft_int8":  # the int8 copy drafts well: it was speculating around the eviction
        assert any(t.kind == "accepted" for t in r.tokens)


def test_evict_button_between_steps():
    ctl = WatchControl()
    fired = threading.Event()

    def on_step(snap, _note):
        if snap is None:
            return
        r = snap.request("watch")
        if r is not None and r.output_len >= 5 and not fired.is_set():
            fired.set()
            ctl.request_evict()  # as the page's button does, from another thread

    res = watch_speculative(BASE, PROMPT, SPEC, 24, ctl, chat=False, on_step=on_step)
    assert [e.trigger for e in res.evictions] == ["button"]
    assert res.request.num_preemptions == 1 and res.matches_plain is True


def test_sampled_watch_records_p_and_q_and_skips_the_plain_reference():
    res = watch_speculative(BASE, PROMPT, SPEC, 16, WatchControl(evict_after_tokens=6), temperature=0.3, chat=False)
    assert res.plain_token_ids is None and res.matches_plain is None
    judged = [t for t in res.request.tokens if t.kind in ("accepted", "replaced")]
    assert judged and all(t.p is not None and t.q is not None and t.u is not None for t in judged)


def test_stop_aborts_the_run():
    ctl = WatchControl()
    ctl.stop.set()
    res = watch_speculative(BASE, PROMPT, SPEC, 64, ctl, chat=False)
    assert res.stopped and res.request.state == "aborted" and res.plain_token_ids is None


@pytest.mark.parametrize("bad", [dict(pace_s=-1), dict(pace_s=5), dict(evict_after_tokens=0)])
def test_control_refuses_bad_values_with_the_field_named(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        WatchControl(**bad)


def test_a_press_before_the_request_runs_waits_for_it():
    ctl = WatchControl()
    ctl.request_evict()  # pressed while the private engine is still being built
    res = watch_speculative(BASE, PROMPT, SPEC, 12, ctl, chat=False)
    assert [(e.trigger, e.step) for e in res.evictions] == [("button", 1)]
    assert res.matches_plain is True
