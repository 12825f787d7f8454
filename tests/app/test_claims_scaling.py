"""AppTest for the Claims page's `bench scaling` section: with a stored result (a real smoke run of
the suite on the tiny model, tests/fixtures/bench_scaling) it draws the figure from it; with none
(tests/fixtures/bench holds no scaling result) it draws the committed one in docs/data, saying so and
where it was measured."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.lab import bench_results as BR
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
        assert "No `bench scaling` result from this machine yet: this is the committed measurement" in text
        newest = BR.committed("scaling")
        assert Path(newest.path).name in text and BR.machine_text(newest) in text, text[-2000:]
        assert len(at.get("plotly_chart")) == 1


def test_committed_results_are_the_newest_per_suite(tmp_path):
    assert BR.committed("scaling", tmp_path) is None  # none committed: the page says how to make one
    newest = BR.committed("scaling")
    assert newest is not None and newest.path.startswith(str(BR.DOCS_DATA))
    names = sorted(p.name for p in BR.DOCS_DATA.glob("scaling-*.json"))
    assert Path(newest.path).name == names[-1]
    where = BR.machine_text(newest)
    assert "2 CPUs" in where and ("AVX-512" in where or "AVX2" in where), where
