"""Token strip: kinds rendered distinctly, and every token text escaped and made visible."""

from html.parser import HTMLParser

import pytest

from tests.factories import tok
from ui.figures import tokens

HOSTILE = [
    "<script>alert(1)</script>",
    "<img src=x onerror=alert(1)>",
    '"><svg onload=alert(1)>',
    "' onmouseover='alert(1)",
    "&lt;b&gt;already-escaped&amp;",
]


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.attrs, self.text = [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs.extend(attrs)

    def handle_data(self, data):
        self.text.append(data)


def _parse(s):
    p = _Collect()
    p.feed(s)
    return p


@pytest.mark.parametrize("evil", HOSTILE)
def test_hostile_text_is_text(evil):
    strip = tokens.token_strip_html([tok(1, evil, "accepted"), tok(2, evil, "replaced", rejected_text=evil)])
    p = _parse(strip)
    assert set(p.tags) <= {"div", "span", "bdi", "br"}
    assert all(name in ("class", "title", "style", "dir", "aria-hidden") for name, _ in p.attrs)
    assert not any(name.startswith("on") for name, _ in p.attrs)
    # the text survives, as text
    assert evil in "".join(p.text).replace("␣", " ") or evil.replace(" ", "") in "".join(p.text)


def test_kinds_render_with_distinct_non_colour_cues():
    strip = tokens.token_strip_html(
        [
            tok(1, "The", "plain", 1),
            tok(2, " cat", "accepted", 2),
            tok(3, " sat", "replaced", 2, rejected_text=" ran"),
            tok(4, " on", "accepted", 3),
            tok(5, " mat", "bonus", 3),
        ]
    )
    assert strip.count("tok-accepted") == 2
    assert strip.count("tok-bonus") == 1
    assert strip.count("tok-rejected") == 1 and strip.count("tok-replaced") == 1
    # the rejected draft comes first, struck through, then its replacement
    i_rej, i_rep = strip.index("tok-rejected"), strip.index("tok-replaced")
    assert i_rej < i_rep
    rejected_chip = strip[i_rej:i_rep]
    assert "line-through" in rejected_chip and " ran" in rejected_chip
    assert "✗" in rejected_chip
    assert "✓" in strip and "+" in strip and "→" in strip


def test_evicted_tokens_are_marked():
    toks = [tok(i, f"t{i}", "plain", step=i) for i in range(6)]
    strip = tokens.token_strip_html(toks, evicted_before_step=4, prompt_evicted_tokens=12)
    assert strip.count('tok-evicted"') + strip.count("tok-evicted ") == 4
    assert strip.count("tok-plain") == 2
    assert "12 tokens recomputed" in strip


def test_invisible_characters_become_visible():
    v = tokens.visible_text("a\u200bb")
    assert "U+200B" in v and "\u200b" not in v
    v = tokens.visible_text("\u202eevil")  # right-to-left override must not reach the page raw
    assert "U+202E" in v and "\u202e" not in v
    v = tokens.visible_text("\u2067x\u2069")
    assert "\u2067" not in v and "\u2069" not in v
    assert "↵" in tokens.visible_text("\n")
    assert "⇥" in tokens.visible_text("\t")
    assert "␣" in tokens.visible_text("  ")
    assert "\\x00" in tokens.visible_text("\x00")
    assert "∅" in tokens.visible_text("")
    # a right-to-left word is kept as text, isolated inside its chip
    chip = tokens.token_chips(tok(1, "שלום", "plain"))
    assert "שלום" in chip and "<bdi" in chip and "unicode-bidi:isolate" in chip


def test_newline_tokens_break_the_line():
    strip = tokens.token_strip_html([tok(1, "a", "plain"), tok(2, "\n", "plain"), tok(3, "b", "plain")])
    assert strip.count("<br>") == 1


def test_long_tokens_and_long_strips_are_capped():
    long = "x" * 5000
    chip = tokens.token_chips(tok(1, long, "plain"))
    assert len(chip) < 2000 and "…+4960" in chip
    strip = tokens.token_strip_html([tok(i, "y", "plain") for i in range(3000)], max_tokens=100)
    assert strip.count("tok-plain") == 100
    assert "2900 earlier tokens" in strip


def test_counts():
    toks = [
        tok(1, "a", "accepted"),
        tok(2, "b", "replaced", rejected_text="c"),
        tok(3, "d", "bonus"),
        tok(4, "e", "accepted"),
    ]
    c = tokens.token_counts(toks)
    assert c == {"plain": 0, "accepted": 2, "bonus": 1, "replaced": 1, "rejected": 1}


def test_recomputed_positions_include_the_eviction_step():
    """An eviction's event carries the step after which it happened: that step's tokens were
    dropped too (the strip marks tokens made before the step after it)."""
    assert tokens.recomputed_before_step([]) is None
    assert tokens.recomputed_before_step([3, 7]) == 8
    toks = [tok(i, f"t{i}", step=s) for i, s in enumerate([1, 2, 3, 3, 4])]
    strip = tokens.token_strip_html(toks, evicted_before_step=tokens.recomputed_before_step([3]))
    assert strip.count("tok-evicted ") + strip.count('tok-evicted"') == 4


def test_chip_tooltips_carry_rejection_sampling_numbers():
    from engine.observe.snapshot import TokenMark

    acc = TokenMark(1, "a", "accepted", 5, p=0.4, q=0.8, u=0.3)
    rep = TokenMark(2, "b", "replaced", 5, rejected_id=9, rejected_text="<x>", p=0.1, q=0.9, u=0.7)
    bonus = TokenMark(3, "c", "bonus", 5, p=0.25)
    h = tokens.token_strip_html([acc, rep, bonus])
    assert "min(1, p/q) = 0.5; drew u = 0.3 → accepted" in h
    assert "target p = 0.1, draft q = 0.9, accept with min(1, p/q) = 0.111; drew u = 0.7 → rejected" in h
    assert "residual max(0, p − q)" in h and "p = 0.25" in h
    assert "<x>" not in h  # the rejected draft's text is escaped
    assert "draft q" not in tokens.token_strip_html([TokenMark(1, "a", "accepted", 5)])  # greedy: no numbers
