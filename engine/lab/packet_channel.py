"""Seed 002's packet-size side channel, measured on the wire.

kvscope's server streams an answer one chunk per token, so over TLS each chunk is one encrypted
record whose length is the token's text length plus a constant. The lab serves the engine over
TLS on 127.0.0.1 (a certificate made at run time), puts `tls_relay.TlsRelay` between a victim's
client and the server, and gives the attacker only what the relay recorded: record lengths and
times. The victim asks one of N known questions; the attacker knows the N possible answers (the
model is public: it can ask them itself) and picks the one whose token lengths fit the records.

The attack, the same under every defence:
- calibration: one request of the attacker's own, no defence, its answer known: the constant a
  content record adds to its text (`k`) and what the last one adds more (`k_last`);
- matching: for each candidate, the cheapest way to cut its tokens into consecutive groups, one
  per record, a record costing |its length - k - the group's text bytes| (`align_cost`; groups
  absorb chunks that carried several tokens). The lowest cost wins; chance is 1 / N;
- token lengths: each record read as one token of length (record - k) (`recover_lengths`), scored
  per position against the truth; chance is guessing the vocabulary's most common length every
  time. A recovered length narrows the token to the vocabulary's tokens of that length: the bits
  that leaves (`vocab_bits`).

Defences (stream_options, engine/serve/render.py): "obfuscation" (OpenAI's field, random padding
up to a drawn length), "coalesce" (several tokens per chunk), "fixed" (every chunk padded to a
bucket of bytes). Each is measured with the same attack, with its cost in bytes and time.
"""

from __future__ import annotations

import json
import math
import random
import ssl
import tempfile
import uuid
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from engine.lab import tls_relay

MAX_TRIALS = 200
MAX_NEW_TOKENS = 64
MAX_QUESTION_CHARS = 2000
MAX_CANDIDATES = 64
MAX_GROUP = 8  # tokens one record may carry in the alignment (coalescing defences up to this)
COALESCE_TOKENS = 4
PAD_BUCKET = 512  # bytes: above any chunk this server sends for one or a few tokens
DEFENCES = {
    "none": ({"include_obfuscation": False}, "no defence"),
    "obfuscation": ({"include_obfuscation": True}, "obfuscation field (random padding)"),
    "coalesce": (
        {"include_obfuscation": False, "coalesce_tokens": COALESCE_TOKENS},
        f"{COALESCE_TOKENS} tokens per chunk",
    ),
    "fixed": ({"include_obfuscation": False, "pad_chunks_to": PAD_BUCKET}, f"chunks padded to {PAD_BUCKET} B"),
}
QUESTIONS = (
    "What is the capital of France?",
    "How do I boil an egg?",
    "Name three primary colors.",
    "Why is the sky blue?",
    "What does a compiler do?",
    "Give me a tip for better sleep.",
    "How many legs does a spider have?",
    "What is a prime number?",
    "Suggest a name for a cat.",
    "What causes the seasons?",
    "How do vaccines work?",
    "What is the tallest mountain?",
    "Explain what a KV cache is.",
    "Write a haiku about rain.",
    "What is photosynthesis?",
    "How far away is the Moon?",
)
LEAD_RECORDS = 2  # a chat stream's first records: the HTTP head, the role chunk
TRAIL_RECORDS = 2  # and its last: `data: [DONE]`, the chunked-encoding terminator


# ------------------------------------------------------------------ the attack (pure functions)
def text_bytes(text: str) -> int:
    """What `text` adds to a chunk on the wire: its length inside a JSON string (ASCII escapes)."""
    return len(json.dumps(text)) - 2


def token_text_sizes(tokenizer, ids: list[int]) -> list[int]:
    """Per token of an answer, the bytes its text adds to the stream: the answer decoded up to it,
    an incomplete UTF-8 sequence held back as the server does (engine/serve/render.Delta)."""
    sizes, sent = [], ""
    for i in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:i], skip_special_tokens=True)
        if i < len(ids):
            text = text.rstrip("\ufffd")
        new = text[len(sent) :] if len(text) > len(sent) else ""
        sent = sent + new if text.startswith(sent) else text
        sizes.append(text_bytes(new))
    return sizes


def content_records(lengths: list[int]) -> list[int]:
    """The records that carry the answer: the stream's records less its head and tail."""
    return lengths[LEAD_RECORDS : len(lengths) - TRAIL_RECORDS] if len(lengths) > LEAD_RECORDS + TRAIL_RECORDS else []


def calibrate(records: list[int], sizes: list[int]) -> tuple[int, int] | None:
    """(k, k_last) from a stream whose token sizes are known and whose records each carried one
    token; None when the counts differ (a chunk carried two tokens: calibrate again)."""
    if len(records) != len(sizes) or len(records) < 2:
        return None
    diffs = Counter(r - s for r, s in zip(records[:-1], sizes[:-1]))
    k = diffs.most_common(1)[0][0]
    return k, records[-1] - sizes[-1] - k


