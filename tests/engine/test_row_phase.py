"""A row's phase has one definition (ScheduledItem.phase, decided by the scheduler from
Request.in_decode): "decode" only for the newest output token alone, "verify" for it with drafts,
"prefill" for everything else. A prompt's last token scheduled alone after an earlier chunk
(position > 0) is prefill: it gets no drafts, the speculative decoder does not count it as a decode
pass, and the trace says prefill."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams, SpeculativeConfig
from engine.observe import trace_events as ev
from engine.observe.recording import drive

PROMPT = [5, 6, 7, 5, 6, 7, 5, 6, 7]  # 9 tokens: an 8-token chunk, then 1 token at position 8


def test_a_one_token_chunk_after_position_0_is_prefill_everywhere():
    eng = LLMEngine(
        EngineConfig(
            model="tiny",
            num_threads=1,
            max_num_batched_tokens=8,
            speculative=SpeculativeConfig(num_speculative_tokens=2, method="ngram"),
        )
    )
    rid = eng.add_request(None, PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    req = eng.requests[rid]
    eng.step()
    assert req.num_computed_tokens == 8 and not req.in_decode  # one prompt token left: not decode
    eng.step()  # the prompt's last token, alone in its chunk
    rows = eng.events.since(0, kinds=[ev.SCHEDULE])[-1].data["rows"]
    assert rows == [[rid, "prefill", 1, 8]]  # no drafts rode on it
    assert eng.spec.num_target_passes == 0  # not a decode pass
    assert req.num_output_tokens == 1 and req.in_decode
    drive(eng)
    kinds = [r[0][1] for r in (e.data["rows"] for e in eng.events.since(0, kinds=[ev.SCHEDULE]))]
    assert kinds[:2] == ["prefill", "prefill"] and set(kinds[2:]) <= {"decode", "verify"}
    assert eng.spec.num_target_passes == len(kinds) - 2


def test_the_rule_on_requests():
    """Request.in_decode: everything but the newest token computed, and that token an output."""
    from engine.core.sequence import Request

    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), 0.0)
    assert not r.in_decode  # nothing computed
    r.num_computed_tokens = 2
    assert not r.in_decode  # the prompt's last token (a final 1-token chunk, or a full prefix hit)
    r.output_token_ids.append(9)
    r.num_computed_tokens = 3
    assert r.in_decode  # the newest output token alone
    r.num_computed_tokens = 0
    assert not r.in_decode  # a recompute after preemption starts as prefill


@pytest.mark.parametrize(
    "prompt,outputs,computed,spec,phase",
    [
        (10, 0, 0, 0, "prefill"),  # the whole prompt
        (1, 0, 0, 0, "prefill"),  # a 1-token prompt
        (10, 0, 9, 0, "prefill"),  # the final 1-token chunk, or the token a full prefix hit recomputes
        (10, 0, 8, 0, "prefill"),  # a final chunk
        (10, 1, 10, 0, "decode"),  # the newest output token
        (10, 5, 14, 0, "decode"),
        (10, 3, 12, 3, "verify"),  # the newest output token and 3 drafts
        (10, 3, 0, 0, "prefill"),  # a recompute after preemption (prompt and outputs again)
        (10, 3, 11, 0, "prefill"),  # a recompute's 1-token chunk that is not the newest token
    ],
)
def test_row_phase(prompt, outputs, computed, spec, phase):
    from engine.core.scheduler import ScheduledItem
    from engine.core.sequence import Request

    r = Request("r", list(range(prompt)), SamplingParams(max_tokens=8), 0.0)
    r.output_token_ids = [1] * outputs
    r.num_computed_tokens = computed
    assert ScheduledItem(r, 1 + spec, spec, r.in_decode).phase == phase
