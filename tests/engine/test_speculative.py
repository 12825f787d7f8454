"""Speculative decoding in the engine: greedy exactness against plain decoding for every method,
k in {1, 2, 4, 8} and batch sizes 1 and 8; no block leaks and cleared slots after rollbacks
(invariants after every step); metrics consistent with vLLM's definitions; fallback per request
class; draft-model checks; preemption and prefix caching with speculation.

The tiny random model covers every combination fast; the real default model checks exactness
and real acceptance on a few prompts, including a passage-editing one.
"""

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams, SpeculativeConfig
from engine.observe import trace_events as ev
from engine.observe.recording import drive
from engine.observe.snapshot import ACCEPTED, BONUS, PLAIN, REPLACED
from engine.speculative import DRAFT_SUFFIX, ngram_propose
from tests.engine.engines import tiny_engine, token_ids

TINY_PROMPTS = [
    "hello world",
    "the cat sat on the mat and the cat sat on the",
    "1 2 3 4 5 6 7 8",
    "Once upon a time",
    "a b a b a b a b a b",
    "Paris is the capital of",
    "x",
    "zzz zzz zzz zzz",
]

PASSAGE = (
    "The old lighthouse stood at the edge of the cliff for more than a century. Every night its keeper "
    "climbed the spiral stairs, trimmed the wick, and polished the great lens until it shone. Ships "
    "passing in the dark relied on its steady beam to avoid the rocks below."
)
EDIT_PROMPT = (
    "Rewrite the following passage exactly, but change every 'keeper' to 'guardian'. Output only the "
    f"passage.\n\n{PASSAGE}"
)

TINY_METHODS = {
    "ngram": dict(method="ngram"),
    "ngram_full_k": dict(method="ngram", prompt_lookup_match_bound=False),  # always k, as vLLM's proposer
    "self_draft_early_exit": dict(method="self_draft", draft_layers=1),
    "self_draft_int8": dict(method="self_draft", draft_quantize="int8"),
    "draft_model": dict(method="draft_model", draft_model="tiny"),
}


def run(eng: LLMEngine, prompts, params, check=True) -> list[list[int]]:
    return token_ids(eng, prompts, params, check=check, after_step=check_rolled_back_slots_are_clear if check else None)


