"""Controlled A/B measurements: the one home for how kvscope times one thing against another.

Every comparison a page or the bench shows (speculative vs plain, prefix cold vs warm, cache vs
no-cache, paged vs contiguous) goes through `compare`:

- the two sides alternate, and which one goes first alternates too (round 0: a then b, round 1:
  b then a, ...), so a slow drift of the machine lands on both sides equally;
- at least `min_rounds` rounds (default 3), then more while a stated time budget allows, up to
  `max_rounds`;
- each side's median and spread (min, max, interquartile range) over its rounds, and the ratio's
  median and range over per-round ratios;
- contention: `busy()` is read before and after every sample; it is any counter of work the
  measurement did not do itself (the shared engine's steps, other requests' tokens). A round in
  which it moved is contended, and the comparison says so beside the number;
- a suspect rule: a ratio that a physical bound contradicts (e.g. a speculative speedup above the
  measured tokens per target pass times a margin) is reported as suspect with the reason, not as
  a result (`Comparison.suspect`).

Pure Python: no torch, no Streamlit. Side runners return seconds (or a `Sample`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

MIN_ROUNDS = 3
MAX_ROUNDS = 50
# A speedup can exceed tokens per target pass only by what a target pass with k+1 tokens saves
# over 1-token passes through fixed per-step costs; beyond this margin the number is not believed.
SUSPECT_MARGIN = 1.25


@dataclass(frozen=True, slots=True)
class Sample:
    """One timed run of one side. `seconds` is what is compared; `extra` carries the side's own
    counters (tokens, target passes, ...) for suspect rules and display."""

    seconds: float
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Spread:
    """Median and spread of one side's samples."""

    n: int
    median: float
    lo: float
    hi: float
    q1: float
    q3: float

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1


def spread(values) -> Spread:
    """Median, min, max and quartiles (inclusive method: the quartiles of 1 or 2 values lie
    within them). ValueError on an empty input or a non-finite value."""
    vals = sorted(float(v) for v in values)
    if not vals:
        raise ValueError("spread needs at least one value")
    if any(v != v or v in (float("inf"), float("-inf")) for v in vals):
        raise ValueError("spread needs finite values")
    if len(vals) == 1:
        q1 = q3 = vals[0]
    else:
        q1, _, q3 = statistics.quantiles(vals, n=4, method="inclusive")
    return Spread(len(vals), statistics.median(vals), vals[0], vals[-1], q1, q3)


def round_order(cells, r: int) -> list:
    """The cells of round `r` in the order they run: as given on even rounds, reversed on odd
    ones, so whichever cell ran first in one round runs last in the next (two sides: a b, b a, ...;
    more cells, as the side channel's four: the same mirror)."""
    cells = list(cells)
    return cells if r % 2 == 0 else cells[::-1]


def order(rounds: int, names: tuple[str, str] = ("a", "b")) -> list[tuple[int, str]]:
    """(round, side) in the order `compare` runs them: each round runs both sides once; even
    rounds start with the first side, odd rounds with the second."""
    return [(r, side) for r in range(rounds) for side in round_order(names, r)]


@dataclass(frozen=True, slots=True)
class Comparison:
    """Two sides measured alternately. `ratio` = a / b per round (e.g. plain seconds / speculative
    seconds = speedup of b over a)."""

    names: tuple[str, str]
    a: Spread
    b: Spread
    ratio: Spread
    rounds: int
    order: tuple[tuple[int, str], ...]
    samples_a: tuple[Sample, ...]
    samples_b: tuple[Sample, ...]
    contended_rounds: int = 0
    busy_delta: int = 0  # total movement of the busy counter during the samples
    busy_what: str = ""  # what the busy counter counts (shown in the conditions)
    busy_checked: bool = True  # False: no busy counter was given, contention unknown
    budget_s: float | None = None
    elapsed_s: float = 0.0
    suspect: str | None = None  # reason, when a bound contradicts the ratio

    @property
    def contended(self) -> bool:
        return self.contended_rounds > 0

    @property
    def result(self) -> float | None:
        """The median ratio, or None when it is suspect (show `suspect` instead)."""
        return None if self.suspect else self.ratio.median

    def conditions(self) -> str:
        """One line for beside the number: rounds, order, spread, contention."""
        a, b = self.names
        parts = [
            f"median of {self.rounds} rounds (range {self.ratio.lo:.2f}–{self.ratio.hi:.2f}), "
            f"{a} and {b} alternated, first side swapped each round"
        ]
        if self.budget_s is not None:
            parts.append(f"rounds fitted to a {self.budget_s:.0f} s budget")
        if not self.busy_checked:
            parts.append("contention not checked (no counter of other work)")
        elif self.contended:
            what = f" ({self.busy_delta} {self.busy_what})" if self.busy_what else ""
            parts.append(f"CONTENDED: other work ran during {self.contended_rounds} of {self.rounds} rounds{what}")
        else:
            quiet = f" (no {self.busy_what})" if self.busy_what else ""
            parts.append("uncontended: nothing else ran meanwhile" + quiet)
        return "; ".join(parts)

    def with_suspect(self, reason: str | None) -> "Comparison":
        from dataclasses import replace

        return replace(self, suspect=reason)


