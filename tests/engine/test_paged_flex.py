"""engine/model/paged_flex.py: the FlexAttention path (attention_backend="flex") runs eagerly on CPU, so
the suite checks the same code the GPU runs compiled: attention vs a dense reference on random
ragged batches, logits vs the torch path and the C kernel, greedy tokens vs transformers for
ragged batches, chunked prefill, prefix hits and speculative verification rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, EngineConfig, SamplingParams, SpeculativeConfig
from engine.lab.agreement import agreement, hf_greedy
from engine.model import paged_flex
from engine.model.models import load_model
from engine.model.runner import BatchRow, ModelRunner

CPU = torch.device("cpu")


def _dense_reference(q, k_pool, v_pool, rows, bs, scale):
    """Per request: gather its blocks, causal mask aligned to its positions, SDPA."""
    hkv, d = k_pool.shape[2], k_pool.shape[3]
    k, v = k_pool.reshape(-1, hkv, d), v_pool.reshape(-1, hkv, d)
    out = []
    for t0, n, start, table in rows:
        ctx = start + n
        idx = torch.tensor([b * bs + o for b in table for o in range(bs)])[:ctx]
        kk, vv = k[idx].transpose(0, 1)[None], v[idx].transpose(0, 1)[None]
        mask = torch.arange(ctx)[None, :] <= torch.arange(start, ctx)[:, None]
        o = F.scaled_dot_product_attention(
            q[:, t0 : t0 + n][None], kk, vv, attn_mask=mask, scale=scale, enable_gqa=q.shape[0] != hkv
        )
        out.append(o[0].transpose(0, 1))
    return torch.cat(out)


@st.composite
def ragged_batches(draw):
    bs = draw(st.sampled_from([1, 4, 16]))
    num_blocks = 48 if bs == 1 else 24
    free = list(range(num_blocks))
    draw(st.randoms(use_true_random=False)).shuffle(free)
    rows, t = [], 0
    for _ in range(draw(st.integers(1, 4))):
        n = draw(st.integers(1, 20))  # prefill chunk, decode (1) or verify rows
        start = draw(st.integers(0, 20))
        nb = -(-(start + n) // bs)
        if nb > len(free):
            break
        table = [free.pop() for _ in range(nb)]
        rows.append((t, n, start, table))
        t += n
    if not rows:
        rows = [(0, 1, 0, [free.pop()])]
    return bs, num_blocks, rows


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=ragged_batches(), gqa=st.booleans(), seed=st.integers(0, 2**16))
def test_flex_matches_dense_reference(batch, gqa, seed):
    bs, num_blocks, rows = batch
    g = torch.Generator().manual_seed(seed)
    h, hkv, d = 4, (2 if gqa else 4), 8
    T = sum(n for _, n, _, _ in rows)
    q = torch.randn(h, T, d, generator=g)
    kp = torch.randn(num_blocks, bs, hkv, d, generator=g)
    vp = torch.randn(num_blocks, bs, hkv, d, generator=g)
    fm = paged_flex.build(rows, num_blocks, bs, CPU)
    got = paged_flex.attend(q, kp, vp, fm, 0.3)
    ref = _dense_reference(q, kp, vp, rows, bs, 0.3)
    assert got.shape == (T, h, d)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_pool_in_another_dtype_is_refused_not_copied():
    rows = [(0, 2, 0, [1])]
    fm = paged_flex.build(rows, 4, 4, CPU)
    q = torch.randn(2, 2, 8)
    pool = torch.zeros(4, 4, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="reads the pool in the compute dtype"):
        paged_flex.attend(q, pool, pool, fm, None)


def test_block_mask_lists_only_the_batchs_blocks():
    rows = [(0, 3, 0, [5]), (3, 1, 20, [7, 2, 9, 11, 4, 1])]
    fm = paged_flex.build(rows, 16, 4, CPU)
    num = fm.block_mask.kv_num_blocks.view(-1).tolist()
    idx = fm.block_mask.kv_indices.view(-1)[: num[0]].tolist()
    assert num == [7]  # all 4 rows in one query block: 1 + 6 physical blocks
    assert sorted(idx) == [1, 2, 4, 5, 7, 9, 11]


def test_unavailable_reasons():
    assert paged_flex.unavailable_reason(CPU, 4) is None
    why = paged_flex.unavailable_reason(torch.device("cuda"), 8)
    assert why is not None and "block_size in (16, 32, 64, 128)" in why
    assert paged_flex.unavailable_reason(torch.device("cuda"), 16) is None


# ------------------------------------------------------------------ the runner's logits


def _runners():
    model, _ = load_model("tiny", "cpu", "float32")
    kw = dict(num_blocks=32, block_size=4, dtype=torch.float32, device=CPU)
    return {be: ModelRunner(model, attention_backend=be, **kw) for be in ("torch", "flex", "auto")}


def test_logits_match_torch_path_and_c_kernel():
    runners = _runners()
    assert runners["flex"].attention_backend == "flex"
    assert runners["torch"].attention_backend == "torch"
    g = torch.Generator().manual_seed(0)
    B = torch.randint(3, 40000, (21,), generator=g).tolist()
    C = torch.randint(3, 40000, (17,), generator=g).tolist()
    A = torch.randint(3, 40000, (10,), generator=g).tolist()
    tb, tc, ta = [3, 7, 1, 9, 12, 15], [2, 4, 5, 6, 8], [20, 21, 22]
    step1 = [BatchRow("B", 0, B[:20], tb, 0), BatchRow("C", 0, C[:13], tc, 0)]
    # step 2, one ragged batch: a fresh prefill chunk, a decode row, four verification rows,
    # and a prefix hit (D shares B's first two blocks and feeds its next 6 tokens)
    step2 = [
        BatchRow("A", 0, A, ta, 0),
        BatchRow("B", 20, B[20:21], tb, 0),
        BatchRow("C", 13, C[13:17], tc, 0),
        BatchRow("D", 8, B[8:14], [3, 7, 10, 11], 0),
    ]
    out = {}
    for be, r in runners.items():
        r.forward(step1)
        out[be] = r.forward(step2)
    assert out["flex"].shape == (10 + 1 + 4 + 6, runners["flex"].model.config.vocab_size)
    torch.testing.assert_close(out["flex"], out["torch"], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(out["flex"], out["auto"], atol=2e-4, rtol=1e-4)
    # D's rows are B's rows at the same positions: same logits as B computing them itself
    ref = runners["torch"].forward([BatchRow("B2", 0, B[:14], [16, 17, 18, 19], 8)])
    torch.testing.assert_close(out["flex"][-6:], ref, atol=2e-4, rtol=1e-4)


# ------------------------------------------------------------------ greedy tokens vs transformers

PROMPTS = [
    [1, 5, 7, 9, 11, 300, 400, 20],
    [1, 2, 3],
    [1] + list(range(100, 170)),
    [1] + list(range(100, 140)) + [7, 7, 9],
    [1, 42] * 9,
]


@pytest.fixture(scope="module")
def hf_ref():
    model, _ = load_model("tiny", "cpu", "float32")
    return hf_greedy(model, PROMPTS, 16)


def _generate(**cfg):
    llm = LLM(model="tiny", device="cpu", dtype="float32", attention_backend="flex", **cfg)
    assert llm.engine.info().attention_backend == "flex"
    outs = llm.generate([list(p) for p in PROMPTS], SamplingParams(max_tokens=16, ignore_eos=True))
    assert all(o.error is None for o in outs)
    return [o.outputs[0].token_ids for o in outs], llm.engine


@pytest.mark.parametrize(
    "cfg",
    [
        dict(num_kv_blocks=64, block_size=4),  # ragged batch
        dict(num_kv_blocks=64, block_size=4, max_num_batched_tokens=8),  # chunked prefill
        dict(num_kv_blocks=12, block_size=16, preemption_mode="recompute"),  # preemption under pressure
    ],
    ids=["ragged", "chunked", "preempt"],
)
def test_greedy_flex_identical_to_transformers(hf_ref, cfg):
    got, eng = _generate(**cfg)
    a = agreement(got, hf_ref)
    assert a.exact, a
    eng.check_invariants()


def test_prefix_hits_with_flex(hf_ref):
    llm = LLM(model="tiny", device="cpu", attention_backend="flex", num_kv_blocks=64, block_size=4)
    p = SamplingParams(max_tokens=16, ignore_eos=True)
    first = llm.generate([list(PROMPTS[2])], p)[0]
    second = llm.generate([list(PROMPTS[3])], p)[0]  # shares PROMPTS[2]'s first 41 tokens
    assert second.metrics.num_cached_tokens >= 40
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == [hf_ref[2], hf_ref[3]]


def test_verification_rows_with_flex(hf_ref):
    # early-exit self-draft always proposes: every step feeds k+1 verification rows per request
    spec = SpeculativeConfig(method="self_draft", num_speculative_tokens=3, draft_layers=1, enable_fallback=False)
    got, eng = _generate(num_kv_blocks=64, block_size=4, speculative=spec)
    assert got == hf_ref
    verifies = [e for e in eng.events if e.kind == "spec_verify"]
    assert len(verifies) >= 5


def test_flex_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match=r"attention_backend must be one of \('auto', 'torch', 'flex'\)"):
        EngineConfig(attention_backend="flash")


@pytest.mark.slow
def test_flex_on_the_default_model_identical_to_transformers():
    """The real default model (30 layers, 9/3 heads) through the flex path: a ragged batch with
    chunked prefill, greedy tokens vs transformers' generate."""
    from tests.engine.exact_ref import MAX_TOKENS, reference

    ids, refs = reference()
    idx = [0, 3, 4, 5]
    llm = LLM(model="default", attention_backend="flex", max_num_batched_tokens=128)
    assert llm.engine.info().attention_backend == "flex"
    outs = llm.generate([ids[i] for i in idx], SamplingParams(max_tokens=MAX_TOKENS))
    got = [o.outputs[0].token_ids for o in outs]
    a = agreement(got, [refs[i] for i in idx])
    assert a.exact, a
