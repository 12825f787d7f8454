"""The Claims page's table (ui/figures/claims.py): one escaped row per claim, its verdict word."""

from engine.lab.claims import ClaimRow
from ui.figures import claims as CL


def _row(holds, **kw):
    d = dict(key="k", claim="KV <b>cache</b>", seeds="001", measured="3 & 4", holds=holds, why="rule", source="f.json")
    d.update(kw)
    return ClaimRow(**d)


def test_rows_are_escaped_and_carry_their_verdict():
    out = CL.claims_table_html([_row(True), _row(False, source="<img src=x>"), _row(None)])
    assert out.count("<tr><td") == 3
    assert "KV &lt;b&gt;cache&lt;/b&gt;" in out and "3 &amp; 4" in out and "&lt;img src=x&gt;" in out
    assert "<img" not in out and "<b>cache" not in out
    for word in ("holds here", "does not hold here", "not measured"):
        assert f">{word}</b>" in out
    assert CL.claims_table_html([]).count("<tr>") == 1  # the header only