def align_cost(records: list[int], sizes: list[int], k: int, k_last: int, max_group: int = MAX_GROUP) -> float:
    """The least total |record - k - group bytes| over every cut of `sizes` into len(records)
    consecutive non-empty groups of at most max_group tokens (the last record adds k_last);
    infinity when no cut fits."""
    m, n = len(records), len(sizes)
    if m == 0 or n < m or n > m * max_group:
        return math.inf
    pre = [0]
    for s in sizes:
        pre.append(pre[-1] + s)
    inf = math.inf
    prev = [0.0] + [inf] * n  # prev[i]: records so far cover tokens [0, i)
    for j, r in enumerate(records):
        extra = k + (k_last if j == m - 1 else 0)
        cur = [inf] * (n + 1)
        for i in range(j + 1, n + 1):
            best = inf
            for a in range(max(j, i - max_group), i):
                if prev[a] < inf:
                    c = prev[a] + abs(r - extra - (pre[i] - pre[a]))
                    if c < best:
                        best = c
            cur[i] = best
        prev = cur
    return prev[n]


def best_match(records: list[int], candidates: list[list[int]], k: int, k_last: int, rng: random.Random) -> int:
    """The candidate (index) whose token sizes fit the records best; ties broken by `rng`."""
    costs = [align_cost(records, c, k, k_last) for c in candidates]
    low = min(costs)
    return rng.choice([i for i, c in enumerate(costs) if c == low])


def recover_lengths(records: list[int], k: int, k_last: int) -> list[int]:
    """Each record read as one token: its text's bytes."""
    return [r - k - (k_last if j == len(records) - 1 else 0) for j, r in enumerate(records)]


def length_hits(guess: list[int], sizes: list[int]) -> int:
    return sum(1 for g, s in zip(guess, sizes) if g == s)


@lru_cache(maxsize=4)
def _vocab_sizes(tokenizer) -> tuple[int, ...]:
    return tuple(text_bytes(tokenizer.decode([i])) for i in range(len(tokenizer)))


def vocab_length_counts(tokenizer) -> Counter:
    """How many vocabulary tokens have each text size (bytes in a JSON string)."""
    return Counter(_vocab_sizes(tokenizer))


def vocab_bits(size: int, counts: Counter) -> float:
    """Bits a token's recovered size tells about it: log2(vocabulary / tokens of that size)."""
    total = sum(counts.values())
    return math.log2(total / counts[size]) if counts.get(size) else 0.0


# ------------------------------------------------------------------ the measurement
@dataclass(frozen=True, slots=True)
class Trial:
    defence: str
    round: int
    truth: int  # the question the victim asked
    guess: int  # the attacker's pick
    records: int  # content records seen
    tokens: int
    lengths_hit: int  # positions whose token size the attacker read right
    chance_hits: int  # positions a constant guess of the vocabulary's commonest size gets right
    bits: float  # summed over the positions read right
    bytes: int  # the response's bytes on the wire (record headers included)
    first_s: float  # request sent -> first content record
    total_s: float  # request sent -> last record
    answer_matches: bool  # the streamed text is the candidate's (sampling reproduced)
    record_lengths: tuple[int, ...] = ()  # the content records the observer saw

    @property
    def correct(self) -> bool:
        return self.guess == self.truth


@dataclass(frozen=True, slots=True)
class DefenceSummary:
    defence: str
    label: str
    trials: int
    accuracy: float
    chance: float
    length_accuracy: float
    length_chance: float
    bits_per_token: float
    bytes_per_answer: float
    first_s: float  # median
    total_s: float  # median


@dataclass(frozen=True, slots=True)
class PacketResult:
    trials: tuple[Trial, ...]
    candidates: int
    new_tokens: int
    k: int
    k_last: int
    cipher: str
    model: str
    questions: tuple[str, ...]
    candidate_sizes: tuple[tuple[int, ...], ...] = ()  # each candidate's token text sizes

    def summaries(self) -> list[DefenceSummary]:
        return summarize(self.trials, self.candidates)


