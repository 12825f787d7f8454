"""recording.LoadFeeder bound to an EngineThread stops when that thread's engine is rebuilt."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from engine.observe import recording


@dataclass
class WR:
    arrival_s: float
    prompt: str
    max_tokens: int


class FakeThread:
    """Stands in for an EngineThread: `.engine` is swapped on rebuild; submit records ids."""

    def __init__(self):
        self.engine = object()
        self.ids = []
        self.first = threading.Event()
        self.go_on = threading.Event()

    def submit(self, prompt, params, request_id=None):
        self.ids.append(request_id)
        if len(self.ids) == 1:
            self.first.set()
            self.go_on.wait(30)


def test_feeder_stops_when_its_engine_is_rebuilt():
    th = FakeThread()
    reqs = [WR(0.0, f"p{i}", 4) for i in range(10)]
    f = recording.LoadFeeder(
        th.submit, reqs, make_params=lambda r: None, run_id="r", time_scale=0.0, bound_to=th
    ).start()
    assert th.first.wait(30)
    th.engine = object()  # the shared engine was rebuilt while the feeder was submitting
    th.go_on.set()
    f.join(30)
    s = f.snapshot_status()
    assert th.ids == ["r-000"]  # nothing more went into the rebuilt engine
    assert s.done and s.stopped and s.rebuilt and s.submitted == 1
    assert recording.LoadFeeder.REBUILT in s.errors


def test_unrebuilt_feeder_submits_everything():
    th = FakeThread()
    th.go_on.set()
    f = recording.LoadFeeder(
        th.submit,
        [WR(0.0, "a", 1), WR(0.0, "b", 1)],
        make_params=lambda r: None,
        run_id="q",
        time_scale=0.0,
        bound_to=th,
    ).start()
    f.join(30)
    s = f.snapshot_status()
    assert th.ids == ["q-000", "q-001"] and s.done and not s.stopped and not s.rebuilt


# ------------------------------------------------------------------ conversations with real answers


def _chained_run(n=6, turns=3, **engine_kw):
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.core.thread import EngineThread
    from engine.lab.workloads import conversation_chain, release_freeze

    th = EngineThread(LLMEngine(EngineConfig(model="tiny", num_threads=1, **engine_kw)))
    reqs = release_freeze(
        n=n, seed=3, turns=turns, window_s=1.0, prompt_median=30, prompt_max=60, context_max=400, output_max=24
    )
    handles = {}

    def submit(prompt, params, request_id=None):
        h = th.submit(prompt, params, request_id=request_id)
        handles[request_id] = h
        return h

    f = recording.LoadFeeder(
        submit,
        reqs,
        lambda r: SamplingParams(**r.sampling_kwargs()),
        "cv",
        time_scale=0.0,
        chain=conversation_chain(th.engine.tokenizer),
    ).start()
    f.join(120)
    outs = {rid: h.result(120) for rid, h in handles.items()}
    snap = th.snapshot_now()
    th.shutdown()
    return reqs, f.snapshot_status(), outs, snap


def test_chained_turns_carry_the_models_own_answers_and_hit_them_in_the_prefix_cache():
    reqs, status, outs, snap = _chained_run()
    assert status.done and status.submitted == len(reqs) and status.skipped == 0 and not status.errors
    later = [r for r in reqs if r.parent_id is not None]
    assert later
    for r in later:
        parent, child = outs[f"cv-{r.parent_id}"], outs[f"cv-{r.request_id}"]
        p_ids, a_ids = list(parent.prompt_token_ids), list(parent.outputs[0].token_ids)
        # the previous prompt, then exactly what the model answered, then the follow-up
        assert list(child.prompt_token_ids[: len(p_ids) + len(a_ids)]) == p_ids + a_ids
        assert len(child.prompt_token_ids) > len(p_ids) + len(a_ids)
        # sent only once its previous turn had finished
        info_c, info_p = snap.request(f"cv-{r.request_id}"), snap.request(f"cv-{r.parent_id}")
        assert info_c.arrival_time >= info_p.finish_time
        # the answer's own full blocks were reused (the hit reaches past the previous prompt); the
        # answer's last token was sampled but never fed, so its K/V was never written
        bs = snap.info.block_size
        assert child.metrics.num_cached_tokens == ((len(p_ids) + len(a_ids) - 1) // bs) * bs
        assert child.metrics.num_cached_tokens > len(p_ids)


def test_a_turn_whose_previous_turn_was_rejected_is_skipped_with_its_reason():
    # a 96-token cap: the conversations' later turns outgrow it, and the turns after them are skipped
    reqs, status, outs, _ = _chained_run(n=6, turns=3, max_model_len=96)
    assert status.rejected >= 1 and status.skipped >= 1
    assert status.submitted + status.rejected + status.skipped == len(reqs)
    assert any("skipped, its previous turn" in e for e in status.errors)