def check_rolled_back_slots_are_clear(eng: LLMEngine) -> None:
    """After a verify pass with a rejection, the K/V slots of the rejected draft positions that
    stay inside the request's blocks hold zeros (the engine clears them; blocks past them are
    released). Early-exit drafts wrote into the same slots before; those must be gone too."""
    bs = eng.bm.block_size
    for e in eng.events.since(0, kinds=[ev.SPEC_VERIFY]):
        if e.step != eng.step_num or not eng.bm.has_table(e.request_id):
            continue
        rid = e.request_id
        n = eng.bm.num_tokens(rid)
        table = eng.bm.table(rid)
        req = eng.requests[rid]
        assert n == req.num_computed_tokens
        fed_end = n + (e.data["k"] - e.data["accepted"])
        slots = [table[p // bs] * bs + p % bs for p in range(n, fed_end) if p // bs < len(table)]
        if not slots:
            continue
        for layer in (0, eng.runner.num_layers - 1):
            k, v = eng.runner.read_slots(layer, slots)
            assert not k.any() and not v.any(), f"{rid}: rejected draft K/V left in the pool"


def spec_engine(model="tiny", k=4, fallback=False, **kw):
    spec_kw = dict(kw.pop("spec", {}))
    return tiny_engine(
        model=model, speculative=SpeculativeConfig(num_speculative_tokens=k, enable_fallback=fallback, **spec_kw), **kw
    )


@pytest.fixture(scope="module")
def tiny_reference():
    eng = LLMEngine(EngineConfig(model="tiny", num_threads=1))
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    return {
        "batch8": run(eng, TINY_PROMPTS, params, check=False),
        "batch1": run(eng, TINY_PROMPTS[1:2], params, check=False),
    }


@pytest.fixture(scope="module")
def tiny_reference_int8():
    """Plain decoding on an int8 K/V pool: the tokens speculation on the same pool must give."""
    eng = LLMEngine(EngineConfig(model="tiny", num_threads=1, kv_cache_dtype="int8"))
    return {"batch8": run(eng, TINY_PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True), check=False)}


@pytest.mark.parametrize("method", list(TINY_METHODS))
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_identical_to_plain_tiny(tiny_reference, method, k, batch):
    eng = spec_engine(k=k, spec=TINY_METHODS[method])
    prompts = TINY_PROMPTS if batch == 8 else TINY_PROMPTS[1:2]
    got = run(eng, prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert got == tiny_reference[f"batch{batch}"]
    m = eng.spec.metrics()
    if not method.startswith("ngram"):  # model drafters always draft
        assert m.num_drafts > 0
    check_metric_consistency(eng)
    assert not eng.bm.request_ids(), "blocks still held after every request finished"
    assert eng.bm.num_free_blocks == eng.bm.num_blocks


def check_metric_consistency(eng: LLMEngine) -> None:
    m = eng.spec.metrics()
    assert 0 <= m.num_accepted_tokens <= m.num_draft_tokens
    assert m.num_drafts <= m.num_draft_tokens <= m.num_drafts * m.num_speculative_tokens
    if m.num_drafts:
        assert m.mean_acceptance_length == pytest.approx(1 + m.num_accepted_tokens / m.num_drafts)
        assert m.acceptance_rate == pytest.approx(m.num_accepted_tokens / m.num_draft_tokens)
    assert sum(m.accepted_per_position) == m.num_accepted_tokens
    assert sum(m.drafts_per_position) == m.num_draft_tokens
    assert m.drafts_per_position[0] == m.num_drafts
    assert all(a <= d for a, d in zip(m.accepted_per_position, m.drafts_per_position))
    assert list(m.accepted_per_position) == sorted(m.accepted_per_position, reverse=True)
    assert m.num_emitted_tokens >= m.num_target_passes
    assert m.num_emitted_tokens - m.num_target_passes == m.num_accepted_tokens
    verifies = eng.events.since(0, kinds=[ev.SPEC_VERIFY])
    if len(eng.events) < eng.events.maxlen:
        assert len(verifies) == m.num_drafts
        assert sum(e.data["accepted"] for e in verifies) == m.num_accepted_tokens
    for e in verifies:
        d = e.data
        assert 0 <= d["accepted"] <= d["k"] == len(d["proposed"])
        assert (d["rejected"] is None) == (d["bonus"] is not None) == (d["accepted"] == d["k"])
        if d["rejected"] is not None:
            assert d["rejected"] == d["proposed"][d["accepted"]] and d["replacement"] is not None
        assert d["draft_s"] >= 0 and d["verify_s"] > 0 and d["reason"]


def check_marks(eng: LLMEngine) -> None:
    """Token marks per finished request agree with its counters."""
    for r in eng.finished:
        acc = sum(1 for m in r.token_marks if m.kind == ACCEPTED)
        rep = [m for m in r.token_marks if m.kind == REPLACED]
        bonus = sum(1 for m in r.token_marks if m.kind == BONUS)
        assert acc == r.spec_num_accepted_tokens
        assert len(rep) + bonus <= r.spec_num_drafts  # a stop may cut a verify pass short
        for m in rep:
            assert m.rejected_id is not None and m.rejected_id != m.token_id and m.rejected_text is not None
        assert all(m.kind in (PLAIN, ACCEPTED, REPLACED, BONUS) for m in r.token_marks)


# ------------------------------------------------------------------------------- real model


@pytest.fixture(scope="module")
def real_plain():
    eng = LLMEngine(EngineConfig(model="default"))
    prompts = [
        eng.apply_chat_template(EDIT_PROMPT),
        "The capital of France is",
        eng.apply_chat_template("List the days of the week."),
    ]
    params = SamplingParams(max_tokens=40)
    return prompts, params, run(eng, prompts, params, check=False)


@pytest.mark.parametrize("method,k", [("ngram", 2), ("ngram", 8), ("ngram_full_k", 4), ("self_draft", 4)])
def test_greedy_identical_to_plain_real_model(real_plain, method, k):
    prompts, params, ref = real_plain
    spec = dict(TINY_METHODS.get(method, {"method": method}))
    if method == "self_draft":
        spec["draft_layers"] = 24
    eng = spec_engine("default", k=k, spec=spec)
    assert run(eng, prompts, params) == ref
    check_metric_consistency(eng)
    check_marks(eng)
    m = eng.spec.metrics()
    assert m.num_drafts > 0
    if method.startswith("ngram"):
        # the passage-editing prompt copies most of its input: n-gram drafts are mostly accepted
        edit = next(r for r in eng.finished if r.prompt_token_ids == prompts[0])
        assert edit.spec_num_accepted_tokens / edit.spec_num_draft_tokens > 0.5
        assert edit.num_output_tokens - edit.spec_num_accepted_tokens < 0.7 * edit.num_output_tokens


def test_speculative_page_default_prompt_is_an_edit_that_drafting_pays_for():
    """The Speculative page's default prompt (ui/figures/drafters.EXAMPLE_PROMPT): the default model
    answers with the paragraph, its one misspelling corrected, so n-gram drafts copied from the
    prompt are accepted run after run, and rejected where the answer departs from the prompt."""
    from ui.figures import drafters

    eng = spec_engine("default", k=4, spec={"method": "ngram"}, fallback=True)
    prompt = eng.apply_chat_template(drafters.EXAMPLE_PROMPT)
    params = SamplingParams(max_tokens=64)
    plain = LLMEngine(EngineConfig(model="default"))
    assert run(eng, [prompt], params) == run(plain, [prompt], params, check=False)
    r = eng.finished[0]
    text = eng.tokenizer.decode(r.output_token_ids, skip_special_tokens=True)
    assert "In the evening the cat comes back home" in text and "evenning" not in text
    assert r.finish_reason == "stop" and r.num_output_tokens < params.max_tokens
    assert r.spec_num_accepted_tokens / r.spec_num_draft_tokens > 0.7
    assert sum(1 for m in r.token_marks if m.kind == REPLACED) >= 1  # the fix: a draft rejected
    assert r.num_output_tokens / r.spec_num_drafts > 3  # tokens per target pass
    # every draft is the lookup's, replayed on the request's own tokens: a one-token match drafts 2,
    # a longer one up to k (match length + 1), no match a plain pass
    verifies = [e.data for e in eng.events.since(0, kinds=[ev.SPEC_VERIFY]) if e.request_id == r.request_id]
    out, pos, lengths = list(r.output_token_ids), 1, []
    while pos < len(out):
        d = ngram_propose(prompt + out[:pos], 4, 1, 3, match_bound=True)
        if not d:
            pos += 1
            continue
        e = verifies[len(lengths)]
        assert e["proposed"] == d
        lengths.append(len(d))
        pos += e["accepted"] + 1
    assert len(lengths) == len(verifies) == r.spec_num_drafts
    assert min(lengths) == 2 and max(lengths) == 4 and sum(lengths) == r.spec_num_draft_tokens


def test_int8_self_draft_real_model(real_plain):
    prompts, params, ref = real_plain
    eng = spec_engine("default", k=4, spec={"method": "self_draft", "draft_quantize": "int8"})
    assert run(eng, prompts[:2], params) == ref[:2]
    m = eng.spec.metrics()
    assert m.num_drafts > 0 and m.num_accepted_tokens > 0
    check_metric_consistency(eng)


# ------------------------------------------------------------------------------- memory


@pytest.mark.parametrize("method", ["ngram", "self_draft_early_exit", "draft_model"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tight_pool_preemption_with_speculation(tiny_reference, method, mode):
    """A pool too small for all 8 requests: speculation shares it with preemption (and the
    draft model's own blocks); output stays identical and nothing leaks."""
    eng = spec_engine(
        k=4, spec=TINY_METHODS[method], num_kv_blocks=12, block_size=4, preemption_mode=mode, swap_space_bytes=1 << 20
    )
    got = run(eng, TINY_PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True))
    assert got == tiny_reference["batch8"]
    assert eng.scheduler.num_preemptions > 0
    assert eng.bm.num_free_blocks == eng.bm.num_blocks


@pytest.mark.parametrize("method", ["ngram", "self_draft_early_exit"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tight_pool_preemption_with_speculation_int8_kv(tiny_reference_int8, method, mode):
    """The same on an int8 K/V pool: rolled-back slots cleared (scales too), invariants after
    every step, and the plain int8 run's tokens."""
    eng = spec_engine(
        k=4,
        spec=TINY_METHODS[method],
        num_kv_blocks=12,
        block_size=4,
        kv_cache_dtype="int8",
        preemption_mode=mode,
        swap_space_bytes=1 << 20,
    )
    got = run(eng, TINY_PROMPTS, SamplingParams(max_tokens=20, ignore_eos=True))
    assert got == tiny_reference_int8["batch8"]
    assert eng.scheduler.num_preemptions > 0
    assert eng.bm.num_free_blocks == eng.bm.num_blocks


def test_draft_model_blocks_in_pool_map():
    eng = spec_engine(k=4, spec=TINY_METHODS["draft_model"])
    rid = eng.add_request(None, TINY_PROMPTS[1], SamplingParams(max_tokens=12, ignore_eos=True))
    seen = False
    while eng.has_unfinished_requests():
        eng.step()
        eng.check_invariants()
        snap = eng.snapshot()
        owners = {o for b in snap.blocks for o in b.owners}
        if rid + DRAFT_SUFFIX in owners:
            seen = True
            # the draft's blocks cover its cached tokens exactly
            n = eng.bm.num_tokens(rid + DRAFT_SUFFIX)
            assert len(eng.bm.table(rid + DRAFT_SUFFIX)) == -(-n // eng.bm.block_size)
    assert seen
    assert not eng.bm.request_ids() and eng.bm.num_free_blocks == eng.bm.num_blocks
    frees = [e for e in eng.events.since(0, kinds=[ev.BLOCK_FREE]) if e.request_id == rid + DRAFT_SUFFIX]
    assert frees and all(e.data["reason"] for e in frees)


def test_prefix_caching_with_speculation(tiny_reference):
    eng = spec_engine(k=4, spec=TINY_METHODS["self_draft_early_exit"], block_size=4)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    first = run(eng, TINY_PROMPTS[1:2], params)
    again = run(eng, TINY_PROMPTS[1:2], params)
    assert first == again == tiny_reference["batch1"]
    assert eng.bm.prefix_hits > 0


def test_abort_mid_speculation_frees_draft_blocks():
    eng = spec_engine(k=4, spec=TINY_METHODS["draft_model"])
    rid = eng.add_request(None, TINY_PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert eng.bm.table(rid + DRAFT_SUFFIX)
    eng.abort_request(rid)
    eng.check_invariants()
    assert not eng.bm.request_ids() and eng.bm.num_free_blocks == eng.bm.num_blocks


# ------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("method", ["ngram", "self_draft_int8"])
def test_seeded_sampling_through_engine_is_reproducible(method):
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=s, ignore_eos=True) for s in range(4)]

    def go():
        eng = spec_engine(k=3, spec=TINY_METHODS[method])
        ids = [eng.add_request(None, p, sp) for p, sp in zip(TINY_PROMPTS[:4], params)]
        outs = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o.outputs[0].token_ids
            eng.check_invariants()
        check_metric_consistency(eng)
        return [outs[i] for i in ids]

    a = go()
    assert a == go()
    assert all(len(x) == 16 for x in a)


@pytest.mark.parametrize("method", ["ngram", "self_draft_int8"])
def test_sampled_marks_carry_p_q_and_the_draw(method):
    """Through the engine: with temperature > 0 every accepted / replaced token's mark holds its
    draft's p, q and the draw u (accepted iff u * q < p; q = 1 for n-gram's deterministic drafts),
    every bonus its p; greedy marks carry none."""
    eng = spec_engine(k=4, spec=TINY_METHODS[method])
    sp = [SamplingParams(max_tokens=24, temperature=0.3, seed=s, ignore_eos=True) for s in range(4)]
    for p, params in zip(TINY_PROMPTS[:4], sp):
        eng.add_request(None, p, params)
    greedy = eng.add_request(None, TINY_PROMPTS[4], SamplingParams(max_tokens=24, ignore_eos=True))
    drive(eng)
    kinds = set()
    for r in eng.finished:
        for m in r.token_marks:
            kinds.add(m.kind)
            if r.request_id == greedy or m.kind == PLAIN:
                assert (m.p, m.q, m.u) == (None, None, None)
            elif m.kind == BONUS:
                assert 0 < m.p <= 1 and m.q is None and m.u is None
            else:
                assert 0 <= m.p <= 1 and 0 < m.q <= 1 and 0 <= m.u < 1
                assert (m.u * m.q < m.p) == (m.kind == ACCEPTED)
                if method == "ngram":
                    assert m.q == 1.0
    # the int8 copy drafts close to the target (both verdicts occur); n-gram finds few matches in
    # the tiny random model's text, but some of them are judged
    assert ({ACCEPTED, REPLACED} if method == "self_draft_int8" else {REPLACED}) <= kinds


def test_engine_sampling_distribution_matches_plain():
    """Through the whole engine (tiny model, int8 self-draft so q != p): the second generated
    token (the first one produced by a verify pass) has the same distribution with and without
    speculation (two-sample chi-square over the top tokens, fixed seeds)."""
    n = 240
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=1000 + i, ignore_eos=True) for i in range(n)]

    def second_tokens(eng):
        ids = [eng.add_request(None, "the cat sat on", sp) for sp in params]
        outs = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    outs[o.request_id] = o.outputs[0].token_ids
        return [tuple(outs[i][:2]) for i in ids]

    plain = second_tokens(LLMEngine(EngineConfig(model="tiny", num_threads=1, max_num_seqs=64)))
    spec_eng = spec_engine(k=1, spec=TINY_METHODS["self_draft_int8"], max_num_seqs=64)
    spec = second_tokens(spec_eng)
    assert spec_eng.spec.metrics().num_drafts >= n // 2
    # the first token comes from the same prefill and the same seeds: identical
    assert [a[0] for a in plain] == [b[0] for b in spec]
    from collections import Counter

    ca, cb = Counter(plain), Counter(spec)
    cats = [c for c in set(ca) | set(cb) if ca[c] + cb[c] >= 10]
    chi2 = sum((ca[c] - cb[c]) ** 2 / (ca[c] + cb[c]) for c in cats)
    df = max(1, len(cats) - 1)
    from tests.engine.test_speculative_sampling import chi2_critical

    assert chi2 < chi2_critical(df), (chi2, df)


# ------------------------------------------------------------------------------- fallback


def test_fallback_when_acceptance_is_below_measured_break_even():
    """Early exit after 1 of the tiny model's 2 layers is never accepted: the class falls back
    to plain decoding with an event whose reason carries the measured costs, and probes again
    after probe_interval steps. A request class that never speculated is untouched."""
    eng = spec_engine(
        k=4, fallback=True, spec=dict(TINY_METHODS["self_draft_early_exit"], monitor_window=8, probe_interval=3)
    )
    params = SamplingParams(max_tokens=40, ignore_eos=True, request_class="chat")
    other = SamplingParams(max_tokens=40, ignore_eos=True, request_class="batch", speculative=False)
    eng.add_request(None, TINY_PROMPTS[0], params)
    eng.add_request(None, TINY_PROMPTS[3], other)
    while eng.has_unfinished_requests():
        eng.step()
        eng.check_invariants()
    fb = eng.events.since(0, kinds=[ev.SPEC_FALLBACK])
    off = [e for e in fb if not e.data["speculating"]]
    on = [e for e in fb if e.data["speculating"]]
    assert off and on, "expected a fallback and a probe"
    d = off[0].data
    assert d["request_class"] == "chat"
    assert d["mean_acceptance_length"] < d["cost_ratio"]
    assert d["cost_ratio"] > 1 and d["plain_pass_s"] > 0 and d["verify_pass_s"] > 0
    assert "probing again" in on[0].data["reason"]
    assert all(e.data["request_class"] == "chat" for e in fb)
    m = eng.spec.metrics()
    check_metric_consistency(eng)
    # plain decoding happened in between: fewer drafts than decode passes
    assert m.num_drafts < m.num_target_passes


def test_configure_class_switches_speculation_off():
    eng = spec_engine(k=4, spec=TINY_METHODS["self_draft_early_exit"])
    eng.spec.configure_class("quiet", enabled=False)
    eng.spec.configure_class("short", num_speculative_tokens=2)
    with pytest.raises(ValueError):
        eng.spec.configure_class("short", num_speculative_tokens=9)
    run(eng, TINY_PROMPTS[:1], SamplingParams(max_tokens=10, ignore_eos=True, request_class="quiet"))
    assert eng.spec.metrics().num_drafts == 0
    run(eng, TINY_PROMPTS[:1], SamplingParams(max_tokens=10, ignore_eos=True, request_class="short"))
    m = eng.spec.metrics()
    assert m.num_drafts > 0 and m.num_draft_tokens <= 2 * m.num_drafts


# ------------------------------------------------------------------------------- bad config


def test_draft_model_vocab_mismatch_is_a_clear_error(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.model.models import load_tokenizer

    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=4096,
    )
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    load_tokenizer("default").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocab size 1000"):
        spec_engine(k=2, spec=dict(method="draft_model", draft_model=str(tmp_path)))


def test_early_exit_layers_must_be_below_target_depth():
    with pytest.raises(ValueError, match="draft_layers"):
        spec_engine(k=2, spec=dict(method="self_draft", draft_layers=2))


def test_compare_speculative_reports_both_runs_for_self_draft():
    from engine.lab.experiments import compare_speculative

    base = EngineConfig(model="tiny", num_threads=1)
    spec = SpeculativeConfig(method="self_draft", draft_layers=1, num_speculative_tokens=2, enable_fallback=False)
    r = compare_speculative(base, TINY_PROMPTS[1], spec, 12, min_rounds=1, chat=False)
    assert r.outputs_match and r.spec.output_len == r.plain.output_len == 12
    c = r.comparison
    assert c.a.median > 0 and c.b.median > 0 and c.ratio.median > 0
    assert r.spec.spec_num_draft_tokens > 0
    # the time after the first token, per round: each side's run less its own TTFT
    d = r.decode_ratio
    assert d is not None and d.n == c.rounds
    s, p = c.samples_b[0], c.samples_a[0]
    assert 0 < s.extra["ttft_s"] < s.seconds and 0 < p.extra["ttft_s"] < p.seconds
    assert d.lo <= (p.seconds - p.extra["ttft_s"]) / (s.seconds - s.extra["ttft_s"]) <= d.hi


def test_early_exit_borrowed_blocks_go_back_where_they_were():
    """The early-exit draft borrows blocks past the target's table only while it drafts: after
    propose() the pool's free queue is in the same order and the target's table unchanged."""
    eng = spec_engine(k=8, spec=TINY_METHODS["self_draft_early_exit"], block_size=2)
    rid = eng.add_request(None, TINY_PROMPTS[0], SamplingParams(max_tokens=30, ignore_eos=True))
    eng.step()
    req = eng.requests[rid]
    assert req.num_tokens - req.num_computed_tokens == 1
    order, table = eng.bm.free_block_ids(), list(eng.bm.table(rid))
    drafts = eng.spec.propose([req])  # returned, not written into the request
    assert len(drafts[rid]) == 8 and req.spec_token_ids == []
    assert eng.bm.free_block_ids() == order and eng.bm.table(rid) == table
    eng.check_invariants()


def test_per_request_draft_length_caps_each_pass_and_keeps_output():
    """SamplingParams.num_speculative_tokens: one request drafts at most 2 tokens per pass on a k=6
    engine while another uses the engine's 6, in the same batch; greedy outputs equal plain decoding's."""
    eng = spec_engine(k=6, spec=TINY_METHODS["self_draft_early_exit"])
    plain = LLMEngine(EngineConfig(model="tiny", num_threads=1))
    prompt = TINY_PROMPTS[1]
    a = eng.add_request("short-k", prompt, SamplingParams(max_tokens=20, ignore_eos=True, num_speculative_tokens=2))
    b = eng.add_request("full-k", prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    seq0 = eng.events.last_seq
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    drafts = {}
    for e in eng.events.since(seq0, kinds=["spec_verify"]):
        drafts.setdefault(e.request_id, []).append(int(e.data["k"]))
    assert drafts[a] and max(drafts[a]) <= 2
    assert max(drafts[b]) > 2
    plain.add_request("p", prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    ref = None
    while plain.has_unfinished_requests():
        for o in plain.step():
            if o.finished:
                ref = o.outputs[0].token_ids
    assert outs[a] == outs[b] == ref
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=0)