def _as_sample(v) -> Sample:
    if isinstance(v, Sample):
        s = v
    else:
        s = Sample(float(v))
    if not (s.seconds > 0 and s.seconds != float("inf")):
        raise ValueError(f"a side's run must take a positive, finite time; got {s.seconds!r}")
    return s


def compare(
    run_a: Callable[[int], object],
    run_b: Callable[[int], object],
    *,
    names: tuple[str, str] = ("a", "b"),
    min_rounds: int = MIN_ROUNDS,
    max_rounds: int | None = None,
    budget_s: float | None = None,
    busy: Callable[[], int] | None = None,
    busy_what: str = "",
    on_sample: Callable[[int, str, Sample], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Comparison:
    """Run the sides alternately (`order`), `min_rounds` rounds, then further whole rounds while
    the elapsed time plus one more round's mean fits `budget_s` (never more than `max_rounds`).
    run_x(round) returns seconds or a Sample. busy() is read around every sample."""
    if not (isinstance(min_rounds, int) and min_rounds >= 1):
        raise ValueError(f"min_rounds must be an integer >= 1, got {min_rounds!r}")
    cap = MAX_ROUNDS if max_rounds is None else max_rounds
    if not (isinstance(cap, int) and cap >= min_rounds):
        raise ValueError(f"max_rounds must be an integer >= min_rounds={min_rounds}, got {max_rounds!r}")
    if budget_s is not None and not budget_s > 0:
        raise ValueError(f"budget_s must be > 0, got {budget_s!r}")
    runs = {names[0]: run_a, names[1]: run_b}
    got: dict[str, list[Sample]] = {names[0]: [], names[1]: []}
    seq: list[tuple[int, str]] = []
    contended = 0
    busy_total = 0
    t0 = clock()
    r = 0
    while r < cap:
        if r >= min_rounds:
            spent = clock() - t0
            if budget_s is None or spent + spent / r > budget_s:
                break
        moved = False
        for rr, side in order(r + 1, names)[2 * r :]:
            before = busy() if busy is not None else 0
            s = _as_sample(runs[side](rr))
            after = busy() if busy is not None else 0
            if after != before:
                moved = True
                busy_total += abs(after - before)
            got[side].append(s)
            seq.append((rr, side))
            if on_sample is not None:
                on_sample(rr, side, s)
        contended += moved
        r += 1
    a_s, b_s = got[names[0]], got[names[1]]
    return Comparison(
        names=names,
        a=spread(s.seconds for s in a_s),
        b=spread(s.seconds for s in b_s),
        ratio=spread(x.seconds / y.seconds for x, y in zip(a_s, b_s)),
        rounds=r,
        order=tuple(seq),
        samples_a=tuple(a_s),
        samples_b=tuple(b_s),
        contended_rounds=contended,
        busy_delta=busy_total,
        busy_what=busy_what,
        busy_checked=busy is not None,
        budget_s=budget_s,
        elapsed_s=clock() - t0,
    )


def ratio_after(cmp_: Comparison, key: str) -> Spread | None:
    """The spread over rounds of a / b for the time after a phase each sample timed in
    extra[key] (seconds less that phase: e.g. "ttft_s", the time after the first token); None when
    a sample lacks it or has no time after it."""
    pairs = []
    for a, b in zip(cmp_.samples_a, cmp_.samples_b):
        ta, tb = a.extra.get(key), b.extra.get(key)
        if ta is None or tb is None or a.seconds <= ta or b.seconds <= tb:
            return None
        pairs.append((a.seconds - ta) / (b.seconds - tb))
    return spread(pairs) if pairs else None


def suspect_ratio(
    ratio: float | None,
    bound: float | None,
    *,
    margin: float = SUSPECT_MARGIN,
    what: str = "ratio",
    bound_what: str = "its bound",
) -> str | None:
    """The reason `ratio` is not believable, or None: when it exceeds `bound` x `margin`."""
    if ratio is None or bound is None:
        return None
    if not margin >= 1.0:
        raise ValueError(f"margin must be >= 1, got {margin!r}")
    if ratio > bound * margin:
        return (
            f"{what} {ratio:.2f}× is above {bound_what} {bound:.2f} × margin {margin:.2f} = {bound * margin:.2f}: "
            "the counters say it cannot be this fast, so something else (contention, a cold first run) moved it"
        )
    return None


def suspect_speedup(
    speedup: float | None, tokens_per_target_pass: float | None, *, margin: float = SUSPECT_MARGIN
) -> str | None:
    """Speculative decoding saves target passes, nothing else: its wall-clock speedup over plain
    decoding cannot be much above the measured tokens per target pass."""
    return suspect_ratio(
        speedup, tokens_per_target_pass, margin=margin, what="speedup", bound_what="the measured tokens per target pass"
    )
