"""The one tiny-engine factory and the one run-until-done loop of tests/engine (the loop is
engine/observe/recording.drive, the engine's own; this adds collecting outputs and the invariant
check after every step)."""

from __future__ import annotations

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.observe.recording import drive

# The tiny model's settings for the tests that run an engine-core process (test_engine_client,
# test_lab_proc): small pool, one thread.
TINY_CORE = dict(
    model="tiny",
    device="cpu",
    dtype="float32",
    block_size=4,
    num_kv_blocks=96,
    max_num_seqs=8,
    max_model_len=512,
    seed=0,
    num_threads=1,
)


def tiny_engine(**kw) -> LLMEngine:
    """An LLMEngine on the tiny random model, one CPU thread unless told otherwise."""
    kw.setdefault("model", "tiny")
    kw.setdefault("num_threads", 1)
    return LLMEngine(EngineConfig(**kw))


def run_to_end(
    eng: LLMEngine, prompts=(), params: SamplingParams | None = None, *, check: bool = True, after_step=None
) -> dict:
    """Adds `prompts` (text or token ids) with `params`, steps until nothing is unfinished
    (recording.drive) and returns every finished RequestOutput by request id, in the order the
    prompts were added first. check: eng.check_invariants() after every step; after_step(eng):
    a test's own per-step check."""
    ids = [eng.add_request(None, p, params) for p in prompts]
    done: dict = {}

    def on_step(_step, outs, _dt):
        for o in outs:
            if o.finished:
                done[o.request_id] = o
        if check:
            eng.check_invariants()
        if after_step is not None:
            after_step(eng)

    drive(eng, on_step=on_step)
    return {**{i: done[i] for i in ids if i in done}, **done}


def token_ids(eng: LLMEngine, prompts, params: SamplingParams, *, check: bool = True, after_step=None) -> list:
    """run_to_end's outputs as token ids, one list per prompt in order; fails on any error."""
    outs = run_to_end(eng, prompts, params, check=check, after_step=after_step)
    ids = list(outs)[: len(prompts)]
    for o in outs.values():
        assert o.error is None, o.error
    return [outs[i].outputs[0].token_ids for i in ids]


def one_output(eng: LLMEngine, prompt, params: SamplingParams):
    """One request run to its end: its CompletionOutput (fails on an error)."""
    (out,) = run_to_end(eng, [prompt], params, check=False).values()
    assert out.error is None, out.error
    return out.outputs[0]
