"""Prefix-cache block hashes, computed as vLLM computes them, so a kvscope engine and a vLLM engine
give the same hash to the same tokens (and a fleet mixing both has one hash space).

vLLM's rule (vLLM 0.32 / 0.33: vllm/v1/core/kv_cache_utils.py `hash_block_tokens`,
`init_none_hash` / `resolve_none_hash_seed`, `generate_block_hash_extra_keys`,
`to_event_extra_keys`, `maybe_convert_block_hash`; the hash functions in vllm/utils/hashing.py):

- a full block's hash is `hash_fn((parent_hash, tuple(token_ids), extra_keys))`, where
  parent_hash is the previous block's hash, or NONE_HASH for a prompt's first block;
- NONE_HASH = `hash_fn(seed)`: the seed is PYTHONHASHSEED's string when that variable is set,
  else the fixed "vllm-none-hash" (vLLM's DEFAULT_NONE_HASH_SEED for its cryptographic choices;
  earlier vLLM drew 32 random bytes instead). Engines that must agree need the same
  PYTHONHASHSEED, or none;
- extra_keys is None, or a tuple of tagged keys that also identify the block: kvscope has one, the
  request's cache_salt, as ("cache_salt", salt) on the first block only (later blocks inherit it
  through the chain). KV events carry the untagged form, (salt,), as vLLM's do
  (`event_extra_keys`);
- `prefix_caching_hash_algo` picks hash_fn: "sha256" (vLLM's default) is SHA-256 over
  `pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)`; "sha256_cbor" is SHA-256 over canonical
  CBOR (`cbor2.dumps(obj, canonical=True)`), written out here for the few types a block key holds
  (bytes, ints, strings, None, tuples) so no CBOR package is needed. vLLM's xxhash choices need
  the xxhash package (and a random seed) and are not offered;
- KV events publish a hash as its low 64 bits read big-endian, an unsigned int (vLLM's default,
  VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): `engine.observe.kv_event_wire.published_hash`.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct

from engine.config import PREFIX_HASH_ALGOS as ALGOS

DEFAULT_ALGO = "sha256"
FALLBACK_SEED = "vllm-none-hash"  # NONE_HASH's seed without PYTHONHASHSEED (vLLM's DEFAULT_NONE_HASH_SEED)


def sha256_pickle(obj) -> bytes:
    """vLLM's `sha256`: SHA-256 of the object pickled with the highest protocol."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for extra, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | extra]) + struct.pack(fmt, n)
    raise ValueError(f"CBOR: integer {n} needs a bignum (not used in block keys)")


def cbor_canonical(obj) -> bytes:
    """Canonical CBOR (shortest heads, definite lengths) of None / bool / int / bytes / str /
    tuple / list, byte for byte what `cbor2.dumps(obj, canonical=True)` writes for them."""
    if obj is None:
        return b"\xf6"
    if obj is True:
        return b"\xf5"
    if obj is False:
        return b"\xf4"
    if isinstance(obj, int):
        return _cbor_head(0, obj) if obj >= 0 else _cbor_head(1, -1 - obj)
    if isinstance(obj, (bytes, bytearray)):
        return _cbor_head(2, len(obj)) + bytes(obj)
    if isinstance(obj, str):
        b = obj.encode("utf-8", "surrogatepass")
        return _cbor_head(3, len(b)) + b
    if isinstance(obj, (tuple, list)):
        return _cbor_head(4, len(obj)) + b"".join(cbor_canonical(x) for x in obj)
    raise TypeError(f"CBOR: {type(obj).__name__} is not a block-key type")


def sha256_cbor(obj) -> bytes:
    """vLLM's `sha256_cbor`: SHA-256 of the canonical CBOR encoding."""
    return hashlib.sha256(cbor_canonical(obj)).digest()


HASH_FUNCTIONS = {"sha256": sha256_pickle, "sha256_cbor": sha256_cbor}


def check_algo(algo) -> str:
    if algo not in HASH_FUNCTIONS:
        raise ValueError(f"prefix_caching_hash_algo must be one of {ALGOS}, got {algo!r}")
    return algo


def hash_seed(seed: str | None = None) -> str:
    """The NONE_HASH seed: `seed` if given, else PYTHONHASHSEED, else FALLBACK_SEED."""
    if seed is not None:
        return seed
    return os.environ.get("PYTHONHASHSEED") or FALLBACK_SEED


def none_hash(algo: str = DEFAULT_ALGO, seed: str | None = None) -> bytes:
    """vLLM's NONE_HASH: the hash function applied to the seed string."""
    return HASH_FUNCTIONS[check_algo(algo)](hash_seed(seed))


def block_extra_keys(block_index: int, cache_salt: str | None) -> tuple | None:
    """The extra keys hashed with block `block_index`: (("cache_salt", salt),) on the first block
    of a salted request, else None (vLLM's generate_block_hash_extra_keys without LoRA /
    multimodal)."""
    return (("cache_salt", cache_salt),) if block_index == 0 and cache_salt else None


def event_extra_keys(block_index: int, cache_salt: str | None) -> tuple | None:
    """The same keys as KV events carry them, untagged (vLLM's to_event_extra_keys): (salt,)."""
    return (cache_salt,) if block_index == 0 and cache_salt else None


class PrefixHasher:
    """One engine's block hashing: the chosen hash function and its NONE_HASH root."""

    __slots__ = ("algo", "fn", "root", "seed")

    def __init__(self, algo: str = DEFAULT_ALGO, seed: str | None = None):
        self.algo = check_algo(algo)
        self.fn = HASH_FUNCTIONS[algo]
        self.seed = hash_seed(seed)
        self.root = self.fn(self.seed)

    def block(self, parent: bytes | None, token_ids, extra_keys: tuple | None = None) -> bytes:
        """vLLM's hash_block_tokens: parent None (or empty) means the chain's root."""
        return self.fn((parent or self.root, tuple(int(t) for t in token_ids), extra_keys))

    def chain(self, token_ids, block_size: int, cache_salt: str | None = None) -> list[bytes]:
        """Hashes of every full block of token_ids."""
        out: list[bytes] = []
        for i in range(len(token_ids) // block_size):
            toks = token_ids[i * block_size : (i + 1) * block_size]
            out.append(self.block(out[-1] if out else None, toks, block_extra_keys(i, cache_salt)))
        return out
