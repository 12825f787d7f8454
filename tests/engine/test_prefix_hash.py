"""Block hashes as vLLM computes them (engine/core/prefix_hash.py), checked three ways:

- against the rule re-implemented here from vLLM's source, with its own pickle writer (the opcodes
  `pickle.dumps(obj, protocol=5)` writes for a block key, spelled out byte by byte) and its own
  canonical CBOR, plus literal vectors whose bytes are written out below;
- against vLLM's own functions (`init_none_hash`, `hash_block_tokens`, `maybe_convert_block_hash`)
  run in the peer venv that scripts/peers.sh makes, where it exists;
- the block manager's hashes, the KV events' published hashes and the attach replay use them.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.block_manager import BlockManager
from engine.core.prefix_hash import (
    FALLBACK_SEED,
    PrefixHasher,
    block_extra_keys,
    cbor_canonical,
    event_extra_keys,
    none_hash,
)
from engine.observe.kv_event_wire import published_hash

# ---------------------------------------------------------------- the rule, written again here


def _p_int(n: int) -> bytes:
    if 0 <= n < 256:
        return b"K" + bytes([n])  # BININT1
    if 0 <= n < 65536:
        return b"M" + struct.pack("<H", n)  # BININT2
    assert -(2**31) <= n < 2**31
    return b"J" + struct.pack("<i", n)  # BININT


def _p_obj(o) -> bytes:
    """What pickle protocol 5 writes for the objects in a block key (each bytes / str / non-empty
    tuple is followed by MEMOIZE, 0x94; no object repeats, so no memo GETs)."""
    if o is None:
        return b"N"
    if isinstance(o, int):
        return _p_int(o)
    if isinstance(o, bytes):
        assert len(o) < 256
        return b"C" + bytes([len(o)]) + o + b"\x94"  # SHORT_BINBYTES
    if isinstance(o, str):
        b = o.encode()
        assert len(b) < 256
        return b"\x8c" + bytes([len(b)]) + b + b"\x94"  # SHORT_BINUNICODE
    assert isinstance(o, tuple)
    if not o:
        return b")"  # EMPTY_TUPLE, not memoized
    body = b"".join(_p_obj(x) for x in o)
    if len(o) <= 3:
        return body + bytes([0x84 + len(o)]) + b"\x94"  # TUPLE1/2/3
    return b"(" + body + b"t\x94"  # MARK ... TUPLE


def _pickle5(o) -> bytes:
    """PROTO 5, then one FRAME (8-byte little-endian length) holding the object and STOP."""
    body = _p_obj(o) + b"."
    return b"\x80\x05" + b"\x95" + struct.pack("<Q", len(body)) + body


def _sha256_vllm(o) -> bytes:
    return hashlib.sha256(_pickle5(o)).digest()


def _chain(tokens, bs, salt=None, seed="0"):
    parent, out = _sha256_vllm(seed), []  # NONE_HASH = sha256(PYTHONHASHSEED)
    for i in range(len(tokens) // bs):
        extra = (("cache_salt", salt),) if i == 0 and salt else None  # tagged, first block only
        parent = _sha256_vllm((parent, tuple(tokens[i * bs : (i + 1) * bs]), extra))
        out.append(parent)
    return out


def test_hand_checked_vectors():
    # NONE_HASH for PYTHONHASHSEED=0: sha256 of PROTO 5, FRAME(5), SHORT_BINUNICODE "0", MEMOIZE, STOP
    assert _pickle5("0") == bytes.fromhex("80059505000000000000008c0130942e")
    root = none_hash("sha256", "0")
    assert root == hashlib.sha256(bytes.fromhex("80059505000000000000008c0130942e")).digest()
    assert root.hex() == "1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c"
    # a 3-token block after the root: (SHORT_BINBYTES 32 root, (1, 2, 3), None) as one TUPLE3
    key = (root, (1, 2, 3), None)
    assert _pickle5(key) == bytes.fromhex("8005952f000000000000004320" + root.hex() + "944b014b024b0387944e87942e")
    h = PrefixHasher("sha256", "0")
    assert h.block(None, [1, 2, 3]) == hashlib.sha256(_pickle5(key)).digest()
    # a salted first block: extra keys (("cache_salt", "a"),) = two SHORT_BINUNICODE, TUPLE2, TUPLE1
    salted = (root, (1,), (("cache_salt", "a"),))
    assert _pickle5(salted)[-28:] == bytes.fromhex("4b0185948c0a" + b"cache_salt".hex() + "948c0161948694859487942e")
    assert h.block(None, [1], (("cache_salt", "a"),)) == hashlib.sha256(_pickle5(salted)).digest()
    # the first 16-token block of range(32), and its published form (low 64 bits, big-endian)
    first = h.chain(list(range(32)), 16)[0]
    assert first.hex() == "6358e31578a64b75ebe28cdb99d3beae65de82a2087321dc6ec84ae048faaaa6"
    assert published_hash(first) == int("6ec84ae048faaaa6", 16) == 7982712666671721126


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 200_000), min_size=0, max_size=70),
    bs=st.sampled_from([1, 4, 16]),
    salt=st.one_of(st.none(), st.just(""), st.text(min_size=1, max_size=12)),
    seed=st.sampled_from(["0", "42", "12345"]),
)
def test_chain_equals_the_rule_written_from_vllms_source(tokens, bs, salt, seed):
    if salt:
        salt = salt.encode("utf-8", "ignore").decode()[:12] or None
    assert PrefixHasher("sha256", seed).chain(tokens, bs, salt) == _chain(tokens, bs, salt, seed)


def test_salt_only_keys_the_first_block_and_an_empty_salt_is_no_salt():
    toks = list(range(48))
    h = PrefixHasher()
    plain, salted, other = h.chain(toks, 16), h.chain(toks, 16, "team-a"), h.chain(toks, 16, "team-b")
    assert h.chain(toks, 16, "") == plain
    assert all(a != b for a, b in zip(plain, salted)) and all(a != b for a, b in zip(salted, other))
    assert [block_extra_keys(i, "team-a") for i in range(3)] == [(("cache_salt", "team-a"),), None, None]
    assert [event_extra_keys(i, "team-a") for i in range(3)] == [("team-a",), None, None]
    # block 2 of the salted chain is the plain rule applied to salted block 1: no key past block 0
    assert salted[2] == h.block(salted[1], toks[32:48], None)


def test_root_follows_pythonhashseed_and_falls_back_to_a_fixed_seed(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    assert PrefixHasher().root == _sha256_vllm("123")
    monkeypatch.delenv("PYTHONHASHSEED")
    assert FALLBACK_SEED == "vllm-none-hash"  # vLLM 0.32 / 0.33's DEFAULT_NONE_HASH_SEED
    assert PrefixHasher().root == _sha256_vllm("vllm-none-hash") != PrefixHasher(seed="0").root


def test_cbor_choice_hand_vector_and_cbor2_when_installed():
    # array(3): bytes(2) 0000, array(6) of ints in each head width, null; then ("salt",)
    obj = (b"\x00\x00", (1, 24, 255, 256, 65536, 2**32), None, ("salt",))
    assert cbor_canonical(obj) == bytes.fromhex("844200008601181818ff1901001a000100001b0000000100000000f6816473616c74")
    h = PrefixHasher("sha256_cbor", "0")
    assert h.root == hashlib.sha256(bytes.fromhex("6130")).digest()  # text(1) "0"
    assert h.block(None, [5, 6]) == hashlib.sha256(cbor_canonical((h.root, (5, 6), None))).digest()
    try:
        import cbor2
    except ImportError:
        pytest.skip("cbor2 is not installed here (kvscope writes canonical CBOR itself); byte checks above ran")
    for o in [obj, (h.root, tuple(range(300)), (("cache_salt", "s" * 300),)), (b"", (), None)]:
        assert cbor2.dumps(o, canonical=True) == cbor_canonical(o)


def test_bad_algo_names_the_field():
    from engine import EngineConfig

    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        PrefixHasher("md5")
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        EngineConfig(model="tiny", prefix_caching_hash_algo="xxhash")


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_block_manager_indexes_vllms_hashes_and_keeps_each_blocks_content(algo):
    bm = BlockManager(8, 4, hash_algo=algo)
    toks = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]  # two full blocks and a partial one
    bm.allocate("r", len(toks))
    bm.commit("r", len(toks))
    bm.cache_full_blocks("r", toks, "salt")
    want = PrefixHasher(algo).chain(toks, 4, "salt")
    assert list(bm.hash_to_block) == want
    assert bm.hash_content[want[0]] == (None, (3, 1, 4, 1), ("salt",))  # the events' untagged form
    assert bm.hash_content[want[1]] == (want[0], (5, 9, 2, 6), None)
    # hits, evictions and the invariants are those of any hash: a second request hits both blocks
    assert bm.get_computed_blocks("q", toks, "salt") == (bm.table("r")[:2], 8)
    assert bm.get_computed_blocks("p", toks, None) == ([], 0)
    bm.check_invariants()


# ---------------------------------------------------------------- vLLM's own functions

PEER_PY = Path(os.environ.get("KVSCOPE_CACHE_DIR", str(Path.home() / ".cache/kvscope"))) / "peers/vllm/bin/python"

PEER_SCRIPT = r"""
import json, sys, types
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as k
req = json.loads(sys.stdin.read())
fn = get_hash_fn_by_name(req["algo"])
k.init_none_hash(fn)
out = []
for prompt in req["prompts"]:
    parent, hs = None, []
    toks, bs, salt = prompt["tokens"], prompt["block_size"], prompt["salt"]
    # vLLM's own extra keys for a text request carrying only a cache_salt
    r = types.SimpleNamespace(mm_features=[], lora_request=None, cache_salt=salt, prompt_embeds=None)
    for i in range(len(toks) // bs):
        extra, _ = k.generate_block_hash_extra_keys(r, i * bs, (i + 1) * bs, 0)
        parent = k.hash_block_tokens(fn, parent, toks[i * bs:(i + 1) * bs], extra)
        hs.append([parent.hex(), k.maybe_convert_block_hash(parent), k.to_event_extra_keys([extra])])
    out.append(hs)
print(json.dumps({"none_hash": k.NONE_HASH.hex(), "chains": out}))
"""


@pytest.mark.parametrize("seed", [None, "0"])
@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_hashes_equal_vllms_own_functions_in_the_peer_venv(algo, seed):
    if not PEER_PY.exists():
        pytest.skip(f"no vLLM peer venv at {PEER_PY} (scripts/peers.sh makes it); the rule is checked above")
    prompts = [
        {"tokens": list(range(100, 164)), "block_size": 16, "salt": None},
        {"tokens": [7] * 40 + list(range(40)), "block_size": 16, "salt": "tenant-a"},
        {"tokens": list(range(151_000, 151_033)), "block_size": 8, "salt": None},
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1"
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    r = subprocess.run(
        [str(PEER_PY), "-c", PEER_SCRIPT],
        input=json.dumps({"algo": algo, "prompts": prompts}),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if r.returncode != 0 and "ModuleNotFoundError" in r.stderr:
        pytest.skip(f"the peer venv does not import vLLM's hashing: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    h = PrefixHasher(algo, seed if seed is not None else FALLBACK_SEED)
    assert got["none_hash"] == h.root.hex()
    for p, chain in zip(prompts, got["chains"]):
        mine = h.chain(p["tokens"], p["block_size"], p["salt"])
        events = [event_extra_keys(i, p["salt"]) for i in range(len(mine))]
        want = [[x.hex(), published_hash(x), [list(e) if e else None]] for x, e in zip(mine, events)]
        assert want == chain
