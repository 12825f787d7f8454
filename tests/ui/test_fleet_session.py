"""ui/servers/fleet_session.py: the attach list's parsing and names (no network, no threads)."""

from __future__ import annotations

import pytest

from ui.servers import fleet_session as fs


def test_attach_lines_parse_urls_and_optional_endpoints():
    got = fs.parse_attach_lines(
        "http://127.0.0.1:8000/v1\n\n# a comment\nhttp://127.0.0.1:8001 tcp://127.0.0.1:5557 tcp://127.0.0.1:5558\n"
    )
    assert got == [
        ("http://127.0.0.1:8000", "", ""),
        ("http://127.0.0.1:8001", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"),
    ]
    urls = [u for u, _, _ in got]
    assert [fs.instance_name(u, urls) for u in urls] == [":8000", ":8001"]
    assert fs.instance_name("http://a:1", ["http://a:1", "http://b:2"]) == "a:1"


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "enter at least one base URL"),
        ("http://127.0.0.1:1\nnot a url", "servers, line 2: base URL"),
        ("http://127.0.0.1:1 http://x", "servers, line 1: an events endpoint is tcp://HOST:PORT"),
        ("http://127.0.0.1:1 a b c", "servers, line 1: expected `URL [events endpoint [replay endpoint]]`"),
        ("http://127.0.0.1:1\nhttp://127.0.0.1:1/", "listed twice"),
        ("\n".join(f"http://127.0.0.1:{p}" for p in range(1, 18)), f"at most {fs.MAX_ATTACH} servers"),
    ],
)
def test_attach_lines_name_the_line_and_the_limit(text, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        fs.parse_attach_lines(text)


def test_local_fleet_refuses_load_before_start():
    lf = fs.LocalFleet()
    assert lf.snapshot() is None and not lf.busy
    assert not lf.run_load("kv_aware", 4) and lf.error
    assert lf.trace().snapshots == ()
