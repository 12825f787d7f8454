"""The engine's CPU fast paths against their references: packed/merged Linears (engine/model/linear.py)
against F.linear, the in-place paged decode attention kernel (engine/model/csrc, engine/model/cpu_kernels.py)
against SDPA over gathered blocks, and whole engine runs with the fast paths on and off."""

import copy
import random

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.model import cpu_kernels, linear
from engine.model.models import tiny_config


def tiny_model(seed=0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    m = LlamaForCausalLM(tiny_config(vocab_size=512)).eval()
    m.requires_grad_(False)
    return m


# ----------------------------------------------------------------------------- packed linears

needs_pack = pytest.mark.skipif(linear.best_kernel() is None, reason="no packed-Linear kernel here")


@needs_pack
def test_pack_merges_qkv_and_gate_up_and_packs_every_linear():
    m = tiny_model()
    pack = linear.pack_model(m)
    assert linear.pack_model(m) is pack  # once per model object
    n_linear = sum(isinstance(x, torch.nn.Linear) for x in m.modules())
    assert pack.num_linears == n_linear
    assert pack.num_merged == 2 * m.config.num_hidden_layers  # qkv + gate_up per layer
    groups = {id(g): g for g, _ in pack.members.values()}.values()
    names = sorted(g.name for g in groups)
    assert names.count("qkv") == names.count("gate_up") == m.config.num_hidden_layers


@needs_pack
@pytest.mark.parametrize("rows", [1, 3, 16, 70])
def test_packed_linears_match_f_linear(rows):
    m = tiny_model()
    pack = linear.pack_model(m)
    attn, mlp = m.model.layers[0].self_attn, m.model.layers[0].mlp
    x = torch.randn(1, rows, m.config.hidden_size)
    with torch.inference_mode():
        ref = [F.linear(x, mod.weight) for mod in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)]
        with linear.packed_linears(pack):
            got = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), mlp.gate_proj(x), mlp.up_proj(x)]
        outside = [mod(x) for mod in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)]
    for g, r, o in zip(got, ref, outside):
        assert g.shape == r.shape
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
        assert torch.equal(o, r)  # outside the engine: plain F.linear, bit for bit


@needs_pack
def test_packed_rows_do_not_depend_on_the_batch():
    """A row's result is the same whatever else is in the batch (MKL's F.linear is not: it picks
    GEMV or GEMM kernels by row count)."""
    m = tiny_model()
    pack = linear.pack_model(m)
    lin = m.model.layers[1].mlp.down_proj
    x = torch.randn(33, lin.in_features)
    with torch.inference_mode(), linear.packed_linears(pack):
        alone = torch.cat([lin(x[i : i + 1]) for i in range(33)])
        batched = lin(x)
    assert torch.equal(alone, batched)


