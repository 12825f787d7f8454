"""One owner per piece of request and pool state (vLLM v1's split): the Scheduler writes a
request's num_computed_tokens and spec_token_ids (its update methods), the drafter returns drafts,
the BlockManager alone touches its hash index and queues its own KV events, which the engine
drains stamped with their step."""

from __future__ import annotations

import ast
from pathlib import Path

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.observe.recording import drive

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "engine"


def assignments(attr: str) -> set[str]:
    """Files under engine/ that assign `<something>.<attr> = ...` (or +=)."""
    out = set()
    for p in ENGINE.rglob("*.py"):
        for n in ast.walk(ast.parse(p.read_text())):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AugAssign) else []
            if any(isinstance(t, ast.Attribute) and t.attr == attr for t in targets):
                out.add(str(p.relative_to(ROOT)))
    return out


def readers(attr: str) -> set[str]:
    return {
        str(p.relative_to(ROOT))
        for p in ENGINE.rglob("*.py")
        if any(isinstance(n, ast.Attribute) and n.attr == attr for n in ast.walk(ast.parse(p.read_text())))
    }


def test_the_scheduler_alone_writes_token_bookkeeping():
    assert assignments("num_computed_tokens") == {"engine/core/scheduler.py"}
    assert assignments("spec_token_ids") == {"engine/core/scheduler.py"}


def test_who_submitted_a_request_and_its_shown_text_are_set_when_it_is_created():
    """origin and prompt_text go through add_request into the Request constructor: EngineThread
    and the core process no longer write them into the engine's requests afterwards."""
    assert assignments("origin") == set()
    assert assignments("prompt_text") == set()
    eng = LLMEngine(EngineConfig(model="tiny", num_threads=1, block_size=4, num_kv_blocks=32))
    ids = eng.apply_chat_template("hello")
    rid = eng.add_request(None, ids, SamplingParams(max_tokens=1), origin="http", prompt_text="hello")
    assert eng.requests[rid].origin == "http" and eng.requests[rid].prompt_text == "hello"
    info = {r.request_id: r for r in eng.snapshot().requests}[rid]
    assert info.origin == "http" and info.prompt_preview == "hello"
    plain = eng.add_request(None, "plain text", SamplingParams(max_tokens=1))
    assert eng.requests[plain].origin == "engine" and eng.requests[plain].prompt_text == "plain text"


def test_the_block_manager_alone_touches_its_hash_index():
    assert readers("hash_to_block") == {"engine/core/block_manager.py"}
    assert readers("hash_content") == {"engine/core/block_manager.py"}
    assert readers("hash_listener") == set()


def test_kv_events_are_queued_by_the_block_manager_and_stamped_with_their_step():
    eng = LLMEngine(EngineConfig(model="tiny", num_threads=1, block_size=4, num_kv_blocks=32))
    assert eng.enable_kv_events() == []  # nothing cached yet
    rid = eng.add_request(None, list(range(10, 23)), SamplingParams(max_tokens=4, ignore_eos=True))
    steps = []
    while eng.has_unfinished_requests():
        eng.step()
        steps.append(eng.step_num)
    evs = eng.take_kv_events()
    stored = [e for e in evs if e[1] == "stored"]
    assert stored and {e[0] for e in stored} <= set(steps)
    assert [e[2] for e in stored] == eng.bm.cached_hashes()  # every cached block, in order, once
    assert stored[0][3] is None and stored[1][3] == stored[0][2]  # the parent chain
    assert stored[0][4] == (10, 11, 12, 13)
    assert eng.take_kv_events() == []  # drained
    last = eng.step_num
    dropped, kept = eng.bm.reset_prefix_cache()  # between steps: the step number stays
    removed = eng.take_kv_events()
    assert dropped == len(stored) and kept == 0
    assert [(e[0], e[1], e[2]) for e in removed] == [(last, "removed", e[2]) for e in stored]
    eng.disable_kv_events()
    eng.add_request(rid + "b", list(range(10, 23)), SamplingParams(max_tokens=2, ignore_eos=True))
    drive(eng)
    assert eng.take_kv_events() == []  # nobody asked: nothing queued
    assert eng.enable_kv_events()  # re-enabled: every block cached now, as "stored"
