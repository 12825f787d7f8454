"""Seeded workload scenarios for the load page, the benchmarks and the soak test. No torch.

Every scenario is a pure function of its parameters and ``seed`` (it uses its own
``random.Random(seed)``, never the global one) and returns ``WorkloadRequest``s sorted by arrival.
Text is synthesized from the fixed code-review vocabulary in engine/lab/workload_text.py (plain ASCII), so no scenario
depends on a model's real answers. Prompt lengths are in words (whitespace-separated pieces);
the real token count depends on the tokenizer (roughly 1.5-2.5 tokens per word for this
code-heavy text with SmolLM2's tokenizer). Output lengths are ``max_tokens``; with the default
``ignore_eos=True`` hint a request generates exactly that many tokens, so runs are comparable.

Scenarios (``SCENARIOS``; build one with ``make_workload(name, n, seed, **params)``):

* ``release-freeze``: many code-review conversations arriving within a short window, each growing
  turn by turn. Turn k+1's prompt is turn k's prompt + a placeholder assistant reply (as long as
  turn k's ``max_tokens`` would produce, ~0.75 words per token) + a new follow-up (question and
  more diff lines), so contexts grow and every turn extends the previous turn's prefix.
* ``shared-system-prompt``: one long system prompt, many different user questions behind it.
* ``mixed``: independent requests with lognormal prompt and output lengths (clipped).
"""

from __future__ import annotations

import inspect
import math
import random
from dataclasses import dataclass

from engine.lab.workload_text import (
    FILES,
    FOLLOWUPS,
    INTROS,
    LONG_SYSTEM_SENTENCES,
    QUESTIONS,
    REPLY_SENTENCES,
    SYSTEM_PREAMBLE,
    USER_QUESTIONS,
    diff,
    fill,
    words_from,
)
from engine.model.kv_layout import cdiv

MAX_REQUESTS = 10_000


@dataclass(slots=True)
class WorkloadRequest:
    request_id: str
    arrival_s: float  # offset from the start of the run
    max_tokens: int
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    tier: str | None = None
    conversation_id: str | None = None
    turn: int = 1
    ignore_eos: bool = True  # hint: generate exactly max_tokens
    parent_id: str | None = None  # the previous turn of the same conversation, if any
    # release-freeze: what this turn adds after the previous assistant reply (the user's follow-up
    # and more diff); `prompt` holds the placeholder-reply version, `chained_prompt` the real one
    followup: str | None = None

    @property
    def prompt_words(self) -> int:
        return len(self.prompt.split()) if self.prompt is not None else 0

    def sampling_kwargs(self) -> dict:
        """Keyword arguments for ``SamplingParams`` (greedy)."""
        return {"max_tokens": self.max_tokens, "ignore_eos": self.ignore_eos, "tier": self.tier}


# ---------------------------------------------------------------------------- validation


def check_int(name, v, lo, hi):
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _check_num(name, v, lo, hi, lo_open=False):
    bad = (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or v != v
        or math.isinf(v)
        or (v <= lo if lo_open else v < lo)
        or v > hi
    )
    if bad:
        left = "(" if lo_open else "["
        raise ValueError(f"{name} must be a number in {left}{lo}, {hi}], got {v!r}")
    return float(v)


def _check_rate(v):
    if v is None:
        return None
    return _check_num("arrival_rate", v, 0, 1e6, lo_open=True)


def _check_lengths(prefix, median, sigma, lo, hi, limit):
    check_int(f"{prefix}_min", lo, 1, limit)
    check_int(f"{prefix}_max", hi, 1, limit)
    if hi < lo:
        raise ValueError(f"{prefix}_max ({hi}) must be >= {prefix}_min ({lo})")
    _check_num(f"{prefix}_median", median, 1, limit)
    _check_num(f"{prefix}_sigma", sigma, 0, 3)