@needs_pack
def test_follower_called_with_another_input_is_still_right():
    m = tiny_model()
    pack = linear.pack_model(m)
    attn = m.model.layers[0].self_attn
    a, b = torch.randn(2, m.config.hidden_size), torch.randn(2, m.config.hidden_size)
    with torch.inference_mode(), linear.packed_linears(pack):
        attn.q_proj(a)
        kb = attn.k_proj(b)  # not the input q_proj saw: computed for b
        ka = attn.k_proj(a)
    torch.testing.assert_close(kb, F.linear(b, attn.k_proj.weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ka, F.linear(a, attn.k_proj.weight), rtol=1e-5, atol=1e-5)


@needs_pack
def test_deep_copy_of_a_packed_model_uses_its_own_weights():
    m = tiny_model()
    pack = linear.pack_model(m)
    c = copy.deepcopy(m)
    with torch.no_grad():
        c.model.layers[0].self_attn.o_proj.weight.mul_(2)
    lin = c.model.layers[0].self_attn.o_proj
    x = torch.randn(4, lin.in_features)
    with torch.inference_mode(), linear.packed_linears(pack):
        got = lin(x)
    assert torch.equal(got, F.linear(x, lin.weight))


@pytest.mark.parametrize("kernel", ["cpu_kernel", "onednn"])
def test_both_packed_kernels_match_f_linear_with_bias(kernel):
    if kernel == "cpu_kernel" and cpu_kernels.load() is None or kernel == "onednn" and linear.onednn_ops() is None:
        pytest.skip(f"{kernel} unavailable here")
    g = torch.Generator().manual_seed(3)
    w1, w2 = torch.randn(21, 33, generator=g), torch.randn(7, 33, generator=g)
    b = torch.randn(28, generator=g)
    mm = linear.matmul_for([w1, w2], b, kernel)
    for rows in (1, 2, 6, 7, 40):
        x = torch.randn(1, rows, 33, generator=g)
        ref = torch.cat([F.linear(x, w1, b[:21]), F.linear(x, w2, b[21:])], dim=-1)
        torch.testing.assert_close(mm(x), ref, rtol=1e-5, atol=1e-5)


def test_pack_skips_non_fp32():
    m = tiny_model().to(torch.bfloat16)
    pack = linear.pack_model(m)
    assert pack is None or pack.num_linears == 0


# ----------------------------------------------------------------------------- decode kernel

lib = cpu_kernels.load()
needs_kernel = pytest.mark.skipif(lib is None, reason=f"CPU kernel unavailable: {cpu_kernels.status()}")


def reference_decode(q, k_pool, v_pool, rows, lens, tables, scale):
    out = {}
    hkv, d = k_pool.shape[2], k_pool.shape[3]
    for s, n in enumerate(lens):
        blocks = torch.tensor(tables[s])
        k = k_pool[blocks].reshape(-1, hkv, d)[:n].transpose(0, 1)[None]
        v = v_pool[blocks].reshape(-1, hkv, d)[:n].transpose(0, 1)[None]
        out[rows[s]] = F.scaled_dot_product_attention(q[rows[s]][None, :, None], k, v, scale=scale, enable_gqa=True)[
            0, :, 0
        ]
    return out


@needs_kernel
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [
        (9, 3, 64, 16),
        (4, 4, 8, 1),
        (8, 1, 32, 5),
        (6, 2, 16, 32),
        (12, 4, 128, 16),
        (9, 3, 64, 5),
        (4, 2, 128, 1),
        (8, 4, 64, 16),
        (8, 2, 64, 3),
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("one_seq", [False, True])
def test_decode_kernel_matches_sdpa_over_gathered_blocks(heads, kv_heads, head_dim, block_size, threads, one_seq):
    """one_seq with 2 threads: fewer sequences than threads, so the fp32 path splits the heads."""
    rng = random.Random(heads * 100 + head_dim + block_size)
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    lens = [1, 2, block_size, block_size + 1, rng.randint(1, 300), rng.randint(1, 300), 700]
    if one_seq:
        lens = [700]
    need = sum(-(-n // block_size) for n in lens)
    nb = need + 7
    k_pool = torch.randn(nb, block_size, kv_heads, head_dim, generator=g) * 3
    v_pool = torch.randn(nb, block_size, kv_heads, head_dim, generator=g)
    perm = list(range(nb))
    rng.shuffle(perm)
    tables, off = [], 0
    width = max(-(-n // block_size) for n in lens)
    for n in lens:
        m = -(-n // block_size)
        tables.append(perm[off : off + m] + [perm[0]] * (width - m))  # padding entries are never read
        off += m
    T = len(lens) + 3
    rows = rng.sample(range(T), len(lens))
    q = torch.randn(T, heads, head_dim, generator=g)
    out = torch.full_like(q, 7.0)
    scale = head_dim**-0.5
    cpu_kernels.paged_decode_attention(
        lib,
        out,
        q,
        k_pool,
        v_pool,
        torch.tensor(rows, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        torch.tensor(tables, dtype=torch.int32),
        scale,
        max(lens),
        threads,
    )
    ref = reference_decode(q, k_pool, v_pool, rows, lens, tables, scale)
    for r, want in ref.items():
        torch.testing.assert_close(out[r], want, rtol=2e-5, atol=2e-6)
    untouched = [r for r in range(T) if r not in ref]
    assert torch.equal(out[untouched], torch.full_like(out[untouched], 7.0))


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 4), (8, 2)])
def test_a_kv_groups_heads_at_once_give_the_bits_of_head_by_head(heads, kv_heads):
    """D = 64: a KV group's query heads run together (each row loaded once for the group); split
    over 2 threads, one sequence's head ranges cut groups, whose heads then run one by one: every
    output is the same bits either way."""
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    bs, n = 16, 2100  # past MIN_PARALLEL_KEYS, so the wrapper keeps the 2 threads
    nb = -(-n // bs)
    k_pool = torch.randn(nb, bs, kv_heads, 64, generator=g)
    v_pool = torch.randn(nb, bs, kv_heads, 64, generator=g)
    q = torch.randn(1, heads, 64, generator=g)
    args = (
        torch.tensor([0], dtype=torch.int32),
        torch.tensor([n], dtype=torch.int32),
        torch.randperm(nb, generator=g).to(torch.int32)[None].contiguous(),
        0.125,
        n,
    )
    outs = []
    for threads in (1, 2):
        out = torch.empty_like(q)
        cpu_kernels.paged_decode_attention(lib, out, q, k_pool, v_pool, *args, threads)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@needs_kernel
def test_long_context_decode_split_into_segments_matches_sdpa_with_the_same_bits_at_any_thread_count():
    """Contexts of 2,048+ positions go in 2 or 4 position segments (csrc/paged_attention.c,
    kv_segments), each with its own max, merged after: within fp32 rounding of SDPA, and, the split
    being set by the length alone, the same bits on 1, 2 or 3 threads. A batch mixes split and
    unsplit sequences (2,047 / 2,048 / 4,095 / 4,096 / 8,000 positions), rows out of order."""
    g = torch.Generator().manual_seed(33)
    rng = random.Random(33)
    heads, kv_heads, d, bs = 9, 3, 64, 16
    lens = [2047, 8000, 2048, 300, 4096, 4095]
    need = sum(-(-n // bs) for n in lens)
    k_pool = torch.randn(need + 3, bs, kv_heads, d, generator=g) * 2
    v_pool = torch.randn(need + 3, bs, kv_heads, d, generator=g)
    perm = list(range(need + 3))
    rng.shuffle(perm)
    width = max(-(-n // bs) for n in lens)
    tables, off = [], 0
    for n in lens:
        m = -(-n // bs)
        tables.append(perm[off : off + m] + [perm[0]] * (width - m))
        off += m
    T = len(lens) + 2
    rows = rng.sample(range(T), len(lens))
    q = torch.randn(T, heads, d, generator=g)
    scale = d**-0.5
    args = (
        torch.tensor(rows, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        torch.tensor(tables, dtype=torch.int32),
        scale,
        max(lens),
    )
    ref = reference_decode(q, k_pool, v_pool, rows, lens, tables, scale)
    outs = []
    for threads in (1, 2, 3):
        out = torch.full_like(q, 7.0)
        cpu_kernels.paged_decode_attention(lib, out, q, k_pool, v_pool, *args, threads)
        outs.append(out)
        for r, want in ref.items():
            torch.testing.assert_close(out[r], want, rtol=2e-5, atol=2e-6)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    # one long sequence alone (batch-1 decode: at 2 threads its segments, not head ranges, split)
    one = [torch.empty(1, heads, d) for _ in range(2)]
    for out, threads in zip(one, (1, 2)):
        cpu_kernels.paged_decode_attention(
            lib,
            out,
            q[rows[1]][None].contiguous(),
            k_pool,
            v_pool,
            torch.tensor([0], dtype=torch.int32),
            torch.tensor([8000], dtype=torch.int32),
            torch.tensor([tables[1]], dtype=torch.int32),
            scale,
            8000,
            threads,
        )
    assert torch.equal(one[0], one[1]) and torch.equal(one[0][0], outs[0][rows[1]])


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim,n", [(9, 3, 64, 2048), (12, 4, 128, 4100), (8, 1, 64, 3000)])
def test_one_long_sequence_split_by_segments_and_heads_gives_the_same_bits(heads, kv_heads, head_dim, n):
    """One sequence on more threads than its segments: (segment, head range) items, each head's
    partial sums written by whichever item holds it; the same bits on 1, 2, 3 or 5 threads."""
    g = torch.Generator().manual_seed(n)
    bs = 16
    nb = -(-n // bs) + 2
    k_pool = torch.randn(nb, bs, kv_heads, head_dim, generator=g) * 2
    v_pool = torch.randn(nb, bs, kv_heads, head_dim, generator=g)
    table = torch.randperm(nb, generator=g)[: -(-n // bs)].to(torch.int32)[None].contiguous()
    q = torch.randn(1, heads, head_dim, generator=g)
    scale = head_dim**-0.5
    want = reference_decode(q, k_pool, v_pool, [0], [n], table.tolist(), scale)[0]
    outs = []
    for threads in (1, 2, 3, 5):
        out = torch.empty_like(q)
        one = torch.tensor([0], dtype=torch.int32)
        cpu_kernels.paged_decode_attention(
            lib, out, q, k_pool, v_pool, one, torch.tensor([n], dtype=torch.int32), table, scale, n, threads
        )
        torch.testing.assert_close(out[0], want, rtol=2e-5, atol=2e-6)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@needs_kernel
def test_decode_kernel_large_scores_do_not_overflow():
    k_pool = torch.full((2, 4, 1, 8), 30.0)
    v_pool = torch.randn(2, 4, 1, 8)
    q = torch.full((1, 2, 8), 30.0)
    out = torch.empty_like(q)
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    cpu_kernels.paged_decode_attention(
        lib,
        out,
        q,
        k_pool,
        v_pool,
        torch.tensor([0], dtype=torch.int32),
        torch.tensor([7], dtype=torch.int32),
        tables,
        1.0,
        7,
        1,
    )
    want = v_pool.reshape(-1, 1, 8)[:7, 0].mean(0)
    torch.testing.assert_close(out[0, 0], want, rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("n,k", [(1, 1), (16, 64), (17, 576), (960, 576), (5, 1536), (100, 7), (112, 64), (200, 33)])
def test_linear_kernel_matches_f_linear_at_every_row_count(n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    panels = cpu_kernels.pack_linear(lib, w)
    xs = torch.randn(70, k, generator=g)
    full = cpu_kernels.linear(lib, xs, panels, n, None, 2)
    torch.testing.assert_close(full, F.linear(xs, w), rtol=1e-4, atol=1e-5 * max(1, k**0.5))
    for rows in (1, 2, 5, 6, 7, 13):  # every microkernel tile height, and a batch-invariant result
        assert torch.equal(cpu_kernels.linear(lib, xs[:rows], panels, n, None, 1), full[:rows])
    b = torch.randn(n, generator=g)
    full_b = cpu_kernels.linear(lib, xs, panels, n, b, 2)
    for threads in (1, 2, 3):  # one row takes its own path (panels in groups of 4 and 2)
        assert torch.equal(cpu_kernels.linear(lib, xs[:1], panels, n, None, threads), full[:1])
        assert torch.equal(cpu_kernels.linear(lib, xs[:1], panels, n, b, threads), full_b[:1])


@needs_kernel
def test_linear_kernel_rejects_a_weight_of_the_wrong_size():
    panels = cpu_kernels.pack_linear(lib, torch.randn(16, 8))
    with pytest.raises(ValueError, match="packed weight"):
        cpu_kernels.linear(lib, torch.randn(2, 9), panels, 16)
    with pytest.raises(ValueError, match="2-D float32"):
        cpu_kernels.pack_linear(lib, torch.randn(4, 4, dtype=torch.float64))


def test_kernel_status_names_why_when_disabled(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("KVSCOPE_CPU_KERNELS", "0")
    assert cpu_kernels.load() is None
    assert "KVSCOPE_CPU_KERNELS=0" in cpu_kernels.status()


def test_kernel_supports_shapes():
    assert cpu_kernels.supports(9, 3, 64)
    assert not cpu_kernels.supports(9, 3, 60)  # head_dim not a multiple of 8
    assert not cpu_kernels.supports(9, 2, 64)  # not a whole number of query heads per KV head
    assert not cpu_kernels.supports(9, 3, 512)


# ----------------------------------------------------------------------------- whole engine

PROMPTS = [
    "hello world",
    "the cat sat on the mat and the cat sat on the",
    "1 2 3 4 5 6 7 8",
    "x",
    "Once upon a time " * 20,
]


def generate(**cfg):
    llm = LLM(model="tiny", num_kv_blocks=128, block_size=4, **cfg)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    llm.engine.check_invariants()
    return [o.outputs[0].token_ids for o in outs], llm.engine


def test_engine_fast_paths_give_the_reference_paths_tokens():
    fast, eng = generate()
    slow, eng_ref = generate(linear_backend="torch", attention_backend="torch")
    assert fast == slow
    assert eng_ref.runner.linear_pack is None and eng_ref.runner.decode_kernel is None
    if lib is not None:
        assert eng.runner.decode_kernel is not None
    assert eng.info().linear_backend == (eng.runner.linear_pack.kernel if eng.runner.linear_pack else "torch")
    assert eng_ref.info().linear_backend == "torch"
    assert eng_ref.info().attention_backend == "torch"


@needs_kernel
def test_few_tokens_after_context_go_through_the_kernel_and_match_sdpa():
    """A verification-sized feed (5 tokens after 13 of context, next to a plain decode row) is
    attended by the decode kernel, one row per token; its logits equal the SDPA path's and those
    of one prefill over all 18 tokens (up to fp32 rounding)."""
    from engine.model.runner import BatchRow, ModelRunner

    m = tiny_model(3)
    g = torch.Generator().manual_seed(5)
    a = torch.randint(0, 512, (18,), generator=g).tolist()
    b = torch.randint(0, 512, (9,), generator=g).tolist()
    out = {}
    for backend in ("auto", "torch"):
        r = ModelRunner(
            m, num_blocks=16, block_size=4, dtype=torch.float32, device=torch.device("cpu"), attention_backend=backend
        )
        ta, tb = [3, 7, 1, 12, 5], [9, 2, 14]
        r.forward([BatchRow("a", 0, a[:13], ta, -1), BatchRow("b", 0, b[:8], tb, -1)])
        rows = [BatchRow("a", 13, a[13:], ta, 0), BatchRow("b", 8, b[8:], tb, 0)]
        meta = r.build_metadata(rows)[2]
        if backend == "auto":
            assert meta.decode_kernel is not None and not meta.prefills
            assert meta.decode_lens32.tolist() == [14, 15, 16, 17, 18, 9]
        else:
            assert len(meta.prefills) == 1 and meta.prefills[0].q_len == 5
        out[backend] = r.forward(rows)
        whole = r.forward([BatchRow("a", 0, a, [0, 2, 4, 6, 8], 13)])
        torch.testing.assert_close(out[backend][:5], whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out["auto"], out["torch"], rtol=1e-4, atol=1e-5)
