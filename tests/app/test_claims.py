"""AppTest for the Claims page: bench rows from the committed fixture, then Measure on the tiny
shared engine replaces the live-measurable rows with numbers labelled as measured here."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.app import helpers as H

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "bench"

pytestmark = pytest.mark.parametrize(
    "tiny_test_mode", [{"KVSCOPE_RESULTS_DIR": str(FIXTURE)}], indirect=True, ids=["bench-fixture"]
)


def test_claims_page_bench_then_live(app_test):
    at = H.run_ok(app_test("pages/claims.py"))
    body = H.html(at)
    assert "holds here" in body and "model tiny" in body and "press Measure" in body
    assert "press Measure" in body
    at.button(key="claims_measure").click().run()
    H.no_exception(at)
    body = H.html(at)
    errors = [e.value for e in at.error]
    assert not errors, errors
    assert "measured on this page" in body and "B=1:" in body and "k=8:" in body, body[-3000:]