def _check_tiers(tiers):
    """None, a sequence of tier names (equal weights) or a dict name -> weight > 0."""
    if tiers is None:
        return None
    if isinstance(tiers, str):
        tiers = [tiers]
    if isinstance(tiers, dict):
        items = list(tiers.items())
    else:
        try:
            items = [(t, 1.0) for t in tiers]
        except TypeError:
            raise ValueError(
                f"tiers must be None, a list of tier names or a dict name -> weight, got {tiers!r}"
            ) from None
    if not items or len(items) > 64:
        raise ValueError("tiers must name between 1 and 64 tiers")
    for name, w in items:
        if not isinstance(name, str) or not name:
            raise ValueError(f"tiers: every tier name must be a non-empty string, got {name!r}")
        _check_num(f"tiers[{name!r}] weight", w, 0, 1e9, lo_open=True)
    return [n for n, _ in items], [float(w) for _, w in items]


def _pick_tier(rng, tiers):
    if tiers is None:
        return None
    names, weights = tiers
    return rng.choices(names, weights=weights)[0]


def _lognormal_int(rng, median, sigma, lo, hi) -> int:
    v = rng.lognormvariate(math.log(median), sigma) if sigma > 0 else median
    return int(min(hi, max(lo, round(v))))


def _arrivals(rng, n, rate):
    """Poisson arrivals at ``rate`` per second, or all at 0 when rate is None."""
    if rate is None:
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(round(t, 6))
        t += rng.expovariate(rate)
    return out


REPLY_CUE = "\n\nAssistant: "


def chained_prompt(req: WorkloadRequest, parent_prompt_ids, parent_output_ids, tokenize) -> list[int]:
    """A later turn's prompt built from what the model really answered: the previous turn's prompt
    ids as the engine ran them, the model's own output ids, then this turn's follow-up and the
    reply cue, tokenized on their own (message boundaries, as a chat server builds the next turn).
    The answer's full blocks are then the same tokens the engine cached while generating them, so
    the next turn can hit them in the prefix cache. A first turn gets its prompt + the reply cue
    (`tokenize(text)` -> ids without special tokens)."""
    if req.parent_id is None or req.followup is None:
        return list(tokenize(req.prompt + REPLY_CUE.rstrip(" ")))
    return list(parent_prompt_ids) + list(parent_output_ids) + list(tokenize(req.followup + REPLY_CUE.rstrip(" ")))


