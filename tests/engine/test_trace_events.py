"""Traces (issue 7, items 3 and 6): a real run's trace round-trips exactly, hostile strings inside
it stay inert data, and malformed or hostile trace files only ever get a ValueError (with the
line number where one applies) from engine.trace_events.read_trace — never another exception, never
execution. The exact messages for each kind of bad file are in tests/engine/test_bad_input.py.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.observe.trace_events import MAX_LINE_BYTES, MAX_TRACE_LINES, read_trace, trace_to_string, write_trace

HOSTILE = [
    '<script>alert("x")</script>',
    "<img src=x onerror=alert(1)>",
    '"><svg onload=alert(1)>',
    "\u202eevil\u202c",
    "zero\u200bwidth\u200d",
    "line\nbreak\r\n",
    "tab\tquote'\"",
    "\x00nul",
    "é中文🙂",
]
H = '{"kind": "kvscope-trace", "version": 1}\n'


@pytest.fixture(scope="module")
def run():
    """A real run with preemption, prefix hits and hostile request ids/prompts: (snapshots, events)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        eng = LLMEngine(EngineConfig(model="tiny", device="cpu", num_kv_blocks=10, block_size=4, max_model_len=128))
        snaps = []
        for i, h in enumerate(HOSTILE):
            eng.add_request(
                f"{h}#{i}", f"{h} shared prefix for every request {i}", SamplingParams(max_tokens=6, ignore_eos=True)
            )
        while eng.has_unfinished_requests():
            eng.step()
            snaps.append(eng.snapshot())
        return snaps, list(eng.events), eng
    finally:
        torch.set_num_threads(n)


def test_real_trace_round_trips_exactly(run):
    snaps, events, eng = run
    assert any(e.kind == "preempt" for e in events) and any(e.kind == "prefix_hit" for e in events)
    text = trace_to_string(snaps, events)
    tr = read_trace(text)
    assert tr.snapshots == snaps
    assert tr.events == events
    # the same through bytes and file objects
    assert read_trace(text.encode()).snapshots == snaps
    assert read_trace(io.StringIO(text)).events == events
    assert read_trace(io.BytesIO(text.encode())).snapshots == snaps


def test_hostile_strings_stay_data(run):
    snaps, events, _ = run
    tr = read_trace(trace_to_string(snaps, events))
    ids = {r.request_id for s in tr.snapshots for r in s.requests}
    for i, h in enumerate(HOSTILE):
        assert f"{h}#{i}" in ids  # unchanged, unescaped: escaping is the renderer's job
    previews = {r.prompt_preview for s in tr.snapshots for r in s.requests}
    assert any("<script>" in p for p in previews)
    # one JSON object per line even with newlines and NULs inside strings
    for line in trace_to_string(snaps, events).splitlines():
        json.loads(line)


def test_truncation_at_any_point_is_a_clear_error_or_a_valid_prefix(run):
    snaps, events, _ = run
    text = trace_to_string(snaps[:3], events[:20])
    lines = text.splitlines(keepends=True)
    cuts = sorted(
        {len("".join(lines[:k])) for k in range(len(lines) + 1)} | set(random.Random(0).sample(range(len(text)), 60))
    )
    for cut in cuts:
        part = text[:cut]
        try:
            tr = read_trace(part)
        except ValueError as e:
            msg = str(e)
            assert msg.startswith(("trace line", "trace is empty", "trace holds no snapshot")), msg
            continue
        assert tr.snapshots == snaps[: len(tr.snapshots)]


def test_random_byte_corruption_only_raises_value_error(run):
    snaps, events, _ = run
    data = trace_to_string(snaps[:2], events[:30]).encode()
    rng = random.Random(1)
    for _ in range(300):
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            op = rng.random()
            pos = rng.randrange(len(b))
            if op < 0.5:
                b[pos] = rng.randrange(256)
            elif op < 0.75:
                del b[pos : pos + rng.randint(1, 40)]
            else:
                b[pos:pos] = rng.choice([b"{", b"}", b"[", b'"', b"\n", b"NaN", b"1e999", b"\xff", b"null"])
        try:
            read_trace(bytes(b))
        except ValueError:
            pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["snapshot", "event", "kvscope-trace", "other"]), payload=json_values)
