"""The benchmark prompt sets (engine/bench/*, the demo): chat-templated with the model's
tokenizer, seeded, as token ids (or templated strings): W16 (`w16_prompts`), `chat_prompts`,
`filler_ids` for context sweeps, the release-freeze workload as engine steps
(`release_freeze_workload`), `shared_prefix_prompts`, the speculative passage-edit / open-ended
sets (`speculative_sets`), and the KV-quantization long-context and needle prompts. The seeded
scenarios they draw on live in engine/lab/workloads.py. No torch."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from engine.core.inputs import as_ids, chat_ids
from engine.lab.workload_text import DIFF_TEMPLATES, LONG_SYSTEM_SENTENCES, REPLY_SENTENCES, diff, fill
from engine.lab.workloads import MAX_REQUESTS, check_int, release_freeze

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


def w16_prompts(
    tokenizer, n: int = 16, seed: int = 0, min_tokens: int = 30, max_tokens: int = 300, return_token_ids: bool = False
):
    """``n`` chat-templated prompts (one user turn each) whose length after
    ``tokenizer.apply_chat_template(..., add_generation_prompt=True)`` is in ``[min_tokens,
    max_tokens]``; target lengths are drawn log-uniformly, seeded. Returns the templated strings,
    or their token ids with ``return_token_ids=True``."""
    check_int("n", n, 1, MAX_REQUESTS)
    check_int("seed", seed, 0, 2**63 - 1)
    check_int("min_tokens", min_tokens, 1, 1_000_000)
    check_int("max_tokens", max_tokens, 1, 1_000_000)
    if max_tokens < min_tokens:
        raise ValueError(f"max_tokens ({max_tokens}) must be >= min_tokens ({min_tokens})")
    rng = random.Random(seed)

    def template(words: list[str], tokenize: bool):
        msgs = [{"role": "user", "content": " ".join(words)}]
        if tokenize:
            return chat_ids(tokenizer, msgs)
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)  # the text

    overhead = len(template([], True))
    if overhead > max_tokens:
        raise ValueError(f"max_tokens ({max_tokens}) is below the chat template's own length ({overhead} tokens)")
    out = []
    for _ in range(n):
        target = round(math.exp(rng.uniform(math.log(max(min_tokens, overhead + 1)), math.log(max_tokens))))
        target = min(max_tokens, max(min_tokens, target))
        words = rng.choice(_W16_OPENERS).split() + diff(rng, max_tokens + 8).split(" ")  # more words than tokens needed
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
    return _fallback_prompts(tok, n, seed, min_tokens, max_tokens), "engine.lab.prompt_sets.chat_prompts"


def filler_ids(tok, n_tokens: int, seed: int = 0) -> list[int]:
    """n_tokens of plain English-ish text (no chat template), for context-length sweeps."""
    rng = random.Random(seed)
    text = []
    ids: list[int] = []
    while len(ids) < n_tokens:
        text.append(rng.choice(_SENTENCES) + " " + f"The topic is {rng.choice(_TOPICS)}.")
        ids = list(tok(" ".join(text), add_special_tokens=False)["input_ids"])
    return ids[:n_tokens]


# the context cap of the release-freeze comparison (a contiguous slab reserves it per request): the
# engine's default until that became the model's own limit (8192 for the default model); kept so
# the comparison's numbers stay comparable across runs
RELEASE_FREEZE_MAX_LEN = 2048


def release_freeze_workload(tok, quick: bool, seed: int = 0):
    """The release-freeze scenario (engine.workloads.release_freeze: code-review conversations
    growing turn by turn, arriving within a short window), as [(arrival_step, ids, max_tokens)],
    plus max_model_len (RELEASE_FREEZE_MAX_LEN, 2048: the worst case a contiguous slab reserves).
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
    max_len = RELEASE_FREEZE_MAX_LEN
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
_HAYSTACK = LONG_SYSTEM_SENTENCES + REPLY_SENTENCES
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
    check_int("n", n, 1, MAX_REQUESTS)
    check_int("min_tokens", min_tokens, 64, 1_000_000)
    check_int("max_tokens", max_tokens, min_tokens, 1_000_000)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        target = min_tokens + (max_tokens - min_tokens) * i // max(1, n - 1)
        lines = [fill(rng, rng.choice(REPLY_SENTENCES + DIFF_TEMPLATES)) for _ in range(target // 4)]
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
    check_int("n_codes", n_codes, 1, 100)
    check_int("context_tokens", context_tokens, 64, 1_000_000)
    primer = as_ids(tokenizer(_NEEDLE_PRIMER, add_special_tokens=False))
    out = []
    for c in range(n_codes):
        rng = random.Random(seed * 1000 + c)
        code = str(rng.randint(1000, 9999))
        hay = [fill(rng, rng.choice(_HAYSTACK)) for _ in range(context_tokens // 6)]
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


NEEDLE_SWEEP_CONTEXTS = (512, 1024, 2048, 4096)  # the default model's own limit is 8192 tokens
NEEDLE_SWEEP_DEPTH = 0.1  # near the start: the fact lies ~0.9 x the context before the question


def needle_sweep(
    tokenizer, contexts=NEEDLE_SWEEP_CONTEXTS, n_codes: int = 2, depth: float = NEEDLE_SWEEP_DEPTH, seed: int = 0
) -> dict[int, list[NeedlePrompt]]:
    """Long-range recall at growing distance: for each context length, ``n_codes`` needle prompts
    (needle_prompts) with the fact at ``depth``, so the distance from the fact to the question
    grows with the context; {context length: prompts}."""
    out = {}
    for c in contexts:
        check_int("context", c, 64, 1_000_000)
        out[c] = needle_prompts(tokenizer, depths=(depth,), n_codes=n_codes, context_tokens=c, seed=seed)
    return out


def _answer_ids(tokenizer, code: str, primer: list[int]) -> list[int]:
    full = as_ids(tokenizer(_NEEDLE_PRIMER + " " + code, add_special_tokens=False))
    if full[: len(primer)] != primer or len(full) == len(primer):
        raise ValueError("this tokenizer merges the needle's answer into its primer; cannot score the answer")
    return full[len(primer) :]
