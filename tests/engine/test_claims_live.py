"""engine/lab/claims_live.py: which passes count as a batch of B (the SCHEDULE-event filter) and the
contended flag, on a stand-in EngineThread that replays chosen SCHEDULE events."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from engine.lab import claims_live as CL


class _Events:
    def __init__(self):
        self.items: list = []

    @property
    def last_seq(self) -> int:
        return len(self.items)

    def since(self, seq: int, kinds=()):
        return [e for e in self.items[seq:] if not kinds or e.kind in kinds]


class _Thread:
    """submit() records the request; once a batch of B is in, `passes(ids)` gives the SCHEDULE
    events the engine 'ran' for it: (rows, forward_s)."""

    def __init__(self, passes):
        self.lock = threading.Lock()
        self.events = _Events()
        self.tokenizer = SimpleNamespace(encode=lambda s: list(range(len(s.split()))))
        self.engine = SimpleNamespace(has_unfinished_requests=lambda: False)
        self.passes, self.pending, self.prompts = passes, [], []

    def submit(self, ids, params, request_id):
        self.prompts.append((request_id, len(ids), params.max_tokens))
        self.pending.append(request_id)
        h = SimpleNamespace(request_id=request_id, result=lambda timeout: self._run())
        return h

    def _run(self):
        if self.pending:
            ids, self.pending = self.pending, []
            for rows, fwd in self.passes(ids):
                self.events.items.append(SimpleNamespace(kind="schedule", data={"rows": rows, "forward_s": fwd}))


def _decode(ids):
    return [[r, "decode"] for r in ids]


def test_only_passes_of_exactly_this_batch_decoding_are_timed():
    def passes(ids):
        return [
            ([[r, "prefill"] for r in ids], 5.0),  # prefill: not a decode pass
            (_decode(ids), 0.5),
            (_decode(ids) + [["someone-else", "decode"]], 9.0),  # shared with another request
            (_decode(ids[:1]), 7.0),  # only part of the batch
            (_decode(ids), 0.7),
        ]

    th = _Thread(passes)
    times, contended = CL.decode_step_times(th, batch_sizes=(1, 2), prompt_tokens=8, new_tokens=3)
    # b=1: the "part of the batch" pass is the whole batch, so three passes count
    assert times == {1: 0.7, 2: 0.6}
    assert contended is True
    assert [(n, m) for _, n, m in th.prompts] == [(8, 3)] * 3
    assert len({rid for rid, _, _ in th.prompts}) == 3


def test_a_batch_never_alone_in_a_decode_pass_has_no_time():
    th = _Thread(lambda ids: [([[r, "prefill"] for r in ids], 1.0), ([[ids[0], "decode"]] + [["x", "decode"]], 2.0)])
    times, contended = CL.decode_step_times(th, batch_sizes=(1,), prompt_tokens=4, new_tokens=2)
    assert times == {}
    assert contended is True
