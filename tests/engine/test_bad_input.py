"""Bad-input catalog (issue 7, item 3; issue 2's bad-input list).

Every public entry point gets hostile input here: the LLMEngine / LLM API, SamplingParams and
EngineConfig fields, EngineThread, the `python -m engine generate` CLI, the functions behind the
app's input widgets, and the trace loader. Each case asserts the exact error (type and message),
and for entry points that hold an engine, that nothing was allocated or queued (block pool, block
tables, queues and requests unchanged) while a bystander request is in flight; afterwards the
bystander finishes with exactly the output of a clean run.

docs/BAD_INPUT.md is generated from these same cases by real runs:

    .venv/bin/python -m tests.engine.test_bad_input          # rewrites docs/BAD_INPUT.md

and `test_catalog_doc_is_current` fails when the doc and the real errors drift apart.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import pickle
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

from engine import LLM, EngineConfig, LLMEngine, SamplingParams, SpeculativeConfig, TierConfig
from engine.core.thread import EngineThread
from engine.lab.watch import WatchControl
from engine.observe.trace_events import read_trace

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "BAD_INPUT.md"
TINY = dict(model="tiny", device="cpu", num_kv_blocks=32, block_size=8, max_model_len=128)
BYSTANDER_PROMPT = "The bystander keeps generating while others send garbage"


class CliExit(Exception):
    """`python -m engine generate` ended with a non-zero status (message: status + last stderr line)."""


@dataclass
class Case:
    entry: str  # the public entry point
    bad: str  # the bad input, as a reader would type it
    call: Callable  # call(ctx) -> raises
    error: type
    match: str  # regex the message must match (re.search)
    target: str | None = None  # "eng" / "llm" / "th": assert that engine is left unchanged
    volatile: bool = False  # message holds machine-specific numbers (doc rows not compared)


class Ctx:
    """Engines shared by the cases (built once): a bare LLMEngine with an in-flight bystander,
    an LLM, and an EngineThread."""

    def __init__(self):
        self.eng = LLMEngine(EngineConfig(**TINY))
        self.eng.add_request("bystander", BYSTANDER_PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
        self.eng.step()
        self.eng.step()
        self.llm = LLM(**TINY)
        self.th = EngineThread(LLMEngine(EngineConfig(**TINY)))
        self.vocab = self.eng.vocab_size

    def close(self):
        self.th.shutdown()


def cli(*argv: str):
    """Run the generate CLI in-process; raise CliExit on a non-zero exit with its error line."""
    from engine.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(["generate", *argv])
        except SystemExit as e:  # argparse
            rc = e.code
    if rc:
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        raise CliExit(f"exit {rc}: {lines[-1] if lines else ''}")
    return out.getvalue()


H = '{"kind": "kvscope-trace", "version": 1}\n'


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo PWNED > /tmp/kvscope_pwned",))


POOL_SCRIPT = r"""
import resource
resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))   # a regression fails here, never OOMs the box
from engine import EngineConfig, LLMEngine
total = int(open("/proc/meminfo").read().split("MemTotal:")[1].split()[0]) * 1024
base = dict(model="tiny", device="cpu", block_size=8, max_model_len=128, num_kv_blocks=32)
for kw in (dict(num_kv_blocks=None, kv_cache_bytes=4 * total),
           dict(preemption_mode="swap", swap_space_bytes=4 * total),
           dict(block_size=256, num_kv_blocks=1_000_000)):
    try:
        LLMEngine(EngineConfig(**dict(base, **kw)))
        print("ACCEPTED", kw)
    except ValueError as e:
        print("ValueError:", e)
    except Exception as e:
        print("OTHER", type(e).__name__, str(e)[:200])
