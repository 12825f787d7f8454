"""AppTest for the Claims page's `bench scaling` section: with a stored result (a real smoke run of
the suite on the tiny model, tests/fixtures/bench_scaling) it draws the figure from it; with none
(tests/fixtures/bench holds no scaling result) it says how to produce one and draws nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.app import helpers as H

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _text(at) -> str:
    return "\n".join([H.html(at), *(c.value for c in at.caption)])


@pytest.mark.parametrize(
    ("tiny_test_mode", "stored"),
    [
        ({"KVSCOPE_RESULTS_DIR": str(FIXTURES / "bench_scaling")}, True),
        ({"KVSCOPE_RESULTS_DIR": str(FIXTURES / "bench")}, False),
    ],
    indirect=["tiny_test_mode"],
    ids=["with-result", "without"],
)
def test_scaling_section_reads_the_stored_result(app_test, stored):
    at = H.run_ok(app_test("pages/claims.py"))
    text = _text(at)
    if stored:
        assert "bench &#x27;scaling&#x27;" in text or "bench 'scaling'" in text, text[-2000:]
        assert "AVX" in text or "portable" in text or "torch reference" in text  # the ISA it ran
        assert "llama.cpp: no GGUF file" in text  # a missing peer says why
        assert len(at.get("plotly_chart")) == 1
    else:
        assert "No `bench scaling` result is stored yet" in text, text[-2000:]
        assert len(at.get("plotly_chart")) == 0
