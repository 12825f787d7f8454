"""The experiment plans the comparison pages run (on private engines, or on the shared thread): which engines, with
which settings, on which requests. Pages call these and only draw; each run is measured by
engine/observe/recording.py.

- `measure_cache_vs_nocache`: one request generated step by step with the KV cache and without
  it (kv_cache=False recomputes the whole context every step), each step timed.
- `run_allocator`: the Paged vs contiguous page's workload on one private engine per allocator.
- `measure_prefix`: the Prefix cache page's turns on the shared EngineThread, with one cache
  namespace (hits) or one per request (forced misses).
- `exercise_plan` / `run_exercise`: the seed's "fifty growing sequences vs a fixed budget":
  (A) no eviction and memory unbounded, (B) the budget enforced by reserving each sequence's final
  length at admission, (C) the budget enforced with LRU preemption (recompute).
"""

from __future__ import annotations

import gc
import random
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

from engine.config import EngineConfig, SamplingParams
from engine.core.engine import LLMEngine
from engine.model.kv_layout import cdiv
from engine.observe import rates
from engine.observe.recording import CostPoint, RunRecord, SnapshotRecorder, drive, measure_decode_cost, run_engine
from engine.observe.snapshot import Snapshot

# One private-engine measurement at a time per server: they compete for the same CPU cores (and
# with the shared engine), so running two at once would only make both numbers worse.
RUN_LOCK = threading.Lock()


def exercise_prompts(n: int, prompt_tokens: int, *, seed: int = 0, lo: int = 1000, hi: int = 40000) -> list[list[int]]:
    """`n` distinct prompts of exactly `prompt_tokens` token ids (ordinary vocabulary ids, no
    special tokens; distinct first tokens so no two sequences share a cached prefix)."""
    rng = random.Random(seed)
    return [[lo + i] + [rng.randrange(lo + n, hi) for _ in range(prompt_tokens - 1)] for i in range(n)]


def _cache_engines(base: EngineConfig, n_tokens: int, prompt_tokens: int):
    """{"cache": engine, "nocache": engine} (private, same loaded weights) and the prompt."""
    mml = prompt_tokens + n_tokens + 8
    blocks = cdiv(mml, base.block_size) + 2
    prompt = exercise_prompts(1, prompt_tokens, seed=7)[0]
    engines = {}
    for key, kv in (("cache", True), ("nocache", False)):
        engines[key] = private_engine(
            base,
            speculative=None,
            kv_cache_bytes=None,
            kv_cache=kv,
            num_kv_blocks=blocks,
            max_model_len=max(mml, 64),
            enable_prefix_caching=False,
            max_num_batched_tokens=max(512, mml),
        )
        measure_decode_cost(engines[key], prompt[: min(8, prompt_tokens)], 4, request_id="warmup")
    return engines, prompt


def measure_cache_vs_nocache(
    base: EngineConfig, n_tokens: int, prompt_tokens: int, *, on_phase: Callable[[int, bool], None] | None = None
) -> dict[str, tuple[float, list[CostPoint]]]:
    """{"cache": (prefill s, points), "nocache": (...)} for one greedy request of `prompt_tokens`
    that generates `n_tokens` (EOS ignored), on two private engines built from `base`, once each
    (`compare_cache_vs_nocache` is the controlled, repeated version the page shows). A short
    warm-up request first on each engine takes the first-call overheads out of the measurement.
    on_phase(i, with_cache) is called before each engine runs."""
    engines, prompt = _cache_engines(base, n_tokens, prompt_tokens)
    res = {}
    for i, (key, kv) in enumerate((("cache", True), ("nocache", False))):
        if on_phase is not None:
            on_phase(i, kv)
        res[key] = measure_decode_cost(engines[key], prompt, n_tokens, request_id=f"{key}-0")
    del engines
    gc.collect()
    return res