"""


@functools.lru_cache(maxsize=1)
def _pool_results() -> tuple[str, ...]:
    r = subprocess.run(
        [sys.executable, "-c", POOL_SCRIPT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    lines = tuple(ln for ln in r.stdout.splitlines() if ln.strip())
    if len(lines) != 3:
        raise RuntimeError(f"pool script failed: {r.stdout} {r.stderr[-2000:]}")
    return lines


def pool_case(i: int):
    """Re-raise, in this process, what the child process got for oversized pool number i."""
    line = _pool_results()[i]
    if line.startswith("ValueError: "):
        raise ValueError(line[len("ValueError: ") :])
    raise RuntimeError(line)


def P(**kw):
    return SamplingParams(**kw)


def _deep(n: int) -> str:
    return "[" * n + "]" * n


def _cases() -> list[Case]:
    c: list[Case] = []

    def add(entry, bad, call, error, match, target=None, volatile=False):
        c.append(Case(entry, bad, call, error, match, target, volatile))

    # ---------------------------------------------------------------- LLMEngine.add_request
    E = "LLMEngine.add_request"
    add(E, 'prompt=""', lambda x: x.eng.add_request(None, "", P()), ValueError, r"^prompt must not be empty$", "eng")
    add(
        E,
        "prompt=[] (no token ids)",
        lambda x: x.eng.add_request(None, [], P()),
        ValueError,
        r"^prompt must not be empty \(got an empty token id list\)$",
        "eng",
    )
    add(
        E,
        "prompt of 200 tokens, max_model_len=128",
        lambda x: x.eng.add_request(None, [5] * 200, P()),
        ValueError,
        r"^prompt is 200 tokens; max_model_len is 128 \(prompt \+ at least 1 generated token must fit\)$",
        "eng",
    )
    add(
        E,
        "prompt of exactly max_model_len (128) tokens",
        lambda x: x.eng.add_request(None, [5] * 128, P()),
        ValueError,
        r"^prompt is 128 tokens; max_model_len is 128",
        "eng",
    )
    add(
        E,
        "prompt string over 1,000,000 characters",
        lambda x: x.eng.add_request(None, "a" * 1_000_001, P()),
        ValueError,
        r"^prompt is 1000001 characters; the limit is 1000000$",
        "eng",
    )
    add(
        E,
        r'prompt with a lone surrogate "\ud800"',
        lambda x: x.eng.add_request(None, "ab\ud800cd", P()),
        ValueError,
        r"^prompt is not valid Unicode text \(a lone surrogate at character 2\)$",
        "eng",
    )
    add(
        "EngineThread",
        r'a lone surrogate through submit(chat=True) "\udfff"',
        lambda x: x.th.submit("\udfff", chat=True),
        ValueError,
        r"^prompt is not valid Unicode text \(a lone surrogate at character 0\)$",
        "th",
    )
    add(
        E,
        "token id -1",
        lambda x: x.eng.add_request(None, [1, -1], P()),
        ValueError,
        r"^prompt token id -1 is outside the vocabulary \[0, 49152\)$",
        "eng",
    )
    add(
        E,
        "token id = vocab size (49152)",
        lambda x: x.eng.add_request(None, [x.vocab], P()),
        ValueError,
        r"^prompt token id 49152 is outside the vocabulary \[0, 49152\)$",
        "eng",
    )
    add(
        E,
        "token id 1.0 (float)",
        lambda x: x.eng.add_request(None, [1.0], P()),
        ValueError,
        r"^prompt token ids must be integers, got float$",
        "eng",
    )
    add(
        E,
        "token id True (bool)",
        lambda x: x.eng.add_request(None, [True], P()),
        ValueError,
        r"^prompt token ids must be integers, got bool$",
        "eng",
    )
    add(
        E,
        'token id "a" (str)',
        lambda x: x.eng.add_request(None, [1, "a"], P()),
        ValueError,
        r"^prompt token ids must be integers, got str$",
        "eng",
    )
    add(
        E,
        "nested list [[1, 2]]",
        lambda x: x.eng.add_request(None, [[1, 2]], P()),
        ValueError,
        r"^prompt token ids must be integers, got list$",
        "eng",
    )
    for name, val in (
        ("None", None),
        ("a dict", {"text": "hi"}),
        ("bytes", b"hi"),
        ("an int", 7),
        ("a torch tensor", torch.tensor([1, 2])),
    ):
        add(
            E,
            f"prompt is {name}",
            lambda x, v=val: x.eng.add_request(None, v, P()),
            ValueError,
            r"^prompt must be a string or a list of token ids, got \w+$",
            "eng",
        )
    add(
        E,
        "params={'max_tokens': 3} (a dict)",
        lambda x: x.eng.add_request(None, "hi", {"max_tokens": 3}),
        ValueError,
        r"^params must be a SamplingParams$",
        "eng",
    )
    add(
        E,
        "request_id=5 (not a string)",
        lambda x: x.eng.add_request(5, "hi", P()),
        ValueError,
        r"^request_id must be a non-empty string of at most 128 characters$",
        "eng",
    )
    add(
        E,
        'request_id=""',
        lambda x: x.eng.add_request("", "hi", P()),
        ValueError,
        r"^request_id must be a non-empty string of at most 128 characters$",
        "eng",
    )
    add(
        E,
        "request_id of 129 characters",
        lambda x: x.eng.add_request("x" * 129, "hi", P()),
        ValueError,
        r"^request_id must be a non-empty string of at most 128 characters$",
        "eng",
    )
    add(
        E,
        "request_id of a request in flight",
        lambda x: x.eng.add_request("bystander", "hi", P()),
        ValueError,
        r"^request_id 'bystander' is already in use$",
        "eng",
    )
    add(
        E,
        'tier="gold" (not configured)',
        lambda x: x.eng.add_request(None, "hi", P(tier="gold")),
        ValueError,
        r"^tier 'gold' is not configured \(known: \['enterprise', 'free', 'pro'\]\)$",
        "eng",
    )
    add(
        E,
        "stop_token_ids=[49152] (outside the vocabulary)",
        lambda x: x.eng.add_request(None, "hi", P(stop_token_ids=[x.vocab])),
        ValueError,
        r"^stop_token_ids must be < vocab size 49152$",
        "eng",
    )

    # ---------------------------------------------------------------- SamplingParams
    S = "SamplingParams"
    for bad, kw, msg in (
        ("max_tokens=0", dict(max_tokens=0), r"^max_tokens must be an integer >= 1, got 0$"),
        ("max_tokens=-1", dict(max_tokens=-1), r"^max_tokens must be an integer >= 1, got -1$"),
        ("max_tokens=1.5", dict(max_tokens=1.5), r"^max_tokens must be an integer >= 1, got 1.5$"),
        (
            "temperature=-0.1",
            dict(temperature=-0.1),
            r"^temperature must be 0 \(greedy\) or a number in \[1e-05, 100\], got -0.1$",
        ),
        (
            "temperature=nan",
            dict(temperature=float("nan")),
            r"^temperature must be 0 \(greedy\) or a number in \[1e-05, 100\], got nan$",
        ),
        (
            "temperature=inf",
            dict(temperature=float("inf")),
            r"^temperature must be 0 \(greedy\) or a number in \[1e-05, 100\], got inf$",
        ),
        (
            "temperature=1e-300 (overflows the logits)",
            dict(temperature=1e-300),
            r"^temperature must be 0 \(greedy\) or a number in \[1e-05, 100\], got 1e-300$",
        ),
        (
            'temperature="0.5" (a string)',
            dict(temperature="0.5"),
            r"^temperature must be 0 \(greedy\) or a number in \[1e-05, 100\], got '0.5'$",
        ),
        ("top_p=0", dict(top_p=0), r"^top_p must be in \(0, 1\], got 0$"),
        ("top_p=1.5", dict(top_p=1.5), r"^top_p must be in \(0, 1\], got 1.5$"),
        ("top_p=nan", dict(top_p=float("nan")), r"^top_p must be in \(0, 1\], got nan$"),
        ("top_k=-1", dict(top_k=-1), r"^top_k must be an integer >= 0, got -1$"),
        ("seed=-1", dict(seed=-1), r"^seed must be an integer in \[0, 2\^63\), got -1$"),
        ("seed=2**64", dict(seed=2**64), r"^seed must be an integer in \[0, 2\^63\), got 18446744073709551616$"),
        ("stop=17 strings", dict(stop=["x"] * 17), r"^stop must be a list of at most 16 non-empty strings$"),
        ('stop=[""]', dict(stop=[""]), r"^stop must be a list of at most 16 non-empty strings$"),
        ("stop=[1]", dict(stop=[1]), r"^stop must be a list of at most 16 non-empty strings$"),
        ("stop_token_ids=[-1]", dict(stop_token_ids=[-1]), r"^stop_token_ids must be a list of non-negative integers$"),
        ('ignore_eos="yes"', dict(ignore_eos="yes"), r"^ignore_eos must be True or False$"),
        ("tier=5", dict(tier=5), r"^tier must be a string$"),
        (
            "cache_salt of 257 characters",
            dict(cache_salt="s" * 257),
            r"^cache_salt must be a string of at most 256 characters$",
        ),
        (
            "request_class of 65 characters",
            dict(request_class="c" * 65),
            r"^request_class must be a string of at most 64 characters$",
        ),
    ):
        add(S, bad, lambda x, kw=kw: SamplingParams(**kw), ValueError, msg)
    add(S, "an unknown field (foo=1)", lambda x: SamplingParams(foo=1), TypeError, r"unexpected keyword argument 'foo'")

    # ---------------------------------------------------------------- EngineConfig / LLMEngine(...)
    C = "EngineConfig"
    for bad, kw, msg in (
        ('model=""', dict(model=""), r"^model must be a non-empty string$"),
        ('device="tpu"', dict(device="tpu"), r"^device must be 'auto', 'cpu' or 'cuda\[:N\]', got 'tpu'$"),
        (
            'dtype="int8"',
            dict(dtype="int8"),
            r"^dtype must be one of \('auto', 'float32', 'bfloat16', 'float16'\), got 'int8'$",
        ),
        ("block_size=0", dict(block_size=0), r"^block_size must be an integer in \[1, 256\], got 0$"),
        ("block_size=512", dict(block_size=512), r"^block_size must be an integer in \[1, 256\], got 512$"),
        ("num_kv_blocks=0", dict(num_kv_blocks=0), r"^num_kv_blocks must be an integer in \[1, 1000000\], got 0$"),
        (
            "num_kv_blocks=2,000,000",
            dict(num_kv_blocks=2_000_000),
            r"^num_kv_blocks must be an integer in \[1, 1000000\], got 2000000$",
        ),
        ("kv_cache_bytes=0", dict(kv_cache_bytes=0), r"^kv_cache_bytes must be a positive integer, got 0$"),
        ("max_num_seqs=0", dict(max_num_seqs=0), r"^max_num_seqs must be an integer in \[1, 4096\], got 0$"),
        (
            "max_num_batched_tokens=0",
            dict(max_num_batched_tokens=0),
            r"^max_num_batched_tokens must be an integer >= 1, got 0$",
        ),
        ("max_model_len=1", dict(max_model_len=1), r"^max_model_len must be an integer in \[2, 1048576\], got 1$"),
        (
            'preemption_mode="drop"',
            dict(preemption_mode="drop"),
            r"^preemption_mode must be one of \('recompute', 'swap'\), got 'drop'$",
        ),
        (
            'victim_policy="random"',
            dict(victim_policy="random"),
            r"^victim_policy must be one of \('last_admitted', 'lru'\), got 'random'$",
        ),
        ("swap_space_bytes=-1", dict(swap_space_bytes=-1), r"^swap_space_bytes must be an integer >= 0$"),
        (
            'allocator="buddy"',
            dict(allocator="buddy"),
            r"^allocator must be one of \('paged', 'contiguous'\), got 'buddy'$",
        ),
        ('kv_cache="no"', dict(kv_cache="no"), r"^kv_cache must be True or False$"),
        ('tiers=["free"] (not a dict)', dict(tiers=["free"]), r"^tiers must be a dict of name -> TierConfig$"),
        (
            'default_tier="gold"',
            dict(default_tier="gold"),
            r"^default_tier 'gold' is not one of \['free', 'pro', 'enterprise'\]$",
        ),
        (
            "speculative={'method': 'ngram'} (a dict)",
            dict(speculative={"method": "ngram"}),
            r"^speculative must be a SpeculativeConfig$",
        ),
        ("num_threads=0", dict(num_threads=0), r"^num_threads must be an integer in \[1, 256\]$"),
        (
            'linear_backend="mkl"',
            dict(linear_backend="mkl"),
            r"^linear_backend must be one of \('auto', 'torch'\), got 'mkl'$",
        ),
        (
            'attention_backend="flash"',
            dict(attention_backend="flash"),
            r"^attention_backend must be one of \('auto', 'torch', 'flex'\), got 'flash'$",
        ),
        (
            "gpu_memory_utilization=1.5",
            dict(gpu_memory_utilization=1.5),
            r"^gpu_memory_utilization must be a number in \(0, 1\], got 1.5$",
        ),
        ("event_ring_size=1", dict(event_ring_size=1), r"^event_ring_size must be an integer in \[16, 10000000\]$"),
        ("history_len=1", dict(history_len=1), r"^history_len must be in \[2, 100000\]$"),
    ):
        add(C, bad, lambda x, kw=kw: EngineConfig(**dict(TINY, **kw)), ValueError, msg)
    add(C, "an unknown field (foo=1)", lambda x: EngineConfig(foo=1), TypeError, r"unexpected keyword argument 'foo'")
    add(
        "TierConfig",
        "max_context=0",
        lambda x: TierConfig("t", 0),
        ValueError,
        r"^tier.max_context must be an integer >= 1, got 0$",
    )
    add(
        "SpeculativeConfig",
        'method="magic"',
        lambda x: SpeculativeConfig(method="magic"),
        ValueError,
        r"^speculative.method must be one of \('ngram', 'draft_model', 'self_draft'\), got 'magic'$",
    )
    add(
        "SpeculativeConfig",
        "num_speculative_tokens=17",
        lambda x: SpeculativeConfig(num_speculative_tokens=17),
        ValueError,
        r"^speculative.num_speculative_tokens must be an integer in \[1, 16\], got 17$",
    )
    add(
        "SpeculativeConfig",
        'method="draft_model" without draft_model',
        lambda x: SpeculativeConfig(method="draft_model"),
        ValueError,
        r"^speculative.draft_model must name a model",
    )

    W = "WatchControl (Speculative page, watch mode)"
    add(
        W,
        "pace_s=5",
        lambda x: WatchControl(pace_s=5),
        ValueError,
        r"^pace_s must be in \[0, 2.0\] seconds, got 5$",
    )
    add(
        W,
        "evict_after_tokens=0",
        lambda x: WatchControl(evict_after_tokens=0),
        ValueError,
        r"^evict_after_tokens must be >= 1 \(or None\), got 0$",
    )

    L = "LLMEngine(config)"
    add(
        L,
        'model="/no/such/model"',
        lambda x: LLMEngine(EngineConfig(**dict(TINY, model="/no/such/model"))),
        ValueError,
        r"^model='/no/such/model': not 'default', 'tiny', an existing local directory or a hub id$",
    )
    add(
        L,
        'model="/etc/passwd" (a file)',
        lambda x: LLMEngine(EngineConfig(**dict(TINY, model="/etc/passwd"))),
        ValueError,
        r"^model='/etc/passwd': not 'default', 'tiny', an existing local directory or a hub id$",
    )
    add(
        L,
        "max_model_len=100000 (tiny model: 8192 positions)",
        lambda x: LLMEngine(EngineConfig(**dict(TINY, max_model_len=100_000))),
        ValueError,
        r"^max_model_len=100000 exceeds the model's max_position_embeddings=8192$",
    )
    add(
        L,
        "kv_cache_bytes=100 (less than one block)",
        lambda x: LLMEngine(EngineConfig(**dict(TINY, num_kv_blocks=None, kv_cache_bytes=100))),
        ValueError,
        r"^kv_cache_bytes=100 is smaller than one block \(4096 bytes at block_size 8\)$",
    )
    add(
        L,
        'allocator="contiguous" with a pool smaller than one max_model_len slab',
        lambda x: LLMEngine(EngineConfig(**dict(TINY, allocator="contiguous", num_kv_blocks=4))),
        ValueError,
        r"^allocator='contiguous' needs at least one max_model_len slab \(16 blocks\); the pool has 4$",
    )
    if not torch.cuda.is_available():
        add(
            L,
            'device="cuda" on a machine without CUDA',
            lambda x: LLMEngine(EngineConfig(**dict(TINY, device="cuda"))),
            ValueError,
            r"^device='cuda' requested but CUDA is not available on this machine$",
        )
    add(
        L,
        "extra keyword block_size=0",
        lambda x: LLMEngine(EngineConfig(**TINY), block_size=0),
        ValueError,
        r"^block_size must be an integer in \[1, 256\], got 0$",
    )
    # pools larger than the machine's memory: refused before anything is allocated (these run in a
    # child process under an address-space limit, so a regression fails instead of exhausting RAM)
    add(
        L,
        "kv_cache_bytes = 4 x the machine's RAM",
        lambda x: pool_case(0),
        ValueError,
        r"^kv_cache_bytes=\d+ needs \d+\.\d GiB of KV cache \(4096 bytes per block\); "
        r"the cpu has \d+\.\d GiB available and the pool may use at most 90% of it$",
        volatile=True,
    )
    add(
        L,
        "swap_space_bytes = 4 x the machine's RAM (preemption_mode='swap')",
        lambda x: pool_case(1),
        ValueError,
        r"^swap_space_bytes=\d+ needs \d+\.\d GiB of CPU swap space; \d+\.\d GiB of memory is available "
        r"and the swap space may use at most 90% of it$",
        volatile=True,
    )

    # ---------------------------------------------------------------- LLM
    G = "LLM.generate"
    add(
        G,
        "prompts=[]",
        lambda x: x.llm.generate([]),
        ValueError,
        r"^prompts must be a string, a list of token ids, or a non-empty list of either$",
        "llm",
    )
    add(
        G,
        "prompts=None",
        lambda x: x.llm.generate(None),
        ValueError,
        r"^prompts must be a string, a list of token ids, or a non-empty list of either$",
        "llm",
    )
    add(
        G,
        'prompts=["hi", 3]',
        lambda x: x.llm.generate(["hi", 3]),
        ValueError,
        r"^prompt must be a string or a list of token ids, got int$",
        "llm",
    )
    add(G, 'prompts=""', lambda x: x.llm.generate(""), ValueError, r"^prompt must not be empty$", "llm")
    add(
        G,
        "2 prompts, 1 SamplingParams in a list",
        lambda x: x.llm.generate(["a", "b"], [P()]),
        ValueError,
        r"^got 1 sampling params for 2 prompts$",
        "llm",
    )
    add(
        G,
        "sampling_params={'max_tokens': 2}",
        lambda x: x.llm.generate("hi", {"max_tokens": 2}),
        ValueError,
        r"^params must be a SamplingParams$",
        "llm",
    )
    add(
        G,
        "second prompt over max_model_len (nothing of the batch stays queued)",
        lambda x: x.llm.generate(["hi", [5] * 200], P(max_tokens=2)),
        ValueError,
        r"^prompt is 200 tokens; max_model_len is 128",
        "llm",
    )
    add(
        "LLM(...)",
        "an unknown config field (foo=1)",
        lambda x: LLM("tiny", foo=1),
        TypeError,
        r"unexpected keyword argument 'foo'",
    )

    # ---------------------------------------------------------------- EngineThread
    T = "EngineThread"
    add(
        T,
        "submit(5, chat=True)",
        lambda x: x.th.submit(5, chat=True),
        ValueError,
        r"^prompt must be a non-empty string$",
        "th",
    )
    add(
        T,
        'submit("   ", chat=True)',
        lambda x: x.th.submit("   ", chat=True),
        ValueError,
        r"^prompt must be a non-empty string$",
        "th",
    )
    add(
        T,
        "submit(chat=True) of 1,000,001 characters",
        lambda x: x.th.submit("a" * 1_000_001, chat=True),
        ValueError,
        r"^prompt is 1000001 characters; the limit is 1000000$",
        "th",
    )
    add(
        T,
        "submit(chat=True) over max_model_len after the chat template",
        lambda x: x.th.submit("word " * 300, chat=True),
        ValueError,
        r"^prompt is \d+ tokens; max_model_len is 128",
        "th",
    )
    add(
        T,
        "submit(request_id=7)",
        lambda x: x.th.submit("hi", request_id=7),
        ValueError,
        r"^request_id must be a non-empty string of at most 128 characters$",
        "th",
    )
    add(
        T,
        "submit(prompt, params=0.5)",
        lambda x: x.th.submit("hi", 0.5),
        ValueError,
        r"^params must be a SamplingParams$",
        "th",
    )
    add(
        T,
        'evict("nope")',
        lambda x: x.th.evict("nope"),
        ValueError,
        r"^request 'nope' is not running \(unknown or finished\)$",
        "th",
    )
    add(
        T,
        "set_kv_budget(0)",
        lambda x: x.th.set_kv_budget(0),
        ValueError,
        r"^num_kv_blocks must be an integer in \[1, 32\] \(the allocated pool\)$",
        "th",
    )
    add(
        T,
        "set_kv_budget(33) (above the allocated pool)",
        lambda x: x.th.set_kv_budget(33),
        ValueError,
        r"^num_kv_blocks must be an integer in \[1, 32\] \(the allocated pool\)$",
        "th",
    )
    add(
        T,
        "set_kv_budget(8.0)",
        lambda x: x.th.set_kv_budget(8.0),
        ValueError,
        r"^num_kv_blocks must be an integer in \[1, 32\] \(the allocated pool\)$",
        "th",
    )
    add(
        T,
        "reconfigure({'num_kv_blocks': 8}) (a dict)",
        lambda x: x.th.reconfigure({"num_kv_blocks": 8}),
        ValueError,
        r"^config must be an EngineConfig$",
        "th",
    )
    add(
        T,
        'reconfigure(model="/no/such/model") (the old engine keeps serving)',
        lambda x: x.th.reconfigure(x.th.config.replace(model="/no/such/model")),
        ValueError,
        r"^model='/no/such/model': not 'default'",
        "th",
    )

    # ---------------------------------------------------------------- CLI
    K = "python -m engine generate"
    for bad, argv, msg in (
        ('""', ("",), r"^exit 2: error: prompt must not be empty$"),
        ("--max-tokens 0", ("hi", "--max-tokens", "0"), r"^exit 2: error: max_tokens must be an integer >= 1, got 0$"),
        (
            "--max-tokens abc",
            ("hi", "--max-tokens", "abc"),
            r"^exit 2: .*argument --max-tokens: invalid int value: 'abc'$",
        ),
        (
            "--temperature -1",
            ("hi", "--temperature", "-1"),
            r"^exit 2: error: temperature must be 0 \(greedy\) or a number in \[1e-05, 100\], got -1.0$",
        ),
        ("--top-p 0", ("hi", "--top-p", "0"), r"^exit 2: error: top_p must be in \(0, 1\], got 0.0$"),
        ("--top-k -5", ("hi", "--top-k", "-5"), r"^exit 2: error: top_k must be an integer >= 0, got -5$"),
        (
            "--block-size 0",
            ("hi", "--block-size", "0"),
            r"^exit 2: error: block_size must be an integer in \[1, 256\], got 0$",
        ),
        (
            "--num-kv-blocks 0",
            ("hi", "--num-kv-blocks", "0"),
            r"^exit 2: error: num_kv_blocks must be an integer in \[1, 1000000\], got 0$",
        ),
        (
            "--device tpu",
            ("hi", "--device", "tpu"),
            r"^exit 2: error: device must be 'auto', 'cpu' or 'cuda\[:N\]', got 'tpu'$",
        ),
        (
            "--model /no/such/model",
            ("hi", "--model", "/no/such/model"),
            r"^exit 2: error: model='/no/such/model': not 'default'",
        ),
        (
            "a prompt over max_model_len (unset: the tiny model's own limit, 8192) tokens",
            ("word " * 8300, "--raw"),
            r"^exit 2: error: prompt is \d+ tokens; max_model_len is 8192",
        ),
        (
            "--num-kv-blocks 1 with --max-tokens 100",
            ("hi", "--num-kv-blocks", "1", "--max-tokens", "100"),
            r"^exit 2: error: request needs up to \d+ KV blocks \(\d+ tokens\) but the pool has 1; "
            r"lower max_tokens or raise the KV budget$",
        ),
    ):
        model = () if "--model" in argv else ("--model", "tiny")
        add(K, bad, lambda x, a=argv + model: cli(*a), CliExit, msg)

    # ---------------------------------------------------------------- app widgets (the functions they call)
    A = "app: "
    add(
        A + "Playground prompt",
        "empty / whitespace (th.submit(chat=True))",
        lambda x: x.th.submit(" \n ", P(max_tokens=48), chat=True),
        ValueError,
        r"^prompt must be a non-empty string$",
        "th",
    )
    add(
        A + "Sidebar KV budget",
        "1,000,000 blocks (the widget maximum): a pool larger than RAM",
        lambda x: pool_case(2),
        ValueError,
        r"^num_kv_blocks=1000000 needs \d+\.\d GiB of KV cache \(131072 bytes per block\); "
        r"the cpu has \d+\.\d GiB available and the pool may use at most 90% of it$",
        volatile=True,
    )
    add(
        A + "Sidebar draft model",
        'draft model "/no/such/draft"',
        lambda x: LLMEngine(
            EngineConfig(
                **dict(TINY, speculative=SpeculativeConfig(method="draft_model", draft_model="/no/such/draft"))
            )
        ),
        ValueError,
        r"/no/such/draft",
    )
    from ui.figures.replay import load_trace_bytes

    add(
        A + "Replay upload",
        "a file over 32 MiB",
        lambda x: load_trace_bytes(b" " * (32 * 2**20 + 1)),
        ValueError,
        r"^trace is 32.0 MiB, over the replay limit of 32 MiB",
    )
    add(
        A + "Replay upload",
        "a pickle file",
        lambda x: load_trace_bytes(pickle.dumps(_Evil())),
        ValueError,
        r"^trace is not valid UTF-8",
    )
    from engine.lab.memory_math import parse_config_json

    MC = A + "Memory calculator config.json"
    add(
        MC,
        "empty",
        lambda x: parse_config_json(" "),
        ValueError,
        r"^config JSON is empty: paste the contents of a model's config.json$",
    )
    add(
        MC,
        "not JSON",
        lambda x: parse_config_json("{num_layers: 2"),
        ValueError,
        r"^config JSON is not valid JSON: Expecting property name enclosed in double quotes at line 1, column 2$",
    )
    add(
        MC,
        "100,000 nested objects",
        lambda x: parse_config_json('{"a":' * 100_000 + "1" + "}" * 100_000),
        ValueError,
        r"^config JSON is nested too deeply$",
    )
    add(
        MC,
        '"num_hidden_layers": 1e400 (infinity)',
        lambda x: parse_config_json('{"num_hidden_layers": 1e400, "num_attention_heads": 4, "hidden_size": 64}'),
        ValueError,
        r"^config field 'num_hidden_layers' must be a positive integer, got inf$",
    )
    add(
        MC,
        '"num_hidden_layers": NaN',
        lambda x: parse_config_json('{"num_hidden_layers": NaN, "num_attention_heads": 4, "hidden_size": 64}'),
        ValueError,
        r"^config field 'num_hidden_layers' must be a positive integer, got nan$",
    )
    add(
        MC,
        '"num_hidden_layers": a 400-digit integer',
        lambda x: parse_config_json(
            '{"num_hidden_layers": 1' + "0" * 399 + ', "num_attention_heads": 4, "hidden_size": 64}'
        ),
        ValueError,
        r"^config field 'num_hidden_layers' must be at most 1099511627776, got 10{399}$",
    )
    add(
        MC,
        '"num_hidden_layers": -1',
        lambda x: parse_config_json('{"num_hidden_layers": -1, "num_attention_heads": 4, "hidden_size": 64}'),
        ValueError,
        r"^config field 'num_hidden_layers' must be a positive integer, got -1$",
    )

    # ---------------------------------------------------------------- trace loader
    R = "engine.observe.trace_events.read_trace"
    for bad, src, msg in (
        ("empty file", "", r"^trace is empty$"),
        ("header only", H, r"^trace holds no snapshot$"),
        (
            "no header line",
            '{"kind": "snapshot", "snapshot": {}}\n',
            r"^trace line 1: the first line must be the header",
        ),
        (
            "header version 3",
            '{"kind": "kvscope-trace", "version": 3}\n',
            r"^trace line 1: the first line must be the header",
        ),
        (
            "a pickle payload (os.system in __reduce__)",
            pickle.dumps(_Evil()),
            r"^trace is not valid UTF-8: 'utf-8' codec can't decode byte 0x80 in position 0",
        ),
        (
            "UTF-16 text",
            H.encode("utf-16"),
            r"^trace is not valid UTF-8: 'utf-8' codec can't decode byte 0xff in position 0",
        ),
        (
            "Latin-1 bytes",
            H.encode() + b"caf\xe9\n",
            r"^trace is not valid UTF-8: 'utf-8' codec can't decode byte 0xe9",
        ),
        (
            "truncated mid-line",
            H + '{"kind": "snapshot", "snapshot": {"step": 1',
            r"^trace line 2: not valid JSON \(Expecting ',' delimiter\); the file may be truncated$",
        ),
        (
            "unknown line kind",
            H + '{"kind": "exec", "code": "import os"}\n',
            r"^trace line 2: unknown line kind 'exec'$",
        ),
        (
            "unknown event kind",
            H + '{"kind": "event", "event": {"seq": 1, "step": 1, "time": 0, "kind": "rm -rf"}}\n',
            r"^trace line 2: event.kind: unknown kind 'rm -rf'$",
        ),
        (
            "event with an extra field",
            H + '{"kind": "event", "event": {"seq": 1, "step": 1, "time": 0, "kind": "admit", "__class__": "x"}}\n',
            r"^trace line 2: event: unknown field\(s\) \['__class__'\]$",
        ),
        ("a line that is a JSON array", H + "[1, 2, 3]\n", r"^trace line 2: expected an object with a 'kind'$"),
        (
            "snapshot = null",
            H + '{"kind": "snapshot", "snapshot": null}\n',
            r"^trace line 2: Snapshot: expected an object, got NoneType$",
        ),
        (
            "snapshot with a __class__ field",
            H + '{"kind": "snapshot", "snapshot": {"__class__": "os.system"}}\n',
            r"^trace line 2: Snapshot: unknown field\(s\) \['__class__'\]$",
        ),
        (
            'snapshot step = "x"',
            H + '{"kind": "snapshot", "snapshot": {"step": "x"}}\n',
            r"^trace line 2: Snapshot.step: expected an integer$",
        ),
        (
            "100,000 nested arrays",
            H + '{"kind": "event", "event": ' + _deep(100_000) + "}\n",
            r"^trace line 2: JSON nested too deeply$",
        ),
        (
            "an integer of 5,000 digits",
            H + '{"kind": "event", "event": {"seq": ' + "9" * 5000 + "}}\n",
            r"^trace line 2: not valid JSON \(Exceeds the limit \(4300 digits\)",
        ),
        (
            "time = NaN",
            H + '{"kind": "event", "event": {"seq": 1, "step": 1, "time": NaN, "kind": "admit"}}\n',
            r"^trace line 2: not valid JSON \(NaN is not allowed\)$",
        ),
        (
            "time = Infinity",
            H + '{"kind": "event", "event": {"seq": 1, "step": 1, "time": Infinity, "kind": "admit"}}\n',
            r"^trace line 2: not valid JSON \(Infinity is not allowed\)$",
        ),
        ("not text (an int)", 12345, r"^trace must be text \(JSON Lines\)$"),
    ):
        add(R, bad, lambda x, s=src: read_trace(s), ValueError, msg)
    add(
        R,
        "over max_bytes (limit 1000 here; default 256 MiB)",
        lambda x: read_trace(H + " " * 2000, max_bytes=1000),
        ValueError,
        r"^trace is larger than the limit of 1000 bytes$",
    )
    return [k for k in c if k is not None]


CASES = _cases()


def fingerprint(eng: LLMEngine):
    bm, s = eng.bm, eng.scheduler
    return (
        bm.fingerprint(),
        tuple(r.request_id for r in s.waiting),
        tuple(r.request_id for r in s.running),
        tuple(r.request_id for r in s.swapped),
        tuple(eng.requests),
        eng.step_num,
        bm.num_swap_used,
    )


def run_case(case: Case, ctx: Ctx):
    """Run one case; returns the exception it raised (None if it raised nothing) after checking
    that the targeted engine was left unchanged."""
    tgt = {"eng": lambda: ctx.eng, "llm": lambda: ctx.llm.engine, "th": lambda: ctx.th.engine}.get(case.target)
    lock = ctx.th.lock if case.target == "th" else contextlib.nullcontext()
    with lock:
        before = fingerprint(tgt()) if tgt else None
        try:
            case.call(ctx)
            err = None
        except Exception as e:  # noqa: BLE001 - that is the point
            err = e
        if tgt:
            assert fingerprint(tgt()) == before, f"{case.entry} {case.bad}: engine state changed"
            tgt().check_invariants()
    return err


@pytest.fixture(scope="module")
def ctx():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    x = Ctx()
    yield x
    x.close()
    torch.set_num_threads(n)


def run_catalog(ctx: Ctx) -> list:
    """Every case once, in catalog order, on ctx: the error each raised (None if accepted)."""
    return [run_case(case, ctx) for case in CASES]


@pytest.fixture(scope="module")
def catalog(ctx) -> list:
    """The catalog run once on the module's fresh Ctx (the generator's starting state): the case
    tests and the document check read the same results."""
    return run_catalog(ctx)


@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{c.entry}: {c.bad}"[:80] for c in CASES])
def test_bad_input(i, catalog):
    case, err = CASES[i], catalog[i]
    assert err is not None, f"{case.entry} accepted {case.bad}"
    assert isinstance(err, case.error), f"{type(err).__name__}: {err}"
    assert re.search(case.match, str(err)), str(err)


def test_everyone_keeps_being_served_after_the_catalog(ctx, catalog):
    """Runs after the catalog (same module, in order): the bystander in flight during every bad
    input finishes exactly as in a clean run; the LLM and EngineThread serve new requests."""
    ref = LLMEngine(EngineConfig(**TINY))
    ref.add_request("r", BYSTANDER_PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
    want = None
    while ref.has_unfinished_requests():
        for o in ref.step():
            want = o.outputs[0].token_ids
    got = None
    while ctx.eng.has_unfinished_requests():
        for o in ctx.eng.step():
            if o.request_id == "bystander" and o.finished:
                got = o.outputs[0].token_ids
        ctx.eng.check_invariants()
    assert got == want and len(got) == 12
    outs = ctx.llm.generate(["hi", [5, 6, 7]], SamplingParams(max_tokens=3))
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
    assert ctx.th.healthy
    assert ctx.th.submit("still here?", SamplingParams(max_tokens=4)).result(timeout=120).finished
    with ctx.th.lock:
        ctx.th.engine.check_invariants()
    assert not os.path.exists("/tmp/kvscope_pwned")


def test_tiny_temperature_cannot_crash_the_step_loop(ctx):
    """temperature=1e-300 used to pass validation and then make every step raise in sampling
    (outside the per-step guard), killing the EngineThread loop for all clients."""
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=1e-300, seed=0)
    ok = SamplingParams(temperature=1e-5, seed=0, max_tokens=3)  # the smallest allowed: samples fine
    h = ctx.th.submit("tiny temperature", ok)
    assert h.result(timeout=120).outputs[0].finish_reason == "length"
    assert ctx.th.healthy


def test_cli_subprocess_reports_bad_input_with_status_2():
    r = subprocess.run(
        [sys.executable, "-m", "engine", "generate", "hi", "--model", "tiny", "--max-tokens", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == "error: max_tokens must be an integer >= 1, got 0"
    assert r.stdout == ""


# ---------------------------------------------------------------- the catalog document


def _cell(s: str) -> str:
    s = " ".join(str(s).split())
    if len(s) > 220:
        s = s[:217] + "..."
    return s.replace("|", "\\|").replace("<", "&lt;")


def catalog_rows(errors: list) -> list[tuple[str, str, str, bool]]:
    rows = []
    for case, err in zip(CASES, errors):
        if err is None:
            msg = "(accepted)"
        elif isinstance(err, CliExit):
            msg = _cell(err)
        else:
            msg = f"`{type(err).__name__}`: {_cell(err)}"
        rows.append((case.entry, _cell(case.bad), msg, case.volatile))
    return rows


DOC_HEAD = """# Bad input: what each public entry point says

