"""The C whole-stack path (engine/model/fused_decode.py) against the transformers layer code on the
same runner inputs: logits per case within a tight bound (the max abs difference is printed),
greedy tokens identical, and the config choice validated."""

from __future__ import annotations

import pytest
import torch

from engine.model import fused_decode
from engine.model.runner import BatchRow, ModelRunner
from tests.engine import c_stack


@pytest.fixture(scope="module")
def default_model():
    from engine.model.models import load_model

    model, tok = load_model("default")
    return model, tok


_runner = c_stack.runner


@pytest.mark.parametrize("fmt", ["gguf", "fp32"])
def test_logits_match_transformers_layers(default_model, fmt):
    model, tok = default_model
    ref, got = _runner(model, "transformers", fmt), _runner(model, "c", fmt)
    assert got.decode_backend == "c" and ref.decode_backend == "transformers"
    prompt = tok.encode("The capital of France is")
    table_a, table_b = list(range(0, 4)), list(range(8, 12))
    worst = 0.0
    cases = [
        # prefill of one request (every row's logits), then ragged decode + verify rows
        [BatchRow("a", 0, prompt, table_a, 0)],
        [BatchRow("a", len(prompt), [42], table_a, 0), BatchRow("b", 0, prompt[:3], table_b, 2)],
        [BatchRow("a", len(prompt) + 1, [7, 8, 9], table_a, 0), BatchRow("b", 3, [11], table_b, 0)],
    ]
    for rows in cases:
        a, b = ref.forward(rows), got.forward(rows)
        diff = (a - b).abs().max().item()
        worst = max(worst, diff)
        print(f"[{fmt}] rows {[(r.start, len(r.tokens)) for r in rows]}: max |logit diff| = {diff:.3e}")
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        assert diff < 2e-3
    for la, lb in zip(ref.kv_caches, got.kv_caches):
        assert (la[0] - lb[0]).abs().max().item() < 1e-3
    print(f"[{fmt}] worst max |logit diff| = {worst:.3e}")


def test_greedy_tokens_match_generate(default_model):
    model, tok = default_model
    r = _runner(model, "c")
    prompt = tok.encode("Once upon a time")
    table = list(range(0, 4))
    out = []
    logits = r.forward([BatchRow("a", 0, prompt, table, len(prompt) - 1)])
    pos = len(prompt)
    for _ in range(12):
        nxt = int(logits[-1].argmax())
        out.append(nxt)
        logits = r.forward([BatchRow("a", pos, [nxt], table, 0)])
        pos += 1
    with torch.inference_mode():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
    assert out == ref


def test_choice_validated(default_model):
    model, _ = default_model
    with pytest.raises(ValueError, match="decode_backend must be one of"):
        _runner(model, "fast")
    with pytest.raises(ValueError, match="decode_backend='c': kv_cache_dtype"):
        ModelRunner(
            model,
            num_blocks=8,
            block_size=16,
            dtype=torch.float32,
            device=torch.device("cpu"),
            kv_cache_dtype="int8",
            decode_backend="c",
        )
    assert fused_decode.DECODE_BACKENDS == ("auto", "c", "transformers")


def test_engine_config_names_the_choice():
    from engine import EngineConfig

    assert EngineConfig(model="tiny").decode_backend == "auto"
    with pytest.raises(ValueError, match="decode_backend must be one of"):
        EngineConfig(model="tiny", decode_backend="cuda")


def test_same_bits_at_one_and_two_threads(default_model):
    """From 8 rows layer.c splits its per-row ops (norms, rope + K/V write, residual adds, SiLU) over
    the threads, and the Linears and attention split their work too: none of it may change a bit.
    A 70-row prefill chunk, then 9 three-token prefills (27 rows), then 9 decode rows beside a 4-row
    verify run, each step at 1 thread and at 2 on fresh runners: logits and every layer's K/V equal
    bitwise."""
    model, tok = default_model
    prompt = tok.encode("The quick brown fox jumps over the lazy dog. " * 7)[:70]
    assert len(prompt) == 70
    steps = [
        [BatchRow("p", 0, prompt, list(range(0, 5)), 0)],
        [BatchRow(f"s{i}", 0, prompt[i : i + 3], [10 + i], 2) for i in range(9)],
        [BatchRow(f"s{i}", 3, [prompt[i + 3]], [10 + i], 0) for i in range(9)]
        + [BatchRow("p", 70, [5, 6, 7, 8], list(range(0, 5)), 0)],
    ]
    before = torch.get_num_threads()
    got = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            r = _runner(model, "c")
            got[n] = ([r.forward(rows) for rows in steps], [(k.clone(), v.clone()) for k, v in r.kv_caches])
    finally:
        torch.set_num_threads(before)
    (l1, kv1), (l2, kv2) = got[1], got[2]
    assert all(torch.equal(a, b) for a, b in zip(l1, l2))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(kv1, kv2))


