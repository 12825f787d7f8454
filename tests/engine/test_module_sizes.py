"""Modules stay small and named for what they own: no engine module over MAX_LINES lines."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 600


def test_no_engine_module_is_over_the_limit():
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines())
        for p in (ROOT / "engine").rglob("*.py")
        if "csrc" not in p.parts
    }
    over = {m: n for m, n in sizes.items() if n > MAX_LINES}
    assert not over, f"engine modules over {MAX_LINES} lines: {over}"