def summarize(trials, candidates: int) -> list[DefenceSummary]:
    out = []
    for d, (_, label) in DEFENCES.items():
        ts = [t for t in trials if t.defence == d]
        if not ts:
            continue
        toks = sum(t.tokens for t in ts) or 1
        hits = sum(t.lengths_hit for t in ts)
        out.append(
            DefenceSummary(
                d,
                label,
                len(ts),
                sum(t.correct for t in ts) / len(ts),
                1 / candidates,
                hits / toks,
                sum(t.chance_hits for t in ts) / toks,
                sum(t.bits for t in ts) / toks,
                sum(t.bytes for t in ts) / len(ts),
                _median([t.first_s for t in ts]),
                _median([t.total_s for t in ts]),
            )
        )
    return out


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return (xs[n // 2] + xs[(n - 1) // 2]) / 2 if n else float("nan")


def stream_answer(client, body: dict) -> tuple[str, str]:
    """Stream one chat answer (the victim's client): (its text, the TLS cipher suite)."""
    text = []
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"the server answered {r.status_code}: {r.text[:300]}")
        ns = r.extensions.get("network_stream")
        ssl_obj = ns.get_extra_info("ssl_object") if ns is not None else None
        cipher = ssl_obj.cipher()[0] if ssl_obj is not None else "?"
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])
                for c in ch.get("choices", []):
                    text.append(c.get("delta", {}).get("content") or "")
    return "".join(text), cipher


def _response(conn) -> tuple[list, float]:
    """The server's records after the request (the last client record), and the request's time."""
    recs = [r for r in conn.records if r.content_type == tls_relay.APPLICATION_DATA]
    c2s = [r for r in recs if r.direction == "c2s"]
    if not c2s:
        return [], 0.0
    last = c2s[-1]
    return [r for r in recs if r.direction == "s2c" and r.seq > last.seq], last.t


def check_args(trials: int, candidates: int, new_tokens: int, defences) -> None:
    if not isinstance(trials, int) or not 1 <= trials <= MAX_TRIALS:
        raise ValueError(f"trials must be an integer in [1, {MAX_TRIALS}], got {trials!r}")
    if not isinstance(candidates, int) or not 2 <= candidates <= MAX_CANDIDATES:
        raise ValueError(f"candidates must be an integer in [2, {MAX_CANDIDATES}], got {candidates!r}")
    if not isinstance(new_tokens, int) or not 2 <= new_tokens <= MAX_NEW_TOKENS:
        raise ValueError(f"new_tokens must be an integer in [2, {MAX_NEW_TOKENS}], got {new_tokens!r}")
    bad = [d for d in defences if d not in DEFENCES]
    if bad or not defences:
        raise ValueError(f"defences must be a non-empty subset of {tuple(DEFENCES)}, got {list(defences)!r}")


