"""Seeded workload scenarios for the load page, the benchmarks and the soak test. No torch.

Every scenario is a pure function of its parameters and ``seed`` (it uses its own
``random.Random(seed)``, never the global one) and returns ``WorkloadRequest``s sorted by arrival.
Text is synthesized from the fixed code-review vocabulary below (plain ASCII), so no scenario
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

from .inputs import as_ids, chat_ids

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


# ---------------------------------------------------------------------------- vocabulary

_FILES = (
    "src/scheduler/queue.py",
    "src/scheduler/policy.py",
    "src/cache/block_table.py",
    "src/cache/allocator.py",
    "src/cache/prefix_index.py",
    "src/api/handlers.py",
    "src/api/middleware.py",
    "src/auth/session.py",
    "src/auth/tokens.py",
    "src/billing/invoice.py",
    "src/billing/tiers.py",
    "src/storage/blob_client.py",
    "src/storage/retry.py",
    "src/search/ranker.py",
    "src/search/index_writer.py",
    "src/metrics/histogram.py",
    "src/metrics/exporter.py",
    "src/config/loader.py",
    "src/config/schema.py",
    "src/jobs/worker.py",
    "src/jobs/backoff.py",
    "tests/test_queue.py",
    "tests/test_allocator.py",
    "tests/test_handlers.py",
    "tests/test_retry.py",
    "migrations/0042_add_tier_column.sql",
    "web/components/ReviewPanel.tsx",
    "web/hooks/useSession.ts",
    "deploy/values.yaml",
    "docs/release_checklist.md",
)
_IDENTS = (
    "budget",
    "num_blocks",
    "free_list",
    "request_id",
    "timeout_s",
    "retry_count",
    "user_id",
    "session",
    "payload",
    "batch",
    "queue",
    "lock",
    "cursor",
    "offset",
    "limit",
    "tier",
    "token",
    "cache_key",
    "expires_at",
    "max_len",
    "chunk",
    "buffer",
    "result",
    "status",
    "event",
    "ctx",
    "config",
    "client",
    "response",
    "headers",
    "priority",
    "deadline",
    "worker",
    "job",
    "row",
)
_FUNCS = (
    "allocate",
    "release",
    "schedule",
    "admit",
    "evict",
    "flush",
    "retry",
    "refresh_token",
    "load_config",
    "validate",
    "serialize",
    "parse_headers",
    "compute_invoice",
    "rank",
    "enqueue",
    "dequeue",
    "acquire",
    "commit",
    "rollback",
    "render",
    "handle_request",
    "close",
    "reset",
)
_DIFF_TEMPLATES = (
    "+    if {a} > {b}:",
    "+        return {f}({a})",
    "-    {a} = {b} + 1",
    "+    {a} = min({a}, {b})",
    "+    with self.{a}_lock:",
    "-        self.{a}.append({b})",
    "+        self.{a}.extend({b})",
    "+    for {a} in {b}:",
    '+        log.debug("{f} %s", {a})',
    "-    raise ValueError({a})",
    '+    raise TimeoutError(f"{f} exceeded {{{a}}}")',
    "     def {f}(self, {a}, {b}=None):",
    "+    assert {a} is not None",
    "-    # TODO: handle {a}",
    "+    {a} = self.{f}({b}, timeout={n})",
    "     return {a}",
    "+    except KeyError:",
    "+        {a} = {{}}",
    "-    time.sleep({n})",
    "+    await self.{f}({a})",
)
_INTROS = (
    "Please review this change to {file} before the release freeze.",
    "Can you look at my patch for {file}? It is blocking the release branch.",
    "Here is the diff for {file}; the freeze starts tonight and I want a second pair of eyes.",
    "Reviewing pull request {pr} which touches {file}.",
)
_QUESTIONS = (
    "Is there a race between {f} and {g} when {a} is shared?",
    "Why does {f} hold the lock while it calls {g}?",
    "Could {a} be None here, and what happens to {b} then?",
    "Does this change the behaviour of {f} for existing callers?",
    "Should {a} be validated before it reaches {f}?",
    "What is the worst case cost of {f} when {a} grows large?",
    "Is the retry in {f} safe if {g} is not idempotent?",
    "Do we need a migration for the new {a} field?",
    "Which test covers the path where {b} is empty?",
    "Would you split {f} into smaller functions before merging?",
)
_FOLLOWUPS = (
    "Thanks. Following up on that: what about {f} in {file}?",
    "I updated the patch as you suggested. Does {f} still need the guard on {a}?",
    "One more file changed, {file}. Same question for {g}.",
    "CI failed on {file}. Could {a} explain it?",
    "Ok, and if we keep {a} as it is, is {f} still correct?",
)
_REPLY_SENTENCES = (
    "The change to {f} looks correct for the common path.",
    "I would keep {a} local to {f} so the lock is held for less time.",
    "There is an edge case when {b} is empty: {f} returns before {a} is set.",
    "Consider adding a test that calls {f} twice with the same {a}.",
    "The retry loop should cap {a} and back off between attempts.",
    "This does not look thread safe because {g} mutates {b} without the lock.",
    "The migration is fine but the default for {a} should be explicit.",
    "I would rename {a} to make its unit obvious, for example {a}_s.",
    "Overall this is close; fix the {b} check and it is ready to merge.",
    "Callers of {f} in {file} rely on the old behaviour, so document the change.",
)
_SYSTEM_PREAMBLE = (
    "You are the release-branch code reviewer for the platform team. Review diffs for correctness, "
    "concurrency bugs, missing tests and backwards compatibility. Answer concisely, cite the file and "
    "function you mean, and say clearly whether the change can merge before the freeze."
)
_LONG_SYSTEM_SENTENCES = (
    "You are the internal engineering assistant for the platform team.",
    "Answer questions about the code base, the deployment process and the on-call runbooks.",
    "When you mention a file, give its full path, for example {file}.",
    "Prefer short answers with a code sample when the question is about {f}.",
    "Never invent configuration keys; the schema lives in src/config/schema.py.",
    "Releases are cut every second Tuesday and the freeze starts two days before.",
    "Database migrations must be reversible and reviewed by two people.",
    "Rate limits are enforced per tier: free, pro and enterprise.",
    "Retries use exponential backoff with jitter, capped at five attempts.",
    "Metrics are exported as histograms; latency is reported at p50, p90 and p99.",
    "If a question is ambiguous, ask which service the user means.",
    "Security issues go to the security channel, never into a public ticket.",
)
_USER_QUESTIONS = (
    "How do I add a new field to {file}?",
    "What does {f} return when {a} is missing?",
    "Where is the retry policy for {g} configured?",
    "Why is {f} slow when the {b} is large?",
    "Which tier limits apply to {a} requests?",
    "Can I call {f} from a background job?",
    "How do I run the tests for {file} locally?",
    "What is the rollback procedure if {f} fails after the deploy?",
    "Is {a} safe to log, or is it sensitive?",
    "Who owns {file} and how do I request a review?",
)


def _fill(rng: random.Random, template: str) -> str:
    return template.format(
        file=rng.choice(_FILES),
        f=rng.choice(_FUNCS),
        g=rng.choice(_FUNCS),
        a=rng.choice(_IDENTS),
        b=rng.choice(_IDENTS),
        n=rng.randint(1, 500),
        pr=f"#{rng.randint(1000, 9999)}",
    )


def _words_from(rng: random.Random, templates, n_words: int, sep: str = "\n") -> str:
    """Exactly ``n_words`` whitespace-separated words, filling lines from ``templates``."""
    lines, count = [], 0
    while count < n_words:
        line = _fill(rng, rng.choice(templates))
        words = line.split()
        if len(words) > n_words - count:  # cut the last line to fit exactly
            words = words[: n_words - count]
            line = line[: len(line) - len(line.lstrip())] + " ".join(words)
        lines.append(line)
        count += len(words)
    return sep.join(lines)


def _diff(rng: random.Random, n_words: int) -> str:
    """A unified-diff fragment of exactly ``n_words`` words (header and hunk marker included
    when there is room for them)."""
    if n_words < 10:
        return _words_from(rng, _DIFF_TEMPLATES, n_words)
    header = f"--- a/{rng.choice(_FILES)}"  # 2 words
    hunk = f"@@ -{rng.randint(1, 400)},{rng.randint(3, 40)} +{rng.randint(1, 400)},{rng.randint(3, 40)} @@"  # 4 words
    return "\n".join([header, hunk, _words_from(rng, _DIFF_TEMPLATES, n_words - 6)])


# ---------------------------------------------------------------------------- validation


def _check_int(name, v, lo, hi):
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
    _check_int(f"{prefix}_min", lo, 1, limit)
    _check_int(f"{prefix}_max", hi, 1, limit)
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
    _check_int("n", n, 1, MAX_REQUESTS)
    _check_int("seed", seed, 0, 2**63 - 1)
    _check_int("turns", turns, 1, 64)
    _check_num("window_s", window_s, 0, 86_400, lo_open=True)
    _check_lengths("prompt", prompt_median, prompt_sigma, prompt_min, prompt_max, 100_000)
    _check_num("followup_median", followup_median, 1, 100_000)
    _check_num("followup_sigma", followup_sigma, 0, 3)
    _check_int("context_max", context_max, 1, 1_000_000)
    if context_max < prompt_max:
        raise ValueError(f"context_max ({context_max}) must be >= prompt_max ({prompt_max})")
    _check_lengths("output", output_median, output_sigma, output_min, output_max, 100_000)
    tiers = _check_tiers(tiers)
    rng = random.Random(seed)
    n_conv = -(-n // turns)
    reqs: list[WorkloadRequest] = []
    for c in range(n_conv):
        conv_turns = min(turns, n - c * turns)
        conv_id = f"rf-c{c:04d}"
        tier = _pick_tier(rng, tiers)
        times = sorted(rng.uniform(0, window_s) for _ in range(conv_turns))
        file = rng.choice(_FILES)
        first_words = _lognormal_int(rng, prompt_median, prompt_sigma, prompt_min, prompt_max)
        intro = rng.choice(_INTROS).format(file=file, pr=f"#{rng.randint(1000, 9999)}")
        head = (f"System: {_SYSTEM_PREAMBLE}\n\n" if system_prompt else "") + f"User: {intro}\n"
        question = _fill(rng, rng.choice(_QUESTIONS))
        budget = max(1, first_words - len(intro.split()) - len(question.split()))
        prompt = head + _diff(rng, budget) + "\n" + question
        prompt_words = len(prompt.split())
        parent, prev_tokens = None, 0
        for t in range(conv_turns):
            max_tokens = _lognormal_int(rng, output_median, output_sigma, output_min, output_max)
            if t > 0:
                reply = _words_from(rng, _REPLY_SENTENCES, max(1, round(0.75 * prev_tokens)), sep=" ")
                follow = _fill(rng, rng.choice(_FOLLOWUPS))
                extra = _lognormal_int(rng, followup_median, followup_sigma, 1, 100_000)
                more_diff = _diff(rng, max(1, extra - len(follow.split())))
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
    _check_int("n", n, 1, MAX_REQUESTS)
    _check_int("seed", seed, 0, 2**63 - 1)
    _check_int("system_words", system_words, 1, 100_000)
    _check_lengths("prompt", prompt_median, prompt_sigma, prompt_min, prompt_max, 100_000)
    _check_lengths("output", output_median, output_sigma, output_min, output_max, 100_000)
    rate = _check_rate(arrival_rate)
    tiers = _check_tiers(tiers)
    rng = random.Random(seed)
    system = _words_from(rng, _LONG_SYSTEM_SENTENCES, system_words, sep=" ")
    prefix = f"System: {system}\n\nUser: "
    arrivals = _arrivals(rng, n, rate)
    reqs = []
    for i in range(n):
        words = _lognormal_int(rng, prompt_median, prompt_sigma, prompt_min, prompt_max)
        q = _words_from(rng, _USER_QUESTIONS, words, sep=" ")
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
    _check_int("n", n, 1, MAX_REQUESTS)
    _check_int("seed", seed, 0, 2**63 - 1)
    _check_lengths("prompt", prompt_median, prompt_sigma, prompt_min, prompt_max, 100_000)
    _check_lengths("output", output_median, output_sigma, output_min, output_max, 100_000)
    rate = _check_rate(arrival_rate)
    tiers = _check_tiers(tiers)
    rng = random.Random(seed)
    arrivals = _arrivals(rng, n, rate)
    reqs = []
    for i in range(n):
        words = _lognormal_int(rng, prompt_median, prompt_sigma, prompt_min, prompt_max)
        question = _fill(rng, rng.choice(_QUESTIONS))
        qw = len(question.split())
        if words > qw:
            text = _diff(rng, words - qw) + "\n" + question
        else:
            text = _words_from(rng, _QUESTIONS, words, sep=" ")
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


# ---------------------------------------------------------------------------- throughput prompts

_W16_OPENERS = (
    "Explain in plain words what this function does and how it could fail:",
    "Summarize the following code review notes for the release manager:",
    "Write a short commit message for this change:",
    "List the risks of merging this patch before the freeze:",
    "Suggest a unit test for the following diff:",
    "Rewrite this review comment so it is polite and specific:",
    "Which of these lines would you change first, and why?",
    "Describe the bug this patch fixes, in two sentences:",
)


_ids = as_ids


def w16_prompts(
    tokenizer, n: int = 16, seed: int = 0, min_tokens: int = 30, max_tokens: int = 300, return_token_ids: bool = False
):
    """``n`` chat-templated prompts (one user turn each) whose length after
    ``tokenizer.apply_chat_template(..., add_generation_prompt=True)`` is in ``[min_tokens,
    max_tokens]``; target lengths are drawn log-uniformly, seeded. Returns the templated strings,
    or their token ids with ``return_token_ids=True``."""
    _check_int("n", n, 1, MAX_REQUESTS)
    _check_int("seed", seed, 0, 2**63 - 1)
    _check_int("min_tokens", min_tokens, 1, 1_000_000)
    _check_int("max_tokens", max_tokens, 1, 1_000_000)
    if max_tokens < min_tokens:
        raise ValueError(f"max_tokens ({max_tokens}) must be >= min_tokens ({min_tokens})")
    rng = random.Random(seed)

    def template(words: list[str], tokenize: bool):
        msgs = [{"role": "user", "content": " ".join(words)}]
        out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=tokenize)
        return _ids(out) if tokenize else out

    overhead = len(template([], True))
    if overhead > max_tokens:
        raise ValueError(f"max_tokens ({max_tokens}) is below the chat template's own length ({overhead} tokens)")
    out = []
    for _ in range(n):
        target = round(math.exp(rng.uniform(math.log(max(min_tokens, overhead + 1)), math.log(max_tokens))))
        target = min(max_tokens, max(min_tokens, target))
        words = rng.choice(_W16_OPENERS).split() + _diff(rng, max_tokens + 8).split(
            " "
        )  # more words than tokens needed
        lo, hi = 0, len(words)  # largest k with len(k words) <= target
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(template(words[:mid], True)) <= target:
                lo = mid
            else:
                hi = mid - 1
        k = lo
        ids = template(words[:k], True)
        while len(ids) < min_tokens and k < len(words):  # a long last word skipped the range
            k += 1
            ids = template(words[:k], True)
        if not min_tokens <= len(ids) <= max_tokens:
            raise ValueError(
                f"could not build a prompt of {min_tokens}..{max_tokens} tokens with this "
                f"tokenizer (got {len(ids)}); widen the range"
            )
        out.append(ids if return_token_ids else template(words[:k], False))
    return out


# ---------------------------------------------------------------- benchmark prompt sets (token ids)
# The bench suites' prompts: chat-templated with the model's tokenizer `tok`, seeded.

_TOPICS = [
    "how tides work",
    "the history of the printing press",
    "why bread dough rises",
    "how a bicycle stays upright",
    "what makes a good unit test",
    "how vaccines train the immune system",
    "the water cycle",
    "how compilers turn source code into machine code",
    "why the sky is blue",
    "how bees communicate",
    "the causes of inflation",
    "how a hash table works",
    "the life cycle of a star",
    "how to plan a vegetable garden",
    "why cats purr",
    "how noise-cancelling headphones work",
    "the rules of chess openings",
    "how glaciers shape valleys",
    "what a database index does",
    "how to brew good coffee",
]
_SENTENCES = [
    "Please explain it step by step and keep the explanation concrete.",
    "I am preparing a short talk for colleagues who are curious but not experts.",
    "Include one everyday example that makes the idea easy to remember.",
    "Mention a common misconception and say why it is wrong.",
    "I read a few articles about this last week and some of them disagreed with each other.",
    "If there are numbers involved, give rough orders of magnitude rather than exact figures.",
    "My notes so far say that the basic mechanism is simple but the details are subtle.",
    "A friend told me the standard textbook account leaves out an important part of the story.",
    "It would help to know which parts are well established and which are still debated.",
    "Please also suggest what I could read next if I want to go deeper.",
    "Assume the audience has a high-school background in science and mathematics.",
    "Keep the tone friendly and avoid unnecessary jargon where a plain word will do.",
]


def _templated_ids(tok, text: str) -> list[int]:
    return chat_ids(tok, [{"role": "user", "content": text}])


def _fallback_prompts(tok, n: int, seed: int, min_tokens: int, max_tokens: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        target = rng.randint(min_tokens, max_tokens)
        words = [f"Tell me about {rng.choice(_TOPICS)}."]
        pool = _SENTENCES[:]
        while len(_templated_ids(tok, " ".join(words))) < target:
            if not pool:
                pool = _SENTENCES[:]
            words.append(pool.pop(rng.randrange(len(pool))))
        words = " ".join(words).split()
        lo, hi = 1, len(words)  # longest word prefix whose templated length is <= target
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(_templated_ids(tok, " ".join(words[:mid]))) <= target:
                lo = mid
            else:
                hi = mid - 1
        out.append(_templated_ids(tok, " ".join(words[:lo])))
    return out


def chat_prompts(
    tok, n: int, seed: int = 0, min_tokens: int = 30, max_tokens: int = 300
) -> tuple[list[list[int]], str]:
    """n chat-templated prompts of min..max tokens as token ids, and where they came from."""
    return _fallback_prompts(tok, n, seed, min_tokens, max_tokens), "engine.workloads.chat_prompts"


def filler_ids(tok, n_tokens: int, seed: int = 0) -> list[int]:
    """n_tokens of plain English-ish text (no chat template), for context-length sweeps."""
    rng = random.Random(seed)
    text = []
    ids: list[int] = []
    while len(ids) < n_tokens:
        text.append(rng.choice(_SENTENCES) + " " + f"The topic is {rng.choice(_TOPICS)}.")
        ids = list(tok(" ".join(text), add_special_tokens=False)["input_ids"])
    return ids[:n_tokens]


def release_freeze_workload(tok, quick: bool, seed: int = 0):
    """The release-freeze scenario (engine.workloads.release_freeze: code-review conversations
    growing turn by turn, arriving within a short window), as [(arrival_step, ids, max_tokens)],
    plus max_model_len (the engine's default, 2048: the worst case a contiguous slab reserves).
    Arrivals map to engine steps (2 steps per simulated second) so that both
    allocators see exactly the same arrival pattern."""
    if quick:
        reqs = release_freeze(
            n=12,
            seed=seed,
            turns=3,
            window_s=10.0,
            prompt_median=80,
            prompt_max=200,
            context_max=360,
            output_median=32,
            output_max=64,
        )
    else:
        reqs = release_freeze(n=32, seed=seed, turns=4, window_s=20.0)
    from .config import EngineConfig

    max_len = EngineConfig().max_model_len  # the engine's default context cap: what a slab reserves
    out = []
    for r in reqs:
        ids = list(r.prompt_token_ids) if r.prompt_token_ids else list(tok(r.prompt)["input_ids"])
        ids = ids[: max_len - r.max_tokens - 1]
        out.append((int(r.arrival_s * 2), ids, int(r.max_tokens)))
    return out, max_len


_SUPPORT_QUESTIONS = [
    "How do I reset my password?",
    "Can I change the billing date of my plan?",
    "What happens to my files if I cancel?",
    "How do I add a teammate to my workspace?",
    "Why was my payment declined?",
    "Is there a student discount?",
    "How do I export my data as CSV?",
    "Can two people edit the same document at once?",
    "Where can I download invoices?",
    "How do I turn on two-factor authentication?",
    "What are the API rate limits?",
    "How long are deleted items kept?",
    "Can I move my account to another region?",
    "How do I report a security issue?",
    "Do you offer an on-premises version?",
    "How do I close my account?",
]


def shared_prefix_prompts(tok, n: int, prefix_tokens: int = 1000, seed: int = 0):
    """A ~prefix_tokens system prompt shared by n chat prompts that differ only in the question."""
    rng = random.Random(seed)
    sents = []

    def ids_for(k, q):
        system = "You are the support assistant of a software company. Policies follow. " + " ".join(sents[:k])
        return chat_ids(tok, [{"role": "system", "content": system}, {"role": "user", "content": q}])

    while len(ids_for(len(sents), "")) < prefix_tokens:
        sents.append(f"Policy {len(sents) + 1}: " + rng.choice(_SENTENCES) + f" It concerns {rng.choice(_TOPICS)}.")
    prompts = [ids_for(len(sents), _SUPPORT_QUESTIONS[i % len(_SUPPORT_QUESTIONS)]) for i in range(n)]
    shared = 0
    while all(p[shared] == prompts[0][shared] for p in prompts) and shared < min(map(len, prompts)) - 1:
        shared += 1
    return prompts, shared


_PASSAGES = [
    (
        "Mara",
        "Jonas",
        "Mara opened the workshop at seven, as she did every morning. She swept the sawdust from the "
        "bench, checked the glue pots and set out the chisels in order of size. Mara liked the hour before the "
        "apprentices arrived, when the only sound was the kettle and the radio murmuring about the weather. By eight "
        "the first customer was at the door with a chair that had lost a leg, and Mara promised it would be ready by "
        "Friday.",
    ),
    (
        "the river",
        "the canal",
        "In spring the river rose quickly. The old path along the river flooded first, then "
        "the meadow, and for a week the town watched the river creep toward the bakery. Children dropped sticks from "
        "the bridge to see how fast the river ran. When the water finally fell, the river left a line of mud on every "
        "wall it had touched, and the town spent a month scrubbing it away.",
    ),
    (
        "server",
        "cluster",
        "The server restarted at midnight after the update. For ten minutes the server refused "
        "connections while it rebuilt its indexes, and the on-call engineer watched the dashboard with a cup of cold "
        "tea. Once the server came back, latency was lower than before, and the engineer wrote a short note explaining "
        "what the update had changed and why the server had needed the restart.",
    ),
    (
        "Tuesday",
        "Thursday",
        "The committee meets every Tuesday in the small room on the second floor. On Tuesday "
        "mornings the agenda is sent out at nine, and members are asked to read the minutes of the previous Tuesday "
        "before they arrive. If a Tuesday falls on a holiday, the meeting moves to the following day, and the "
        "secretary sends a reminder so that nobody turns up to an empty room.",
    ),
]
_OPEN = [
    "Write a short poem about the first snow of winter.",
    "Give me three ideas for a weekend project with kids.",
    "Why do people enjoy scary movies?",
    "Describe an imaginary city built on the back of a giant turtle.",
]


def speculative_sets(tok):
    def ids(text):
        return chat_ids(tok, [{"role": "user", "content": text}])

    edit = [
        ids(
            f"Rewrite the passage below, replacing every '{a}' with '{b}'. Change nothing else and output only "
            f"the rewritten passage.\n\n{p}"
        )
        for a, b, p in _PASSAGES
    ]
    return {"passage_edit": edit, "open_ended": [ids(t) for t in _OPEN]}


# ---------------------------------------------------------------------------- KV-cache quantization set

NEEDLE_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
_HAYSTACK = _LONG_SYSTEM_SENTENCES + _REPLY_SENTENCES
_NEEDLE = "Note for the on-call engineer: the access code for the staging cluster is {code}."
_NEEDLE_QUESTION = "What is the access code for the staging cluster? Answer with the number only."
_LONG_ASK = "Summarize the open review issues above in three short bullet points."


_NEEDLE_PRIMER = "The access code for the staging cluster is"


@dataclass(slots=True)
class NeedlePrompt:
    prompt_token_ids: list[int]  # chat prompt + the assistant's primed answer start (_NEEDLE_PRIMER)
    answer_token_ids: list[int]  # the code's tokens as they continue the primer
    answer: str  # the planted code, e.g. "4817"
    depth: float  # where the fact sits, as a fraction of the context lines
    context_tokens: int  # prompt length in tokens (primer included)


def _chat_ids(tokenizer, text: str) -> list[int]:
    return chat_ids(tokenizer, [{"role": "user", "content": text}])


def _lines_to_fit(tokenizer, lines: list[str], target: int, build) -> list[int]:
    """The longest prefix of ``lines`` whose ``build(prefix)`` prompt is <= target tokens."""
    lo, hi = 1, len(lines)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(build(lines[:mid])) <= target:
            lo = mid
        else:
            hi = mid - 1
    return build(lines[:lo])


def long_context_prompts(
    tokenizer, n: int = 4, seed: int = 0, min_tokens: int = 1024, max_tokens: int = 2048
) -> list[list[int]]:
    """``n`` chat prompts of ``min_tokens``-``max_tokens`` tokens (targets evenly spread): a long
    code-review thread (review comments and diff lines) followed by a request to summarize it."""
    _check_int("n", n, 1, MAX_REQUESTS)
    _check_int("min_tokens", min_tokens, 64, 1_000_000)
    _check_int("max_tokens", max_tokens, min_tokens, 1_000_000)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        target = min_tokens + (max_tokens - min_tokens) * i // max(1, n - 1)
        lines = [_fill(rng, rng.choice(_REPLY_SENTENCES + _DIFF_TEMPLATES)) for _ in range(target // 4)]
        out.append(
            _lines_to_fit(
                tokenizer,
                lines,
                target,
                lambda ls: _chat_ids(tokenizer, "Review thread:\n" + "\n".join(ls) + "\n\n" + _LONG_ASK),
            )
        )
    return out


def needle_prompts(
    tokenizer, depths=NEEDLE_DEPTHS, n_codes: int = 2, context_tokens: int = 1536, seed: int = 0
) -> list[NeedlePrompt]:
    """Needle-in-a-haystack prompts: up to ``context_tokens`` of assistant-policy and review
    sentences with one fact (a 4-digit access code) planted at each depth, a question asking for
    it, and the start of the assistant's answer ("The access code ... is"), so the next tokens
    are the code itself: ``answer_token_ids``. ``n_codes`` different codes (and haystacks) per depth."""
    _check_int("n_codes", n_codes, 1, 100)
    _check_int("context_tokens", context_tokens, 64, 1_000_000)
    primer = _ids(tokenizer(_NEEDLE_PRIMER, add_special_tokens=False))
    out = []
    for c in range(n_codes):
        rng = random.Random(seed * 1000 + c)
        code = str(rng.randint(1000, 9999))
        hay = [_fill(rng, rng.choice(_HAYSTACK)) for _ in range(context_tokens // 6)]
        for depth in depths:
            if not 0 <= depth <= 1:
                raise ValueError(f"needle depth must be in [0, 1], got {depth!r}")

            def build(ls, depth=depth, code=code):
                k = round(depth * len(ls))
                text = "\n".join(ls[:k] + [_NEEDLE.format(code=code)] + ls[k:])
                return _chat_ids(tokenizer, text + "\n\n" + _NEEDLE_QUESTION)

            ids = _lines_to_fit(tokenizer, hay, context_tokens - len(primer) - 4, build) + primer
            out.append(NeedlePrompt(ids, _answer_ids(tokenizer, code, primer), code, depth, len(ids)))
    return out


def _answer_ids(tokenizer, code: str, primer: list[int]) -> list[int]:
    full = _ids(tokenizer(_NEEDLE_PRIMER + " " + code, add_special_tokens=False))
    if full[: len(primer)] != primer or len(full) == len(primer):
        raise ValueError("this tokenizer merges the needle's answer into its primer; cannot score the answer")
    return full[len(primer) :]
