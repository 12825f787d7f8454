"""The Streamlit settings every way of starting the app shares, and the Streamlit behaviour that
makes one of them necessary.

Streamlit 1.67 sends an element it has sent before (10 kB and up) as a short reference message
("ref_hash"). When the next rerun of a fragment cuts a run of that fragment short, the server
clears the fragment's queued deltas but keeps every message without a fragment id, and a reference
has none: the browser then receives element N of a block that lost its elements before N and drops
the whole page ("Bad delta path index 13 (should be between [0, 10])"; the Playground under API
load, scripts/playground_blank_repro.py). kvscope turns those references off."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
from streamlit.runtime.forward_msg_queue import ForwardMsgQueue

REPO = Path(__file__).resolve().parents[2]
FRAGMENT = "frag-1"


def _element(path: list[int], fragment: str = FRAGMENT) -> ForwardMsg:
    msg = ForwardMsg()
    msg.metadata.delta_path[:] = path
    msg.delta.new_element.markdown.body = f"element {path[-1]}"
    msg.delta.fragment_id = fragment
    return msg


def _reference(path: list[int]) -> ForwardMsg:
    msg = ForwardMsg()
    msg.metadata.delta_path[:] = path
    msg.ref_hash = "0123abcd"
    return msg


def test_a_cut_fragment_run_keeps_its_reference_messages_but_not_their_siblings():
    """The mechanism, on Streamlit's own queue: if this fails after a Streamlit upgrade, the queue
    no longer keeps the orphan reference, and the setting below may be able to go."""
    q = ForwardMsgQueue()
    for i in range(3):
        q.enqueue(_element([0, 2, i]))
    q.enqueue(_reference([0, 2, 3]))
    q.clear(retain_lifecycle_msgs=True, fragment_ids_this_run=[FRAGMENT])
    kept = q.flush()
    assert [m.WhichOneof("type") for m in kept] == ["ref_hash"]
    assert list(kept[0].metadata.delta_path) == [0, 2, 3]  # index 3 of a block the browser may hold 0 of


def _flag_value(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_every_app_start_turns_cached_references_off():
    config = tomllib.loads((REPO / ".streamlit" / "config.toml").read_text())
    floor = float(config["global"]["minCachedMessageSize"])
    assert floor >= 1e15  # no element reaches it: nothing is sent as a reference

    run_sh = (REPO / "scripts" / "run.sh").read_text()
    m = re.search(r"--global\.minCachedMessageSize (\S+)", run_sh)
    assert m is not None and float(m.group(1)) == floor

    from tests.browser.shot import STREAMLIT_FLAGS

    assert float(_flag_value(STREAMLIT_FLAGS, "--global.minCachedMessageSize")) == floor

    bench = (REPO / "scripts" / "watched_bench.py").read_text()
    m = re.search(r'"--global\.minCachedMessageSize", "(\S+)"', bench)
    assert m is not None and float(m.group(1)) == floor
