"""The exactness contract through the process boundary: greedy token ids streamed by an
EngineClient (the engine core in its own process, the app's default) are identical to
transformers' generate on the same weights (tests/engine/exact_ref.py), alone and batched, and
an abort mid-batch changes no other request's ids. One core process (the default model, fp32,
one torch thread) for the module."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.config import EngineConfig
from engine.core.client import EngineClient
from tests.engine.exact_ref import MAX_TOKENS, reference
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

WAIT_S = 600  # hang guard on a busy machine, not a speed limit


@pytest.fixture(scope="module")
def client():
    c = EngineClient(
        EngineConfig(model="default", device="cpu", dtype="float32", num_threads=1, num_kv_blocks=256, seed=0)
    )
    yield c
    c.close()


def ids_of(h):
    return h.result(timeout=WAIT_S).outputs[0].token_ids


def test_each_prompt_alone(client):
    ids, refs = reference()
    for i in (0, 4, 5):  # short, code, ~300-token prompt
        assert ids_of(client.submit(ids[i], SamplingParams(max_tokens=MAX_TOKENS))) == refs[i], f"prompt {i}"
    client.check_invariants()


def test_all_prompts_batched_streamed(client):
    ids, refs = reference()
    hs = [client.submit(x, SamplingParams(max_tokens=MAX_TOKENS)) for x in ids]
    texts = ["".join(h.stream(timeout=WAIT_S)) for h in hs]
    for i, (h, text) in enumerate(zip(hs, texts)):
        out = h.result(timeout=WAIT_S)
        assert out.outputs[0].token_ids == refs[i], f"prompt {i}"
        assert text == out.outputs[0].text  # the streamed deltas add up to the final text
    client.check_invariants()


def test_abort_mid_batch_leaves_the_others_exact(client):
    ids, refs = reference()
    long = client.submit(ids[7], SamplingParams(max_tokens=400, ignore_eos=True))
    hs = {i: client.submit(ids[i], SamplingParams(max_tokens=MAX_TOKENS)) for i in (1, 3, 9)}
    wait_until(lambda: long.output is not None, "the long request's first token", WAIT_S, 0.01)
    assert client.abort(long.request_id)
    for i, h in hs.items():
        assert ids_of(h) == refs[i], f"prompt {i}"
    assert client.snapshot_now().metrics.num_running == 0
    client.check_invariants()