def measure(
    th,
    *,
    trials: int = 24,
    candidates: int = 8,
    new_tokens: int = 24,
    temperature: float = 0.0,
    defences=tuple(DEFENCES),
    seed: int = 0,
    questions: tuple[str, ...] | None = None,
    timeout_s: float = 120.0,
    on_trial=None,
) -> PacketResult:
    """Serve EngineThread `th` over TLS (its own server on a free port, stopped after), relay it,
    and run `trials` rounds: each round one victim question (seeded), streamed once per defence
    (their order turning each round). `questions`: the victim's possible questions (default:
    `candidates` of QUESTIONS, drawn by the seed). The thread itself is only submitted to."""
    import httpx

    from engine.config import SamplingParams
    from engine.core.inputs import chat_ids
    from engine.serve import create_app, run_in_background
    from engine.serve.ports import free_port

    if questions is not None:
        questions = tuple(questions)
        if not all(isinstance(q, str) and q.strip() and len(q) <= MAX_QUESTION_CHARS for q in questions):
            raise ValueError(f"questions must be non-empty strings of at most {MAX_QUESTION_CHARS} characters")
        candidates = len(questions)
    check_args(trials, candidates, new_tokens, defences)
    rng = random.Random(seed)  # the questions and the victim's draws
    tie_rng = random.Random(seed + 1)  # the attacker's tie-breaks: never shift the victim's draws
    if questions is None:
        questions = tuple(rng.sample(QUESTIONS, candidates))
    tok = th.tokenizer
    qseed = rng.randrange(2**31)

    def body(q: int, opts: dict) -> dict:
        return {
            "messages": [{"role": "user", "content": questions[q]}],
            "max_tokens": new_tokens,
            "ignore_eos": True,
            "temperature": temperature,
            "seed": qseed + q,
            "stream": True,
            "stream_options": opts,
        }

    # the candidates, as the attacker learns them: the same requests, answered by the same model
    cand_ids = []
    for q in range(candidates):
        ids = chat_ids(tok, [{"role": "user", "content": questions[q]}])
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=temperature, seed=qseed + q)
        h = th.submit(ids, params, request_id=f"pkt-cand-{q}-{uuid.uuid4().hex[:8]}")
        cand_ids.append(list(h.result(timeout_s).outputs[0].token_ids))
    cand_sizes = [token_text_sizes(tok, ids) for ids in cand_ids]
    cand_text = [tok.decode(ids, skip_special_tokens=True) for ids in cand_ids]
    counts = vocab_length_counts(tok)
    common = counts.most_common(1)[0][0]

    run: list[Trial] = []
    with tempfile.TemporaryDirectory(prefix="kvscope-tls-") as d:
        cert, key = tls_relay.make_certificate(d)
        trust = ssl.create_default_context(cafile=str(cert))  # the victim checks the server's certificate
        port = free_port()
        srv = run_in_background(
            create_app(th, model_name="kvscope-lab"), "127.0.0.1", port, ssl_context=tls_relay.server_context(cert, key)
        )
        if not srv.started:
            raise RuntimeError("the lab's TLS server did not start")
        try:
            with tls_relay.TlsRelay(("127.0.0.1", port)) as relay:

                def one(q: int, opts: dict):
                    url = f"https://127.0.0.1:{relay.port}"
                    with httpx.Client(base_url=url, verify=trust, timeout=timeout_s) as c:
                        text, cipher = stream_answer(c, body(q, opts))
                    conn = relay.connections[-1]
                    relay.wait_closed(conn)
                    recs, t_req = _response(conn)
                    return text, recs, t_req, cipher

                # the attacker's own calibration request (no defence, a known answer)
                cal = None
                for attempt in range(8):
                    text, recs, _, cipher = one(attempt % candidates, DEFENCES["none"][0])
                    cal = calibrate(content_records([r.length for r in recs]), cand_sizes[attempt % candidates])
                    if cal is not None:
                        break
                if cal is None:
                    raise RuntimeError("calibration failed: every stream merged tokens into one chunk")
                k, k_last = cal
                order = list(defences)
                for r in range(trials):
                    q = rng.randrange(candidates)
                    for dname in order[r % len(order) :] + order[: r % len(order)]:
                        text, recs, t_req, _ = one(q, DEFENCES[dname][0])
                        lengths = content_records([x.length for x in recs])
                        truth = cand_sizes[q]
                        guess = recover_lengths(lengths, k, k_last)
                        t = Trial(
                            dname,
                            r,
                            q,
                            best_match(lengths, cand_sizes, k, k_last, tie_rng),
                            len(lengths),
                            len(truth),
                            length_hits(guess, truth),
                            sum(1 for s in truth if s == common),
                            sum(vocab_bits(g, counts) for g, s in zip(guess, truth) if g == s),
                            sum(x.length + tls_relay.HEADER for x in recs),
                            (recs[LEAD_RECORDS].t - t_req) if len(recs) > LEAD_RECORDS else float("nan"),
                            (recs[-1].t - t_req) if recs else float("nan"),
                            text == cand_text[q],
                            tuple(lengths),
                        )
                        run.append(t)
                        if on_trial is not None:
                            on_trial(t, len(run), trials * len(order))
        finally:
            srv.should_exit = True
            srv.thread.join(10)
    return PacketResult(
        tuple(run),
        candidates,
        new_tokens,
        k,
        k_last,
        cipher,
        th.config.model,
        questions,
        tuple(tuple(c) for c in cand_sizes),
    )


def main(argv=None) -> int:
    """`python -m engine.lab.packet_channel`: one measurement on a fresh engine, a line per defence
    and the whole result as one JSON line. --questions FILE: the victim's possible questions, one a
    line (a held-out set the attack has not seen)."""
    import argparse
    import dataclasses

    p = argparse.ArgumentParser(prog="python -m engine.lab.packet_channel", description=main.__doc__)
    p.add_argument("--model", default="default")
    p.add_argument("--questions", help="a text file, one question a line (default: the built-in set)")
    p.add_argument("--candidates", type=int, default=8, help="drawn from the built-in set without --questions")
    p.add_argument("--trials", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    from engine.config import EngineConfig
    from engine.core.thread import EngineThread

    qs = None
    if a.questions:
        with open(a.questions, encoding="utf-8") as f:
            qs = tuple(ln.strip() for ln in f if ln.strip())
    th = EngineThread(config=EngineConfig(model=a.model, max_num_seqs=4, max_model_len=1024))
    try:
        res = measure(
            th,
            trials=a.trials,
            candidates=len(qs) if qs else a.candidates,
            new_tokens=a.new_tokens,
            temperature=a.temperature,
            seed=a.seed,
            questions=qs,
        )
    finally:
        th.shutdown()
    for s in res.summaries():
        print(
            f"{s.label:40s} answer {100 * s.accuracy:5.1f} % (chance {100 * s.chance:.1f} %)  token lengths "
            f"{100 * s.length_accuracy:5.1f} % (chance {100 * s.length_chance:.1f} %)  "
            f"{s.bytes_per_answer:,.0f} B per answer"
        )
    print(json.dumps({"summaries": [dataclasses.asdict(s) for s in res.summaries()], "cipher": res.cipher}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
