"""kvscope's own routes: /v1/kvscope/snapshot is Snapshot.to_dict() (snapshot_from_dict reads it
back) and /v1/kvscope/stream sends {"snapshot", "events"} messages with the events after `since`."""

import json

import httpx

from engine.observe.trace_events import event_from_dict, snapshot_from_dict


def test_snapshot_round_trips(server):
    r = httpx.get(server.base + "/v1/kvscope/snapshot", headers=server.headers)
    assert r.status_code == 200
    snap = snapshot_from_dict(r.json())
    assert snap.info.num_blocks == server.thread.config.num_kv_blocks
    assert len(snap.blocks) == snap.info.num_blocks


def test_stream_sends_snapshots_and_the_events_after_since(server):
    th = server.thread
    since = th.events.last_seq
    r = httpx.post(
        server.base + "/v1/completions",
        headers=server.headers,
        timeout=120,
        json={"prompt": "stream me", "max_tokens": 3, "temperature": 0},
    )
    assert r.status_code == 200
    events, snaps = [], []
    with httpx.stream(
        "GET", server.base + f"/v1/kvscope/stream?since={since}&interval=0.05", headers=server.headers, timeout=60
    ) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        for line in s.iter_lines():
            if not line.startswith("data: "):
                continue
            msg = json.loads(line[6:])
            assert set(msg) == {"snapshot", "events"}
            snaps.append(snapshot_from_dict(msg["snapshot"]))
            events += [event_from_dict(e) for e in msg["events"]]
            if any(e.kind == "finish" for e in events) or len(snaps) >= 5:
                break
    assert events and events[0].seq == since + 1
    assert [e.seq for e in events] == list(range(since + 1, since + 1 + len(events)))
    rid = next(e.request_id for e in events if e.kind == "admit")
    assert rid.startswith("http-")
    assert {"admit", "prefill", "finish"} <= {e.kind for e in events if e.request_id == rid}
    assert snaps[-1].step >= max(e.step for e in events)


def test_stream_interval_is_bounded(server):
    r = httpx.get(server.base + "/v1/kvscope/stream?interval=0.001", headers=server.headers)
    assert r.status_code == 400 and "interval" in r.json()["error"]["message"]
    r = httpx.get(server.base + "/v1/kvscope/stream?since=-1", headers=server.headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "since"