def test_kv_prefetch_changes_no_bits(default_model):
    """From 8 decode rows the stack's Linears prefetch the next layer's K/V (csrc/layer.c,
    kv_side_plan): 12 decode rows, 4 of them sharing their first block as prefix-cache hits do, and a
    3-row verify run, at 2 threads with the prefetch off and on (and an 80-row prefill chunk, where
    the plan is off): logits and every layer's K/V equal bitwise."""
    from engine.model import cpu_kernels

    model, tok = default_model
    lib = cpu_kernels.load()
    prompt = tok.encode("A stitch in time saves nine, and the early bird catches the worm. " * 6)[:80]
    shared = [20, 21]  # the blocks of the first 32 positions, shared by s0..s3

    def table(i):
        return shared + [6 + i] if i < 4 else [24 + 3 * (i - 4) + j for j in range(3)]

    steps = [
        [BatchRow("p", 0, prompt, list(range(0, 6)), 0)],
        [BatchRow(f"s{i}", 0, prompt[: 33 + i], table(i), 2) for i in range(12)],
        [BatchRow(f"s{i}", 33 + i, [prompt[i]], table(i), 0) for i in range(12)]
        + [BatchRow("p", 80, [5, 6, 7], list(range(0, 6)), 0)],
    ]
    before, setting = torch.get_num_threads(), cpu_kernels.kv_side_step(lib)
    got = {}
    try:
        torch.set_num_threads(2)
        for step in (0, 8):
            cpu_kernels.kv_side_step(lib, step)
            r = _runner(model, "c")
            got[step] = ([r.forward(rows) for rows in steps], [(k.clone(), v.clone()) for k, v in r.kv_caches])
    finally:
        torch.set_num_threads(before)
        cpu_kernels.kv_side_step(lib, setting)
    (l0, kv0), (l8, kv8) = got[0], got[8]
    assert all(torch.equal(a, b) for a, b in zip(l0, l8))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(kv0, kv8))


def test_rope_table_rows_are_the_modules_bits(default_model):
    """FusedStack.rope picks rows of a table the model's rotary module computed once: for positions
    across the first table and past it (the table grows), the same bits as the module on exactly
    those positions; a RoPE type that changes with the length gets the module every step."""
    model, _ = default_model
    st = _runner(model, "c").fused
    h = torch.zeros(1, model.config.hidden_size)
    rotary = model.model.rotary_emb
    for pos in ([0], [5, 6, 7, 8], [1023, 1024, 4000], [17, 3, 2047, 0, 900]):
        cos, sin = st.rope(h, pos)
        ref_cos, ref_sin = rotary(h.unsqueeze(0), position_ids=torch.tensor(pos).unsqueeze(0))
        assert torch.equal(cos, ref_cos[0].float()) and torch.equal(sin, ref_sin[0].float())
    assert st.rope_table[0].shape[0] == 4096
    st.rope_static = False
    cos, _ = st.rope(h, [3, 4])
    assert torch.equal(cos, rotary(h.unsqueeze(0), position_ids=torch.tensor([[3, 4]]))[0][0].float())


def test_small_steps_reuse_their_buffers_and_change_no_bits(default_model):
    """Steps of up to BUF_ROWS rows run on buffers FusedStack keeps across steps (the embedding rows,
    cos / sin, the stack's scratch, the final norm's rows): the same logits and K/V, bit for bit, as
    the same steps on a runner that drops them before every step, and a step's logits are not
    overwritten by the next step."""
    model, tok = default_model
    cases = c_stack.ragged_cases(tok)
    steps = cases + [
        [BatchRow("a", 40, [5], list(range(0, 8)), 0)],
        [BatchRow("b", 21, [3, 4], list(range(16, 24)), 0)],
    ]
    kept, fresh = _runner(model, "c"), _runner(model, "c")
    out_kept, out_fresh = [], []
    for rows in steps:
        out_kept.append(kept.forward(rows))
        fresh.fused.bufs = {}
        out_fresh.append(fresh.forward(rows))
    assert any(k[0] == "h" for k in kept.fused.bufs if isinstance(k, tuple))  # the small steps used them
    assert all(torch.equal(a, b) for a, b in zip(out_kept, out_fresh))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(kept.kv_caches, fresh.kv_caches))
    storages = {t.untyped_storage().data_ptr() for t in kept.fused.bufs.values()}
    assert not any(x.untyped_storage().data_ptr() in storages for x in out_kept)


def test_a_token_id_outside_the_embedding_is_a_clear_error(default_model):
    """The C path gathers embedding rows itself: an id past the table (the engine's input checks
    refuse it first; this is the kernel's own guard) raises, naming it, and reads nothing."""
    model, _ = default_model
    r = _runner(model, "c")
    vocab = model.model.embed_tokens.weight.shape[0]
    for bad in (vocab, vocab + 7, -1):
        with pytest.raises(ValueError, match=f"token id {bad} is outside \\[0, {vocab}\\)"):
            r.forward([BatchRow("a", 0, [5, bad, 6], list(range(0, 4)), 2)])
