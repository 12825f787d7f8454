"""The tiled causal prefill kernel (csrc/paged_attention.c, kvscope_paged_prefill) against torch
SDPA over the gathered blocks, its independence from chunking and threads, the row dispatcher the
C stack calls (a prefill chunk's run to the tiled kernel, other rows to the decode kernel), and a
whole C-stack forward at head dim 64 against transformers' own forward."""

import random

import pytest
import torch
import torch.nn.functional as F

from engine.model import cpu_kernels

lib = cpu_kernels.load()
pytestmark = pytest.mark.skipif(lib is None, reason=f"CPU kernel unavailable: {cpu_kernels.status()}")


def pools(nb, bs, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(nb, bs, hkv, d, generator=g) * 2, torch.randn(nb, bs, hkv, d, generator=g)


def sdpa_rows(q_rows, k_pool, v_pool, table, start, scale):
    """Reference: rows q_rows [n, H, D] at positions start.., causal over the gathered context."""
    n, hkv, d = q_rows.shape[0], k_pool.shape[2], k_pool.shape[3]
    L = start + n
    k = k_pool[table.long()].reshape(-1, hkv, d)[:L].transpose(0, 1)[None]
    v = v_pool[table.long()].reshape(-1, hkv, d)[:L].transpose(0, 1)[None]
    mask = torch.arange(L)[None, :] <= (torch.arange(n)[:, None] + start)
    qq = q_rows.transpose(0, 1)[None]
    return F.scaled_dot_product_attention(qq, k, v, attn_mask=mask[None, None], scale=scale, enable_gqa=True)[
        0
    ].transpose(0, 1)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,bs",
    [(9, 3, 64, 16), (12, 4, 128, 16), (8, 8, 64, 5), (4, 1, 128, 1), (6, 2, 64, 7)],
)
@pytest.mark.parametrize("start,n", [(0, 1), (0, 16), (0, 130), (37, 100), (300, 17), (64, 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_kernel_matches_sdpa(heads, kv_heads, head_dim, bs, start, n, threads):
    rng = random.Random(heads * 1000 + start * 7 + n)
    L = start + n
    need = -(-L // bs)
    nb = need + 5
    k_pool, v_pool = pools(nb, bs, kv_heads, head_dim, rng.randrange(1 << 30))
    table = torch.tensor(rng.sample(range(nb), need), dtype=torch.int32)
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    T = n + 4  # the run sits at rows 3 .. 3 + n - 1 of a bigger batch
    q = torch.randn(T, heads, head_dim, generator=g)
    out = torch.full_like(q, 7.0)
    scale = head_dim**-0.5
    cpu_kernels.paged_prefill_attention(lib, out, q, k_pool, v_pool, 3, n, start, table, scale, threads)
    want = sdpa_rows(q[3 : 3 + n], k_pool, v_pool, table, start, scale)
    torch.testing.assert_close(out[3 : 3 + n], want, rtol=5e-5, atol=5e-6)
    rest = torch.cat([out[:3], out[3 + n :]])
    assert torch.equal(rest, torch.full_like(rest, 7.0))


@pytest.mark.parametrize(
    "L,splits",
    [
        (400, [([100, 300], 2), ([17, 150, 233], 1), ([200, 200], 2)]),
        # the query tile grows with the context (16 positions below 1,024, 32 below 4,096, then 64)
        (4200, [([1000, 3200], 2), ([3000, 1200], 1), ([900, 1100, 2200], 2)]),
    ],
)
def test_a_rows_bits_do_not_depend_on_chunks_or_threads(L, splits):
    """Key tiles sit at absolute positions: the same query at the same position gives the same
    bits whether its prompt came in one run or in chunks (of any query tile size), on 1 thread or 2."""
    heads, hkv, d, bs = 9, 3, 64, 16
    k_pool, v_pool = pools(-(-L // bs) + 2, bs, hkv, d, 11)
    table = torch.arange(-(-L // bs), dtype=torch.int32)
    q = torch.randn(L, heads, d, generator=torch.Generator().manual_seed(3))
    whole = torch.empty_like(q)
    cpu_kernels.paged_prefill_attention(lib, whole, q, k_pool, v_pool, 0, L, 0, table, 0.125, 1)
    for chunks, threads in splits:
        out = torch.empty_like(q)
        s = 0
        for c in chunks:
            cpu_kernels.paged_prefill_attention(lib, out, q, k_pool, v_pool, s, c, s, table, 0.125, threads)
            s += c
        assert torch.equal(out, whole)


def test_rows_dispatcher_sends_a_run_to_the_tiled_kernel_and_the_rest_row_by_row():
    """A batch of: one decode row, a 40-row prefill chunk after 25 tokens of context, a 5-row
    verification feed (too short for the tiled kernel), another decode row. The chunk's rows get
    the tiled kernel's bits, the others the decode kernel's, all within rounding of SDPA."""
    heads, hkv, d, bs = 9, 3, 64, 16
    nb = 40
    k_pool, v_pool = pools(nb, bs, hkv, d, 5)
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    ta, tb, tc, td = perm[0:2], perm[2:7], perm[7:9], perm[9:13]
    # (table, positions) per row: a decode at 20; chunk 25..64; verify 20..24; decode at 50
    rows = [(ta, 19)] + [(tb, p) for p in range(25, 65)] + [(tc, p) for p in range(20, 25)] + [(td, 50)]
    T = len(rows)
    width = max(len(t) for t, _ in rows)
    tables = torch.stack([torch.cat([t, t[-1:].repeat(width - len(t))]) for t, _ in rows]).contiguous()
    lens = torch.tensor([p + 1 for _, p in rows], dtype=torch.int32)
    q = torch.randn(T, heads, d, generator=torch.Generator().manual_seed(9))
    out = torch.empty_like(q)
    q_rows = torch.arange(T, dtype=torch.int32)
    cpu_kernels.paged_attention_rows(lib, out, q, k_pool, v_pool, q_rows, lens, tables, 0.125, int(lens.max()), 2)
    tiled = torch.empty_like(q)
    cpu_kernels.paged_prefill_attention(lib, tiled, q, k_pool, v_pool, 1, 40, 25, tb, 0.125, 1)
    assert torch.equal(out[1:41], tiled[1:41])
    dec = torch.empty_like(q)
    other = [0, *range(41, T)]
    cpu_kernels.paged_decode_attention(
        lib, dec, q, k_pool, v_pool, q_rows[other].contiguous(), lens[other].contiguous(),
        tables[other].contiguous(), 0.125, int(lens.max()), 1,
    )  # fmt: skip
    assert torch.equal(out[other], dec[other])
    for i, (t, p) in enumerate(rows):
        want = sdpa_rows(q[i : i + 1], k_pool, v_pool, t, p, 0.125)
        torch.testing.assert_close(out[i : i + 1], want, rtol=5e-5, atol=5e-6)


def test_two_requests_sharing_blocks_are_not_one_run():
    """Rows of two sequences that happen to be consecutive in position and batch, but whose later
    blocks differ, are not one run (the dispatcher checks that each table is the next one's prefix)."""
    heads, hkv, d, bs = 4, 2, 64, 4
    k_pool, v_pool = pools(20, bs, hkv, d, 2)
    shared = [0, 1]
    a = torch.tensor(shared + [2, 3, 4, 5], dtype=torch.int32)  # rows at positions 8..23
    b = torch.tensor(shared + list(range(6, 14)), dtype=torch.int32)  # rows at positions 24..39
    rows = [(a, p) for p in range(8, 24)] + [(b, p) for p in range(24, 40)]
    width = 10
    tables = torch.stack([torch.cat([t, t[-1:].repeat(width - len(t))]) for t, _ in rows]).contiguous()
    lens = torch.tensor([p + 1 for _, p in rows], dtype=torch.int32)
    q = torch.randn(len(rows), heads, d, generator=torch.Generator().manual_seed(4))
    out = torch.empty_like(q)
    q_rows = torch.arange(len(rows), dtype=torch.int32)
    cpu_kernels.paged_attention_rows(lib, out, q, k_pool, v_pool, q_rows, lens, tables, 0.125, 40, 1)
    for i, (t, p) in enumerate(rows):
        want = sdpa_rows(q[i : i + 1], k_pool, v_pool, t, p, 0.125)
        torch.testing.assert_close(out[i : i + 1], want, rtol=5e-5, atol=5e-6)


def test_c_stack_prefill_at_head_dim_64_matches_transformers():
    """A Llama of head dim 64 (the default model's), a 300-token prompt in chunks of 128 through the
    C stack (prefill rows through the tiled kernel): the last position's logits match transformers'
    own forward, and greedy decoding gives transformers' tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.model.runner import BatchRow, ModelRunner

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=192,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    r = ModelRunner(m, num_blocks=40, block_size=16, dtype=torch.float32, device=torch.device("cpu"))
    if r.fused is None:
        pytest.skip(f"the C stack does not run here: {r.decode_backend_reason}")
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    table = list(range(20))
    logits = None
    for s in range(0, 300, 128):
        chunk = ids[s : s + 128]
        logits = r.forward([BatchRow("a", s, chunk, table, len(chunk) - 1)])
    with torch.inference_mode():
        want = m(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(logits[0], want, rtol=1e-4, atol=1e-4)
    toks, pos = [], 300
    nxt = int(logits[0].argmax())
    for _ in range(8):
        toks.append(nxt)
        nxt = int(r.forward([BatchRow("a", pos, [nxt], table, 0)])[0].argmax())
        pos += 1
    with torch.inference_mode():
        ref = m.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, 300:].tolist()
    assert toks == ref