def compare_cache_vs_nocache(
    base: EngineConfig,
    n_tokens: int,
    prompt_tokens: int,
    *,
    min_rounds: int = 3,
    budget_s: float | None = None,
    busy: Callable[[], int] | None = None,
    busy_what: str = "",
    on_sample: Callable[[int, str, object], None] | None = None,
) -> dict:
    """The Cache vs no-cache page's timing, controlled (engine/lab/ab_timing.py): the same decode on the
    no-cache and the cache engine, alternated, `min_rounds`+ rounds. Compared: decode seconds
    (sum of the decode steps). Returns {"comparison" (a = nocache, b = cache, ratio = how many
    times slower without the cache), "cache": (prefill s, points), "nocache": (...)} with the
    points of the round whose no-cache/cache ratio is the median one."""
    from engine.lab import ab_timing

    engines, prompt = _cache_engines(base, n_tokens, prompt_tokens)
    runs: dict[str, list] = {"cache": [], "nocache": []}

    def side(key):
        def run(r):
            pre, pts = measure_decode_cost(engines[key], prompt, n_tokens, request_id=f"{key}-r{r}")
            runs[key].append((pre, pts))
            return ab_timing.Sample(sum(p.step_s for p in pts) or 1e-9, {"prefill_s": pre})

        return run

    try:
        cmp_ = ab_timing.compare(
            side("nocache"),
            side("cache"),
            names=("nocache", "cache"),
            min_rounds=min_rounds,
            budget_s=budget_s,
            busy=busy,
            busy_what=busy_what,
            on_sample=on_sample,
        )
    finally:
        engines.clear()  # free both private pools now
        gc.collect()
    ratios = [a.seconds / b.seconds for a, b in zip(cmp_.samples_a, cmp_.samples_b)]
    mid = sorted(range(len(ratios)), key=lambda i: ratios[i])[len(ratios) // 2]
    return {"comparison": cmp_, "cache": runs["cache"][mid], "nocache": runs["nocache"][mid]}


ALLOCATOR_LABELS = {"paged": "paged (blocks on demand)", "contiguous": "contiguous (one max_model_len slab each)"}


def run_allocator(
    base: EngineConfig,
    allocator: str,
    requests,
    *,
    model: str,
    block_size: int,
    budget_blocks: int,
    max_model_len: int,
    on_step: Callable[[int, Snapshot], None] | None = None,
) -> RunRecord:
    """The Paged vs contiguous page's run: workload `requests` (engine.workloads requests; EOS
    ignored so lengths are the workload's) on a private engine with `allocator`, prefix caching
    off so only allocation differs."""
    cfg = base.replace(
        model=model,
        allocator=allocator,
        block_size=block_size,
        num_kv_blocks=budget_blocks,
        kv_cache_bytes=None,
        max_model_len=max_model_len,
        max_num_seqs=256,
        max_num_batched_tokens=max(512, max_model_len),
        enable_prefix_caching=False,
        speculative=None,
        preemption_mode="recompute",
        event_ring_size=100_000,
    )
    eng = LLMEngine(cfg)
    try:
        return run_engine(
            eng,
            [
                (f"{allocator[:1]}-{r.request_id}", r.prompt, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
                for r in requests
            ],
            label=ALLOCATOR_LABELS[allocator],
            on_step=on_step,
            max_steps=20_000,
        )
    finally:
        del eng
        gc.collect()


def exercise_plan(
    base: EngineConfig, *, n: int, prompt_tokens: int, growth: int, budget_blocks: int, block_size: int, model: str
) -> list[tuple[str, str, EngineConfig]]:
    """(label, tag, engine config) of runs A, B, C; ValueError when the budget cannot hold even
    one sequence at its final length."""
    final = prompt_tokens + growth
    per_seq = cdiv(final, block_size)
    if per_seq > budget_blocks:
        raise ValueError(f"one sequence needs {per_seq} blocks; the budget of {budget_blocks} cannot hold even one")
    common = dict(
        model=model,
        block_size=block_size,
        max_num_seqs=max(n, 1),
        enable_prefix_caching=False,
        max_num_batched_tokens=max(512, final),
        event_ring_size=200_000,
        speculative=None,
        kv_cache_bytes=None,
    )
    runs = [
        (
            "A · no eviction, memory unbounded",
            "A",
            dict(num_kv_blocks=max(n * per_seq, budget_blocks) + 1, max_model_len=max(final, 16), victim_policy="lru"),
        ),
        (
            "B · no eviction, full length reserved at admission",
            "B",
            dict(num_kv_blocks=budget_blocks, allocator="contiguous", max_model_len=final),
        ),
        (
            "C · LRU preemption within the budget",
            "C",
            dict(
                num_kv_blocks=budget_blocks,
                max_model_len=max(final, 16),
                victim_policy="lru",
                preemption_mode="recompute",
            ),
        ),
    ]
    return [(label, tag, base.replace(**common, **kw)) for label, tag, kw in runs]


def run_exercise(
    plan: list[tuple[str, str, EngineConfig]],
    prompts: list[list[int]],
    growth: int,
    *,
    budget_tokens: int,
    on_step: Callable[[int, int, object], None] | None = None,
) -> list[RunRecord]:
    """Runs the plan one engine at a time (each freed before the next); on_step(run index, step,
    snapshot) after every step."""
    records = []
    for i, (label, tag, config) in enumerate(plan):
        reqs = [
            (f"{tag}-s{k:03d}", p, SamplingParams(max_tokens=growth, ignore_eos=True)) for k, p in enumerate(prompts)
        ]
        eng = LLMEngine(config)
        rec = run_engine(
            eng,
            reqs,
            label=label,
            max_steps=50_000,
            on_step=None if on_step is None else (lambda s, snap, i=i: on_step(i, s, snap)),
        )
        rec.budget_tokens = budget_tokens
        records.append(rec)
        del eng
        gc.collect()
    return records


# ------------------------------------------------------------------ prefix cache: hits vs forced misses


@dataclass(frozen=True, slots=True)
class PrefixRow:
    """One request of a prefix-cache measurement, as the engine reported it."""

    request_id: str
    turn: int
    ttft_s: float | None
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache at admission


def sharing_stats(snap: Snapshot | None) -> dict:
    """Blocks held by more than one request right now, and the largest ref count."""
    if snap is None:
        return {"shared_blocks": 0, "max_ref": 0, "refs_saved": 0}
    shared = [b for b in snap.blocks if b.ref_count > 1]
    return {
        "shared_blocks": len(shared),
        "max_ref": max((b.ref_count for b in shared), default=0),
        # blocks that would exist without sharing, minus blocks that do
        "refs_saved": sum(b.ref_count - 1 for b in shared),
    }


def more_shared(a: Snapshot | None, b: Snapshot | None) -> Snapshot | None:
    """Whichever snapshot shows more sharing (ties: the later one)."""
    if a is None:
        return b
    if b is None:
        return a
    ka, kb = sharing_stats(a), sharing_stats(b)
    return a if (ka["refs_saved"], ka["shared_blocks"]) > (kb["refs_saved"], kb["shared_blocks"]) else b


def chat_prompt(tokenizer, system: str, user: str) -> str:
    """System + user turn through the model's chat template (the text the engine tokenizes)."""
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    try:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    except Exception:  # a tokenizer without a chat template: plain text, same shared prefix
        return f"System: {system}\n\nUser: {user}\nAssistant:"


def measure_prefix(
    th,
    prompts: Sequence[str],
    max_tokens: int,
    *,
    mode: str,
    run_tag: str,
    on_poll: Callable[[Snapshot], None] | None = None,
    timeout_s: float = 600.0,
):
    """Run `prompts` (all starting with the same system prompt) on the shared EngineThread: the
    first alone, then the rest together, so the rest can reuse the first one's cached blocks.

    mode "cache": one fresh cache_salt for the whole run (a clean, private cache namespace: the
    first request misses, the others may hit). mode "miss": a fresh salt per request, so nothing
    can be shared — the same requests with the prefix cache effectively off.
    Returns (rows, snapshot with the most sharing seen). TTFT and cached tokens are the engine's."""
    base_salt = f"{run_tag}-{uuid.uuid4().hex[:8]}"
    best: Snapshot | None = None
    rows: list[PrefixRow] = []

    def params(i):
        salt = base_salt if mode == "cache" else f"{base_salt}-{i}"
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, cache_salt=salt)

    def wait(handles):
        nonlocal best
        deadline = time.monotonic() + timeout_s
        while not all(h.finished for h in handles):
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefix-cache measurement did not finish within {timeout_s:.0f}s")
            # snapshot_now: a fresh snapshot between two steps (the published one can be a step or
            # more old, and a fast wave can share and finish within that)
            snap = th.snapshot_now() if hasattr(th, "snapshot_now") else th.snapshot()
            best = more_shared(best, snap)
            if on_poll is not None:
                on_poll(snap)
            time.sleep(0.005)
        snap = th.snapshot()
        best = more_shared(best, snap)

    waves = [[0], list(range(1, len(prompts)))] if len(prompts) > 1 else [[0]]
    for wave in waves:
        handles = [(i, th.submit(prompts[i], params(i), request_id=f"{run_tag}-{mode}-t{i + 1}")) for i in wave]
        wait([h for _, h in handles])
        for i, h in handles:
            out = h.result(timeout=5)
            rows.append(
                PrefixRow(
                    h.request_id, i + 1, out.metrics.ttft, len(out.prompt_token_ids), out.metrics.num_cached_tokens
                )
            )
    return rows, best


# ------------------------------------------------------------------ speculative vs plain, controlled


@dataclass
class SpecComparison:
    """The Speculative page's measurement: `comparison` (a = plain seconds, b = speculative
    seconds, so its ratio is the speedup), the last round's final RequestInfo of each side, the
    speculative request's verify events and any fallback events, and the private engine's label."""

    comparison: object  # ab_timing.Comparison
    spec: object  # RequestInfo
    plain: object
    verify: list
    fallback: list
    label: str
    k: int
    tokens_per_target_pass: float | None
    outputs_match: bool
    # per round, plain / speculative seconds after the first token (each run's time less its TTFT):
    # the phase speculation changes; the prefill before it is the same work on both sides
    decode_ratio: object = None  # ab_timing.Spread, or None when a round lacks a first token


def private_engine(base: EngineConfig, **changes) -> LLMEngine:
    """An engine for one experiment, separate from the shared one: its own small KV pool and
    scheduler, the SAME loaded model (models.load_model keeps one copy per (name, device, dtype)
    in the process, so no second copy of the weights). Never touches the shared engine's pool."""
    return LLMEngine(base.replace(**changes))


def spec_private_engine(base: EngineConfig, spec) -> LLMEngine:
    """The Speculative page's private engine: speculation configured by `spec`, room for two
    requests of up to 4096 tokens, prefix caching off (each run pays its full prefill),
    recompute preemption."""
    mml = min(base.max_model_len or 4096, 4096)  # None: the model's limit, at least 4096 here
    return private_engine(
        base,
        speculative=spec,
        enable_prefix_caching=False,
        kv_cache_bytes=None,
        num_kv_blocks=cdiv(mml, base.block_size) * 2 + 4,
        max_num_seqs=2,
        max_model_len=mml,
        allocator="paged",
        preemption_mode="recompute",
        max_num_batched_tokens=max(512, mml),
    )


def compare_speculative(
    base: EngineConfig,
    prompt,
    spec,
    max_tokens: int,
    *,
    min_rounds: int = 3,
    budget_s: float | None = None,
    busy: Callable[[], int] | None = None,
    busy_what: str = "",
    on_sample: Callable[[int, str, object], None] | None = None,
    chat: bool = True,
    temperature: float = 0.0,
) -> SpecComparison:
    """Plain vs speculative decoding of one prompt (greedy unless `temperature` > 0: then both sides
    sample with seed 0 and speculation verifies by rejection sampling) on one private engine (speculation
    configured by `spec`; plain requests set SamplingParams.speculative=False), alternating sides
    per engine/lab/ab_timing.py. Prefix caching is off so each run pays its full prefill. A short
    untimed request of each side first takes first-call costs out of the numbers."""
    from engine.lab import ab_timing

    if spec is None:
        raise ValueError("speculative: choose a drafter (method and k) to compare against plain decoding")
    eng = spec_private_engine(base, spec)
    ids = eng.apply_chat_template(prompt) if chat and isinstance(prompt, str) else prompt
    last: dict[str, object] = {}
    seqs: dict[str, int] = {}
    ntok = {}

    def one(side: str, tag: str, n: int):
        rid = f"{side}-{tag}"
        seqs[side] = eng.events.last_seq
        t = time.perf_counter()
        drive(
            eng,
            [
                (
                    0,
                    rid,
                    ids,
                    SamplingParams(
                        max_tokens=n,
                        temperature=temperature,
                        seed=0,
                        request_class="spec-page",
                        speculative=side == "spec",
                    ),
                )
            ],
            max_idle_steps=1000,
        )
        dt = time.perf_counter() - t
        info = eng.snapshot().request(rid)
        last[side] = info
        ntok[side] = info.output_len if info is not None else 0
        ttft = rates.ttft(info.arrival_time, info.first_token_time) if info is not None else None
        return ab_timing.Sample(dt, {"tokens": ntok[side], "request_id": rid, "ttft_s": ttft})

    try:
        one("plain", "warmup", 2)
        one("spec", "warmup", 2)
        cmp_ = ab_timing.compare(
            lambda r: one("plain", f"r{r}", max_tokens),
            lambda r: one("spec", f"r{r}", max_tokens),
            names=("plain", "spec"),
            min_rounds=min_rounds,
            budget_s=budget_s,
            busy=busy,
            busy_what=busy_what,
            on_sample=on_sample,
        )
        sreq, preq = last["spec"], last["plain"]
        acc = sreq.spec_num_accepted_tokens if sreq is not None else 0
        passes = (sreq.output_len - acc) if sreq is not None else 0
        tpp = sreq.output_len / passes if passes > 0 else None
        cmp_ = cmp_.with_suspect(ab_timing.suspect_speedup(cmp_.ratio.median, tpp))
        evs = eng.events.since(seqs["spec"])
        srid = sreq.request_id if sreq is not None else None
        return SpecComparison(
            comparison=cmp_,
            spec=sreq,
            plain=preq,
            verify=[e for e in evs if e.kind == "spec_verify" and e.request_id == srid],
            fallback=[e for e in evs if e.kind == "spec_fallback"],
            label=eng.snapshot().info.speculative or "",
            k=int(spec.num_speculative_tokens),
            tokens_per_target_pass=tpp,
            outputs_match=(sreq is not None and preq is not None and sreq.output_text == preq.output_text),
            decode_ratio=ab_timing.ratio_after(cmp_, "ttft_s"),
        )
    finally:
        gc.collect()  # the private engine's pool goes with this frame (nothing else refers to it)


def compare_prefix(
    base: EngineConfig,
    prompts: Sequence[str],
    max_tokens: int,
    *,
    prompt_lens: Sequence[int],
    min_rounds: int = 3,
    budget_s: float | None = None,
    busy: Callable[[], int] | None = None,
    busy_what: str = "",
    on_sample: Callable[[int, str, object], None] | None = None,
) -> dict:
    """The Prefix cache page's cold vs warm, controlled and off the shared pool: a private
    EngineThread (same loaded weights, its own pool sized for the turns) runs `measure_prefix`
    with forced misses ("miss": a fresh salt per request, so every turn is cold) and with sharing
    ("cache": one fresh salt per round, so later turns reuse turn 1's blocks), alternated per
    engine/lab/ab_timing.py. Compared: mean TTFT of the later turns (all turns when there is one).
    Returns {"comparison" (a = miss, b = cache: ratio = how many times faster the warm turns
    reach their first token), "hit", "miss" (rows of the median round), "best" (snapshot with the
    most sharing seen), "rec" (SnapshotRecorder of the private engine)}."""
    from engine.core.thread import EngineThread
    from engine.lab import ab_timing

    if not prompts:
        raise ValueError("prompts: give at least one turn")
    bs = base.block_size
    need = sum(cdiv(n + max_tokens + 1, bs) for n in prompt_lens) + len(prompts) + 4
    mml = max(max(prompt_lens) + max_tokens + 8, 64)
    pth = EngineThread(
        private_engine(
            base,
            speculative=None,
            enable_prefix_caching=True,
            kv_cache=True,
            kv_cache_bytes=None,
            num_kv_blocks=2 * need,
            allocator="paged",
            max_num_seqs=max(len(prompts), 1),
            max_model_len=min(mml, base.max_model_len),
            preemption_mode="recompute",
            max_num_batched_tokens=max(512, mml),
        )
    )
    tag = f"pc{uuid.uuid4().hex[:4]}"
    rec = SnapshotRecorder(tag, start_time=pth.snapshot().time, start_seq=pth.events.last_seq)
    rows: dict[str, list] = {"cache": [], "miss": []}
    best: list = [None]

    def later(rws):
        sel = rws[1:] if len(rws) > 1 else rws
        vals = [r.ttft_s for r in sel if r.ttft_s is not None]
        if not vals:
            raise RuntimeError("the engine reported no TTFT for the turns")
        return sum(vals) / len(vals)

    def side(mode):
        def run(r):
            rws, b = measure_prefix(
                pth, prompts, max_tokens, mode=mode, run_tag=f"{tag}-r{r}", on_poll=lambda s: rec.poll(pth)
            )
            rows[mode].append(rws)
            if mode == "cache":
                best[0] = more_shared(best[0], b)
            return ab_timing.Sample(later(rws))

        return run

    try:
        one_warm = measure_prefix(pth, prompts[:1], 2, mode="miss", run_tag=f"{tag}-warmup")
        del one_warm
        cmp_ = ab_timing.compare(
            side("miss"),
            side("cache"),
            names=("miss", "cache"),
            min_rounds=min_rounds,
            budget_s=budget_s,
            busy=busy,
            busy_what=busy_what,
            on_sample=on_sample,
        )
        rec.poll(pth)
    finally:
        pth.shutdown()
        gc.collect()
    ratios = [a.seconds / b.seconds for a, b in zip(cmp_.samples_a, cmp_.samples_b)]
    mid = sorted(range(len(ratios)), key=lambda i: ratios[i])[len(ratios) // 2]
    return {
        "comparison": cmp_,
        "hit": rows["cache"][mid],
        "miss": rows["miss"][mid],
        "best": best[0],
        "rec": rec,
        "tag": tag,
    }