Generated by real runs: `.venv/bin/python -m tests.engine.test_bad_input` executes every case of
`tests/engine/test_bad_input.py` and writes this file; `test_catalog_doc_is_current` fails if the errors
below and the real ones drift apart. Every case is also a test asserting the message and, for
entry points that hold an engine, that nothing was allocated or queued (pool, block tables,
queues, requests unchanged) while another request was in flight, which then finishes with the
same tokens as a clean run.

Conventions
- Bad values get a `ValueError` naming the field and the limit, raised before anything is
  allocated; unknown keyword arguments are Python's own `TypeError`.
- `python -m engine generate` prints `error: <the same message>` on stderr and exits with status 2
  (argparse's own usage errors also exit 2).
- App widgets: the pages call the functions listed and show the message (`st.error`/sidebar
  error); widget bounds (sliders, `max_chars`, `min_value`/`max_value`) stop other values earlier.
- Rows marked * contain numbers that depend on the machine (available memory).
- Harmless by design (no error): aborting an unknown, finished or already-aborted request id
  (`LLMEngine.abort_request`/`EngineThread.abort` return False).
- Failures at run time (tests/engine/test_faults.py): an exception in a step's forward fails the
  requests of that step, one while sampling fails that request; their output has
  `finish_reason="error"` and `.error` = `step N failed...`; `RequestHandle.stream()` raises
  `EngineCrashed` with that text, `result()` returns the output; everyone else keeps being served.
  If the loop itself dies, waiting clients get `EngineCrashed("engine loop crashed: ...")`,
  `healthy` is False and `restart()` rebuilds it; `submit` after a crash or `shutdown()` raises
  `EngineCrashed`; `submit` during `reconfigure()` waits for the new engine; in-flight requests
  of a reconfigured engine end with `EngineCrashed("aborted: the engine was reconfigured")`.
- Trace files are parsed with `json` only (never pickle/eval); limits: 256 MiB and 2,000,000 lines
  per file, 16 MiB per line; the replay page's upload limit is 32 MiB.

| Entry point | Bad input | Error |
| --- | --- | --- |
"""


def render_doc(rows) -> str:
    body = "".join(f"| {e} | {b} | {m}{' *' if v else ''} |\n" for e, b, m, v in rows)
    return DOC_HEAD + body


def test_catalog_doc_is_current(catalog):
    assert DOC.exists(), "run: .venv/bin/python -m tests.engine.test_bad_input"
    have = [ln for ln in DOC.read_text().splitlines() if ln.startswith("| ") and not ln.startswith("| Entry")]
    want = render_doc(catalog_rows(catalog)).splitlines()
    want = [ln for ln in want if ln.startswith("| ") and not ln.startswith("| Entry")]
    assert len(have) == len(want)
    for h, w in zip(have, want):
        if w.endswith(" * |"):
            assert h.split(" | ")[:2] == w.split(" | ")[:2]
        else:
            assert h == w


if __name__ == "__main__":
    torch.set_num_threads(1)
    c = Ctx()
    try:
        DOC.parent.mkdir(exist_ok=True)
        DOC.write_text(render_doc(catalog_rows(run_catalog(c))))
    finally:
        c.close()
    print(f"wrote {DOC} ({len(CASES)} cases)")
