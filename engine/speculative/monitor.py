"""Whether speculation pays, per request class. Speculation pays when the tokens it yields per
verify pass (mean acceptance length L) exceed the measured cost ratio c = (draft time + verify pass
time) / plain pass time for the current batch. CostModel holds the measured target-pass times by
tokens fed (seeded by a short calibration at start-up, then updated from every pure-decode step)
and the draft time per request; ClassState is one class's window of its last verify
passes (`monitor_window` / k of them) and its fallback / probe state (SpecDecoder._monitor acts on them)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


class CostModel:
    """Measured target-pass seconds by tokens fed, for pure-decode steps (every row a decode
    or verify row). EMA per token count; costs at unmeasured counts come from a least-squares
    line a + b·T through the measured points."""

    EMA = 0.2

    def __init__(self):
        self.table: dict[int, float] = {}
        self.counts: dict[int, int] = {}
        self.draft_s_per_req: float | None = None  # EMA of draft seconds per drafted request

    def add(self, tokens: int, secs: float) -> None:
        old = self.table.get(tokens)
        self.table[tokens] = secs if old is None else (1 - self.EMA) * old + self.EMA * secs
        self.counts[tokens] = self.counts.get(tokens, 0) + 1

    def add_draft(self, secs_per_req: float) -> None:
        d = self.draft_s_per_req
        self.draft_s_per_req = secs_per_req if d is None else (1 - self.EMA) * d + self.EMA * secs_per_req

    def cost(self, tokens: float) -> float | None:
        t = self.table
        if not t:
            return None
        if tokens in t:
            return t[tokens]
        if len(t) == 1:
            ((t0, c0),) = t.items()
            return c0 * max(tokens, 1) / max(t0, 1) if tokens > t0 else c0
        # the least-squares slope in closed form (a handful of points, asked every decode step:
        # np.polyfit cost ~0.2 ms a call here), then the intercept for the slope kept
        n = len(t)
        mx, my = sum(t) / n, sum(t.values()) / n
        sxx = sum((x - mx) ** 2 for x in t)
        b = max(sum((x - mx) * (y - my) for x, y in t.items()) / sxx, 0.0)
        a = my - b * mx
        return max(a + b * tokens, min(t.values()) * 0.5)

    def ratio(self, k: float) -> float | None:
        """Measured cost of a (k+1)-token pass / a 1-token pass (one request)."""
        c1, ck = self.cost(1), self.cost(1 + k)
        return ck / c1 if c1 and ck else None

    def break_even(self, batch: int, k: float) -> float | None:
        """c = (draft time for the batch + verify pass) / plain pass, for `batch` decode rows
        each drafting k tokens."""
        plain = self.cost(batch)
        verify = self.cost(batch * (1 + k))
        if not plain or not verify:
            return None
        return (batch * (self.draft_s_per_req or 0.0) + verify) / plain


@dataclass(slots=True)
class ClassState:
    speculating: bool = True
    window: deque = field(default_factory=deque)  # (draft tokens, accepted) per verify pass
    plain_steps: int = 0
    num_fallbacks: int = 0
    k: int | None = None  # per-class k override
    enabled: bool = True  # per-class switch

    def add(self, n_draft: int, n_acc: int, passes: int) -> None:
        """One verify pass; the window keeps the last `passes`."""
        self.window.append((n_draft, n_acc))
        while len(self.window) > passes:
            self.window.popleft()

    def clear(self) -> None:
        self.window.clear()
