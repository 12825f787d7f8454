"""The fixed code-review vocabulary the seeded workloads and the benchmark prompt sets are
synthesized from (plain ASCII, so nothing depends on a model's real answers), and the fillers that
turn it into text: `fill` (one templated line), `words_from` (exactly n words), `diff` (a
unified-diff fragment of exactly n words). Used by engine/lab/workloads.py and engine/lab/prompt_sets.py. No torch."""

from __future__ import annotations

import random

# ---------------------------------------------------------------------------- vocabulary

FILES = (
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
DIFF_TEMPLATES = (
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
INTROS = (
    "Please review this change to {file} before the release freeze.",
    "Can you look at my patch for {file}? It is blocking the release branch.",
    "Here is the diff for {file}; the freeze starts tonight and I want a second pair of eyes.",
    "Reviewing pull request {pr} which touches {file}.",
)
QUESTIONS = (
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
FOLLOWUPS = (
    "Thanks. Following up on that: what about {f} in {file}?",
    "I updated the patch as you suggested. Does {f} still need the guard on {a}?",
    "One more file changed, {file}. Same question for {g}.",
    "CI failed on {file}. Could {a} explain it?",
    "Ok, and if we keep {a} as it is, is {f} still correct?",
)
REPLY_SENTENCES = (
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
SYSTEM_PREAMBLE = (
    "You are the release-branch code reviewer for the platform team. Review diffs for correctness, "
    "concurrency bugs, missing tests and backwards compatibility. Answer concisely, cite the file and "
    "function you mean, and say clearly whether the change can merge before the freeze."
)
LONG_SYSTEM_SENTENCES = (
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
USER_QUESTIONS = (
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


def fill(rng: random.Random, template: str) -> str:
    return template.format(
        file=rng.choice(FILES),
        f=rng.choice(_FUNCS),
        g=rng.choice(_FUNCS),
        a=rng.choice(_IDENTS),
        b=rng.choice(_IDENTS),
        n=rng.randint(1, 500),
        pr=f"#{rng.randint(1000, 9999)}",
    )


def words_from(rng: random.Random, templates, n_words: int, sep: str = "\n") -> str:
    """Exactly ``n_words`` whitespace-separated words, filling lines from ``templates``."""
    lines, count = [], 0
    while count < n_words:
        line = fill(rng, rng.choice(templates))
        words = line.split()
        if len(words) > n_words - count:  # cut the last line to fit exactly
            words = words[: n_words - count]
            line = line[: len(line) - len(line.lstrip())] + " ".join(words)
        lines.append(line)
        count += len(words)
    return sep.join(lines)


def diff(rng: random.Random, n_words: int) -> str:
    """A unified-diff fragment of exactly ``n_words`` words (header and hunk marker included
    when there is room for them)."""
    if n_words < 10:
        return words_from(rng, DIFF_TEMPLATES, n_words)
    header = f"--- a/{rng.choice(FILES)}"  # 2 words
    hunk = f"@@ -{rng.randint(1, 400)},{rng.randint(3, 40)} +{rng.randint(1, 400)},{rng.randint(3, 40)} @@"  # 4 words
    return "\n".join([header, hunk, words_from(rng, DIFF_TEMPLATES, n_words - 6)])
