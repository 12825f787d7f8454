"""engine/core/output_processor.py: the one definition of a row's phase, and the finish rules."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from engine.core.output_processor import row_phase


def _row(start, n):
    return NS(start=start, tokens=[0] * n)


def _item(num_prompt_tokens, spec=0):
    return NS(req=NS(num_prompt_tokens=num_prompt_tokens), num_spec_tokens=spec)


@pytest.mark.parametrize(
    "prompt,start,n,spec,phase",
    [
        (10, 0, 10, 0, "prefill"),  # the whole prompt
        (1, 0, 1, 0, "prefill"),  # a 1-token prompt
        (10, 9, 1, 0, "prefill"),  # the final 1-token chunk, or the token a full prefix hit recomputes
        (10, 8, 2, 0, "prefill"),  # a final chunk
        (10, 10, 1, 0, "decode"),  # the newest output token
        (10, 14, 1, 0, "decode"),
        (10, 12, 4, 3, "verify"),  # the newest output token and 3 drafts
        (10, 0, 13, 0, "prefill"),  # a recompute after preemption (prompt and outputs again)
    ],
)
def test_row_phase(prompt, start, n, spec, phase):
    assert row_phase(_item(prompt, spec), _row(start, n)) == phase
