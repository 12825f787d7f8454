"""max_model_len unset = the model's own limit (max_position_embeddings), memory permitting
(engine/core/pool_sizing.py resolve_max_model_len), on real engines of the tiny model (limit 8192,
512 K/V bytes per token in fp32)."""

from __future__ import annotations

import pytest

from engine import LLMEngine, SamplingParams
from engine.core import engine as engine_module
from engine.core import pool_sizing

MiB = 2**20


def test_unset_is_the_model_limit_and_the_default_pool_is_unchanged():
    eng = LLMEngine(model="tiny", num_threads=1)
    assert eng.config.max_model_len == eng.info().max_model_len == 8192
    assert eng.max_model_len_note is None
    # 256 MiB of 512-byte tokens, capped: the same pool as before the default changed
    assert eng.num_blocks == pool_sizing.MAX_DEFAULT_BLOCKS
    with pytest.raises(ValueError, match=r"^prompt is 8200 tokens; max_model_len is 8192 "):
        eng.add_request("too-long", list(range(100, 8300)), SamplingParams(max_tokens=1))
    eng.add_request("fits", list(range(100, 2200)), SamplingParams(max_tokens=1))  # over the old 2048


def test_explicit_max_model_len_is_kept():
    eng = LLMEngine(model="tiny", num_threads=1, num_kv_blocks=16, max_model_len=128)
    assert eng.config.max_model_len == 128 and eng.max_model_len_note is None


def test_a_small_pool_the_user_sized_keeps_the_model_limit_with_a_warning(caplog):
    with caplog.at_level("WARNING", logger="engine.core.engine"):
        eng = LLMEngine(model="tiny", num_threads=1, num_kv_blocks=8)
    assert eng.config.max_model_len == 8192
    assert eng.max_model_len_note.endswith(
        "the pool (num_kv_blocks=8) holds 128 tokens (0.1 MiB); a request longer than 128 tokens is refused"
    )
    assert eng.max_model_len_note in caplog.text
    with pytest.raises(ValueError, match=r"^request needs up to \d+ KV blocks \(\d+ tokens\) but the pool has 8"):
        eng.add_request("r", list(range(100, 300)), SamplingParams(max_tokens=1))


@pytest.fixture
def three_mib(monkeypatch):
    """3 MiB available: block_size 1 makes the default pool 4096 one-token blocks (2 MiB); one
    8192-token sequence (4 MiB) would take more than 90 % of it."""
    monkeypatch.setattr(engine_module, "available_bytes", lambda device: 3 * MiB)


def test_unset_drops_to_what_memory_permits_with_a_message(three_mib, caplog):
    with caplog.at_level("WARNING", logger="engine.core.engine"):
        eng = LLMEngine(model="tiny", num_threads=1, block_size=1)
    assert eng.num_blocks == 4096
    assert eng.config.max_model_len == eng.info().max_model_len == 4096
    assert eng.max_model_len_note == (
        "one sequence of max_model_len=8192 tokens needs 4.0 MiB of KV cache; the pool "
        f"(kv_cache_bytes={256 * MiB}) holds 4096 tokens (2.0 MiB); max_model_len is 4096 (the model's limit "
        "is 8192: give the pool more memory with kv_cache_bytes for the full length)"
    )
    assert "max_model_len is 4096" in caplog.text


def test_explicit_max_model_len_memory_cannot_hold_is_refused_at_startup(three_mib):
    with pytest.raises(ValueError) as e:
        LLMEngine(model="tiny", num_threads=1, block_size=1, max_model_len=8192)
    assert str(e.value) == (
        "one sequence of max_model_len=8192 tokens needs 4.0 MiB of KV cache; the pool "
        f"(kv_cache_bytes={256 * MiB}) holds 4096 tokens (2.0 MiB). Lower max_model_len to at most 4096, or give "
        "the pool more memory (kv_cache_bytes, num_kv_blocks or gpu_memory_utilization)"
    )
    LLMEngine(model="tiny", num_threads=1, block_size=1, max_model_len=4096)  # what fits starts


def test_default_pool_grows_for_the_model_limit_where_memory_permits(monkeypatch):
    monkeypatch.setattr(engine_module, "available_bytes", lambda device: 64 * MiB)
    eng = LLMEngine(model="tiny", num_threads=1, block_size=1)
    assert eng.num_blocks == 8192 and eng.config.max_model_len == 8192 and eng.max_model_len_note is None


def test_over_the_model_limit_names_it():
    with pytest.raises(ValueError, match=r"^max_model_len=8193 exceeds the model's max_position_embeddings=8192$"):
        LLMEngine(model="tiny", num_threads=1, num_kv_blocks=16, max_model_len=8193)