def test_arbitrary_json_in_a_trace_line_only_raises_value_error(kind, payload):
    line = json.dumps({"kind": kind, kind: payload, "snapshot": payload, "event": payload})
    try:
        read_trace(H + line + "\n")
    except ValueError:
        pass


@settings(max_examples=60, deadline=None)
@given(
    field=st.sampled_from(
        [
            "step",
            "time",
            "info",
            "blocks",
            "requests",
            "metrics",
            "waiting_ids",
            "running_ids",
            "swapped_ids",
            "healthy",
            "error",
        ]
    ),
    value=json_values,
)
def test_junk_in_any_snapshot_field_only_raises_value_error(run, field, value):
    snaps, _, _ = run
    d = snaps[-1].to_dict()
    d[field] = value
    try:
        read_trace(H + json.dumps({"kind": "snapshot", "snapshot": d}) + "\n")
    except ValueError:
        pass


def test_size_and_line_limits():
    with pytest.raises(ValueError, match=f"more than {MAX_TRACE_LINES} lines"):
        read_trace(H + "\n" * MAX_TRACE_LINES)
    with pytest.raises(ValueError, match=f"trace line 2: longer than {MAX_LINE_BYTES} characters"):
        read_trace(H + '{"kind": "event", "x": "' + "a" * MAX_LINE_BYTES + '"}\n')

    # a file object is read only up to the limit (+1 byte to detect the overflow)
    class Counting(io.BytesIO):
        got = 0

        def read(self, n=-1):
            out = super().read(n)
            Counting.got += len(out)
            return out

    with pytest.raises(ValueError, match="larger than the limit of 1000 bytes"):
        read_trace(Counting(b"x" * 100_000), max_bytes=1000)
    assert Counting.got == 1001


def test_pickle_and_code_payloads_are_never_executed(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    payloads = [
        pickle.dumps(Evil()),
        pickle.dumps(Evil(), protocol=0),
        H + json.dumps({"kind": "snapshot", "snapshot": {"__reduce__": ["os.system", f"touch {marker}"]}}),
        H + '{"kind": "event", "event": {"seq": 1, "step": 1, "time": 0, "kind": "admit", '
        '"data": {"reason": "__import__(\'os\').system(\'touch ' + str(marker) + "')\"}}}\n",
    ]
    for p in payloads:
        with pytest.raises(ValueError):
            read_trace(p)
    assert not marker.exists()


def test_write_trace_output_is_plain_json_lines(run, tmp_path):
    snaps, events, _ = run
    p = tmp_path / "t.jsonl"
    with open(p, "w", encoding="utf-8") as f:
        write_trace(f, snaps[:2], events[:5])
    raw = p.read_bytes()
    raw.decode("utf-8")
    lines = raw.decode().splitlines()
    assert json.loads(lines[0]) == {"kind": "kvscope-trace", "version": 2}
    assert all(set(json.loads(ln)) in ({"kind", "snapshot"}, {"kind", "event"}) for ln in lines[1:])
    assert read_trace(raw).snapshots == snaps[:2]


def test_plain_equals_asdict_and_from_plain_inverts_it_through_msgpack(run):
    """The engine core's frames (issue 32): snapshot.plain is asdict's value, faster; from_plain
    rebuilds the same Snapshot from it after msgpack (arrays as lists, enums as strings)."""
    from dataclasses import asdict

    from engine.core.core_proc import pack, unpack
    from engine.observe.snapshot import Snapshot, from_plain, plain

    snaps, _, _ = run
    for snap in snaps:
        d = plain(snap)
        assert d == asdict(snap)
        assert json.dumps(d) == json.dumps(asdict(snap))
        back = from_plain(Snapshot, unpack(pack(d)))
        assert back == snap
        assert all(
            type(r.block_table) is tuple and type(r.state) is type(snap.requests[0].state) for r in back.requests
        )
        assert back == from_plain(Snapshot, pickle.loads(pickle.dumps(d)))