def conversation_chain(tokenizer):
    """`LoadFeeder(chain=...)` for release-freeze conversations with the model's own answers:
    (request, parent's RequestOutput or None) -> the prompt ids `chained_prompt` builds."""

    def tokenize(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def chain(req, parent_out) -> list[int]:
        if parent_out is None:
            return chained_prompt(req, (), (), tokenize)
        return chained_prompt(req, parent_out.prompt_token_ids, parent_out.outputs[0].token_ids, tokenize)

    return chain


def _sorted(reqs):
    return sorted(reqs, key=lambda r: (r.arrival_s, r.conversation_id or "", r.turn, r.request_id))


# ---------------------------------------------------------------------------- scenarios


def release_freeze(
    n: int = 24,
    seed: int = 0,
    *,
    turns: int = 4,
    window_s: float = 20.0,
    prompt_median: float = 120,
    prompt_sigma: float = 0.5,
    prompt_min: int = 30,
    prompt_max: int = 400,
    followup_median: float = 40,
    followup_sigma: float = 0.5,
    context_max: int = 600,
    output_median: float = 48,
    output_sigma: float = 0.6,
    output_min: int = 8,
    output_max: int = 192,
    system_prompt: bool = True,
    tiers=None,
    ignore_eos: bool = True,
) -> list[WorkloadRequest]:
    """``n`` requests: ceil(n / turns) code-review conversations of up to ``turns`` turns, every
    arrival within ``[0, window_s)``, each conversation's turns in order. First-turn prompts are
    ``prompt_*`` words (lognormal, clipped); each later turn appends the placeholder reply and a
    follow-up of ``followup_*`` words. A conversation stops early (fewer turns) rather than exceed
    ``context_max`` words, so requests may number slightly fewer than ``n`` when contexts are capped."""
    check_int("n", n, 1, MAX_REQUESTS)
    check_int("seed", seed, 0, 2**63 - 1)
    check_int("turns", turns, 1, 64)
    _check_num("window_s", window_s, 0, 86_400, lo_open=True)
    _check_lengths("prompt", prompt_median, prompt_sigma, prompt_min, prompt_max, 100_000)
    _check_num("followup_median", followup_median, 1, 100_000)
    _check_num("followup_sigma", followup_sigma, 0, 3)
    check_int("context_max", context_max, 1, 1_000_000)
    if context_max < prompt_max:
        raise ValueError(f"context_max ({context_max}) must be >= prompt_max ({prompt_max})")
    _check_lengths("output", output_median, output_sigma, output_min, output_max, 100_000)
    tiers = _check_tiers(tiers)
    rng = random.Random(seed)
    n_conv = cdiv(n, turns)
    reqs: list[WorkloadRequest] = []
    for c in range(n_conv):
        conv_turns = min(turns, n - c * turns)
        conv_id = f"rf-c{c:04d}"
        tier = _pick_tier(rng, tiers)
        times = sorted(rng.uniform(0, window_s) for _ in range(conv_turns))
        file = rng.choice(FILES)
        first_words = _lognormal_int(rng, prompt_median, prompt_sigma, prompt_min, prompt_max)
        intro = rng.choice(INTROS).format(file=file, pr=f"#{rng.randint(1000, 9999)}")
        head = (f"System: {SYSTEM_PREAMBLE}\n\n" if system_prompt else "") + f"User: {intro}\n"
        question = fill(rng, rng.choice(QUESTIONS))
        budget = max(1, first_words - len(intro.split()) - len(question.split()))
        prompt = head + diff(rng, budget) + "\n" + question
        prompt_words = len(prompt.split())
        parent, prev_tokens = None, 0
        for t in range(conv_turns):
            max_tokens = _lognormal_int(rng, output_median, output_sigma, output_min, output_max)
            if t > 0:
                reply = words_from(rng, REPLY_SENTENCES, max(1, round(0.75 * prev_tokens)), sep=" ")
                follow = fill(rng, rng.choice(FOLLOWUPS))
                extra = _lognormal_int(rng, followup_median, followup_sigma, 1, 100_000)
                more_diff = diff(rng, max(1, extra - len(follow.split())))
                followup = f"\n\nUser: {follow}\n{more_diff}"
                addition = f"{REPLY_CUE}{reply}{followup}"
                if prompt_words + len(addition.split()) > context_max:
                    break  # conversation ends rather than overflow
                prompt = prompt + addition
                prompt_words += len(addition.split())
            rid = f"{conv_id}-t{t + 1}"
            reqs.append(
                WorkloadRequest(
                    rid,
                    round(times[t], 6),
                    max_tokens,
                    prompt=prompt,
                    tier=tier,
                    conversation_id=conv_id,
                    turn=t + 1,
                    ignore_eos=ignore_eos,
                    parent_id=parent,
                    followup=followup if t > 0 else None,
                )
            )
            parent, prev_tokens = rid, max_tokens
    return _sorted(reqs)


def shared_system_prompt(
    n: int = 16,
    seed: int = 0,
    *,
    system_words: int = 300,
    prompt_median: float = 16,
    prompt_sigma: float = 0.4,
    prompt_min: int = 4,
    prompt_max: int = 80,
    output_median: float = 32,
    output_sigma: float = 0.5,
    output_min: int = 4,
    output_max: int = 128,
    arrival_rate: float | None = 2.0,
    tiers=None,
    ignore_eos: bool = True,
) -> list[WorkloadRequest]:
    """``n`` different user questions (``prompt_*`` words) behind one ``system_words``-word system
    prompt; every prompt starts with the same prefix string. Poisson arrivals at ``arrival_rate``
    per second (None: all at once)."""
    check_int("n", n, 1, MAX_REQUESTS)
    check_int("seed", seed, 0, 2**63 - 1)
    check_int("system_words", system_words, 1, 100_000)
    _check_lengths("prompt", prompt_median, prompt_sigma, prompt_min, prompt_max, 100_000)
    _check_lengths("output", output_median, output_sigma, output_min, output_max, 100_000)
    rate = _check_rate(arrival_rate)
    tiers = _check_tiers(tiers)
    rng = random.Random(seed)
    system = words_from(rng, LONG_SYSTEM_SENTENCES, system_words, sep=" ")
    prefix = f"System: {system}\n\nUser: "
    arrivals = _arrivals(rng, n, rate)
    reqs = []
    for i in range(n):
        words = _lognormal_int(rng, prompt_median, prompt_sigma, prompt_min, prompt_max)
        q = words_from(rng, USER_QUESTIONS, words, sep=" ")
        reqs.append(
            WorkloadRequest(
                f"ssp-{i:04d}",
                arrivals[i],
                _lognormal_int(rng, output_median, output_sigma, output_min, output_max),
                prompt=prefix + q + "\nAssistant:",
                tier=_pick_tier(rng, tiers),
                ignore_eos=ignore_eos,
            )
        )
    return _sorted(reqs)


def mixed(
    n: int = 32,
    seed: int = 0,
    *,
    prompt_median: float = 60,
    prompt_sigma: float = 0.9,
    prompt_min: int = 4,
    prompt_max: int = 600,
    output_median: float = 48,
    output_sigma: float = 0.8,
    output_min: int = 4,
    output_max: int = 256,
    arrival_rate: float | None = None,
    tiers=None,
    ignore_eos: bool = True,
) -> list[WorkloadRequest]:
    """``n`` independent requests with lognormal prompt (words) and output (tokens) lengths,
    clipped to ``[*_min, *_max]``; all at once by default, or Poisson at ``arrival_rate``/s."""
    check_int("n", n, 1, MAX_REQUESTS)
    check_int("seed", seed, 0, 2**63 - 1)
    _check_lengths("prompt", prompt_median, prompt_sigma, prompt_min, prompt_max, 100_000)
    _check_lengths("output", output_median, output_sigma, output_min, output_max, 100_000)
    rate = _check_rate(arrival_rate)
    tiers = _check_tiers(tiers)
    rng = random.Random(seed)
    arrivals = _arrivals(rng, n, rate)
    reqs = []
    for i in range(n):
        words = _lognormal_int(rng, prompt_median, prompt_sigma, prompt_min, prompt_max)
        question = fill(rng, rng.choice(QUESTIONS))
        qw = len(question.split())
        if words > qw:
            text = diff(rng, words - qw) + "\n" + question
        else:
            text = words_from(rng, QUESTIONS, words, sep=" ")
        reqs.append(
            WorkloadRequest(
                f"mix-{i:04d}",
                arrivals[i],
                _lognormal_int(rng, output_median, output_sigma, output_min, output_max),
                prompt=text,
                tier=_pick_tier(rng, tiers),
                ignore_eos=ignore_eos,
            )
        )
    return _sorted(reqs)


SCENARIOS = {
    "release-freeze": release_freeze,
    "shared-system-prompt": shared_system_prompt,
    "mixed": mixed,
}


def scenario_params(name: str) -> dict:
    """The tunable parameters of a scenario and their defaults (for forms and docs)."""
    fn = _scenario(name)
    return {p.name: p.default for p in inspect.signature(fn).parameters.values() if p.name not in ("n", "seed")}


def _scenario(name):
    if name not in SCENARIOS:
        raise ValueError(f"scenario must be one of {tuple(SCENARIOS)}, got {name!r}")
    return SCENARIOS[name]


def make_workload(name: str, n: int, seed: int = 0, **params) -> list[WorkloadRequest]:
    """Build scenario ``name`` with ``n`` requests; ValueError naming the field and its limit."""
    fn = _scenario(name)
    allowed = scenario_params(name)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"unknown parameter {unknown[0]!r} for scenario {name!r}; accepted: {', '.join(allowed)}")
    return fn(n, seed, **params)


def summarize(requests) -> dict:
    """Counts and length ranges of a workload, for captions and benchmark headers."""
    reqs = list(requests)
    if not reqs:
        return {"requests": 0}
    words = sorted(r.prompt_words for r in reqs)
    return {
        "requests": len(reqs),
        "conversations": len({r.conversation_id for r in reqs if r.conversation_id}),
        "prompt_words_min": words[0],
        "prompt_words_median": words[len(words) // 2],
        "prompt_words_max": words[-1],
        "max_tokens_total": sum(r.max_tokens for r in reqs),
        "span_s": max(r.arrival_s for r in reqs) - min(r.arrival_s for r in reqs),
    }
