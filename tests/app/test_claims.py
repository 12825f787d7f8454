"""AppTest for the Claims page: bench rows from the committed fixture, then Measure on the tiny
shared engine replaces the live-measurable rows with numbers labelled as measured here."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

VIEWS = Path(__file__).resolve().parents[2] / "pages"
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "bench"


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("KVSCOPE_TEST_MODE", "1")
    monkeypatch.setenv("KVSCOPE_MODEL", "tiny")
    monkeypatch.setenv("KVSCOPE_RESULTS_DIR", str(FIXTURE))


def _html(at) -> str:
    return " ".join(h.proto.body for h in at.get("html"))


def test_claims_page_bench_then_live():
    at = AppTest.from_file(str(VIEWS / "claims.py"), default_timeout=900)
    at.run()
    assert not at.exception, at.exception
    body = _html(at)
    assert "holds here" in body and "model tiny" in body and "press Measure" in body
    assert "press Measure" in body
    at.button(key="claims_measure").click().run()
    assert not at.exception, at.exception
    body = _html(at)
    errors = [e.value for e in at.error]
    assert not errors, errors
    assert "measured on this page" in body and "B=1:" in body and "k=8:" in body, body[-3000:]
