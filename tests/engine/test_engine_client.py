"""EngineClient against a real engine-core process (engine/core/client.py, core_proc.py):
submit and stream, abort, evict, KV budget, snapshots and events, bad input, reconfigure, a crash
of the core, a killed core, a client process that dies (its requests aborted, invariants checked
in the core), a slow reader (snapshot frames dropped and counted, outputs never), and greedy
token ids identical to the in-thread engine's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core import placement
from engine.core.client import EngineClient
from engine.core.thread import EngineCrashed
from tests.engine.engines import TINY_CORE

pytestmark = pytest.mark.slow

CFG = TINY_CORE
PROMPTS = ["Hello there", "Name three colours.", "Once upon a time", "def f(x):\n    return"]
WAIT_S = 300  # hang guards on a busy machine, not speed limits


@pytest.fixture(scope="module")
def client():
    c = EngineClient(EngineConfig(**CFG), cpus=placement.plan().core)  # pinned as the app pins it
    yield c
    c.close()


def wait_until(cond, timeout=WAIT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_greedy_ids_identical_to_the_in_thread_engine(client):
    """The exactness contract through the boundary: same prompts, same greedy ids, batched."""
    params = SamplingParams(max_tokens=16, temperature=0.0)
    ref = LLM(**CFG).generate(PROMPTS, params)
    handles = [client.submit(p, params) for p in PROMPTS]
    streamed = ["".join(h.stream(timeout=WAIT_S)) for h in handles]
    for h, r, text in zip(handles, ref, streamed):
        out = h.result(timeout=WAIT_S)
        assert out.outputs[0].token_ids == r.outputs[0].token_ids
        assert text == out.outputs[0].text == r.outputs[0].text
    client.check_invariants()


def test_placement_read_from_the_core_process(client):
    """The core reports where it runs, read from the OS in its own process: its pid, the CPUs
    the app's plan gave it (where the OS allows pinning), its threads."""
    where = client.placement_now()
    assert where["pid"] == client.core_pid != os.getpid()
    assert where["torch_threads"] == CFG["num_threads"]
    assert where["os_threads"] >= 1
    want = placement.plan().core
    allowed = placement.allowed_cpus(client.core_pid)
    assert where["cpus"] == allowed
    if want and placement.pin(placement.allowed_cpus()):  # pinning allowed here
        assert allowed == want


def test_plan_splits_the_cpus():
    assert placement.plan([0, 1], core=[]) == placement.Plan(core=[1], front=[0])
    assert placement.plan([0, 1, 2, 3], core=[]) == placement.Plan(core=[1, 2, 3], front=[0])
    assert placement.plan([0], core=[]) == placement.Plan(core=None, front=None)
    assert placement.plan([0, 1, 2], core=[2]) == placement.Plan(core=[2], front=[0, 1])
    assert placement.plan([0, 1], core=[0, 1]) == placement.Plan(core=[0, 1], front=None)


def test_hold_stops_steps_and_resume(client):
    client.hold(30)
    try:
        h = client.submit("Hello", SamplingParams(max_tokens=4))
        time.sleep(0.3)  # kept: a hold is the absence of steps; give the core time it would have stepped in
        assert not h.finished and client.snapshot_now().step == client.snapshot_now().step
    finally:
        client.hold(0)
    assert h.result(timeout=WAIT_S).finished


def test_chat_submit_and_snapshot_events(client):
    h = client.submit("Name two colours.", SamplingParams(max_tokens=6), chat=True, origin="http")
    out = h.result(timeout=WAIT_S)
    assert out.finished and len(out.outputs[0].token_ids) == 6
    snap = client.snapshot_now()
    req = snap.request(h.request_id)
    assert req is not None and req.state == "finished" and req.origin == "http" and req.output_len == 6
    assert wait_until(lambda: client.snapshot().step >= snap.step)  # the published frames follow
    kinds = {e.kind for e in client.events.since(0) if e.request_id == h.request_id}
    assert {"admit", "prefill", "decode", "finish"} <= kinds
    assert client.events.last_seq >= max(e.seq for e in client.events.since(0))
    assert client.recent_snapshots()


def test_abort_ends_the_stream_and_frees_blocks(client):
    h = client.submit("Once upon a time", SamplingParams(max_tokens=300, ignore_eos=True))
    assert wait_until(lambda: h.output is not None)
    assert client.abort(h.request_id) is True
    assert h.finished
    list(h.stream(timeout=WAIT_S))  # ends, no error
    snap = client.snapshot_now()
    assert snap.request(h.request_id).state == "aborted"
    assert snap.metrics.num_blocks_used == 0
    client.check_invariants()


def test_evict_mid_run_recomputes_to_the_same_answer(client):
    # long enough that the eviction lands mid-run on a fast machine too (40 tokens of the tiny
    # model could finish between seeing its second token and the eviction's arrival)
    params = SamplingParams(max_tokens=300, ignore_eos=True)
    plain = client.submit("Why is the sky blue?", params).result(timeout=WAIT_S).outputs[0].token_ids
    h = client.submit("Why is the sky blue?", params)
    assert wait_until(lambda: h.output is not None and len(h.output.outputs[0].token_ids) >= 2)
    try:
        r = client.evict(h.request_id)
        assert r["blocks_freed"] > 0
    except ValueError:
        pytest.skip("finished before the eviction (machine too fast for this race)")
    assert h.result(timeout=WAIT_S).outputs[0].token_ids == plain
    assert any(e.request_id == h.request_id for e in client.events.since(0, kinds=["evict"]))
    client.check_invariants()


def test_bad_input_is_a_message_and_the_core_keeps_serving(client):
    with pytest.raises(ValueError, match="max_tokens"):
        client.submit("x", SamplingParams(max_tokens=10**9))
    with pytest.raises(ValueError, match="prompt"):
        client.submit("   ", SamplingParams(max_tokens=4), chat=True)
    with pytest.raises(ValueError):
        client.evict("no-such-request")
    assert client.healthy
    assert client.submit("Hello", SamplingParams(max_tokens=3)).result(timeout=WAIT_S).finished


def test_submit_many_is_one_command_each_answer_its_own(client):
    """The API's batches: one command, each item its handle or its own error."""
    p = SamplingParams(max_tokens=3, temperature=0.0)
    got = client.submit_many(
        [
            ("Hello", p, {"origin": "http"}),
            ("x", SamplingParams(max_tokens=10**9), {}),
            ("Hi there", p, {"chat": True, "request_id": "many-1"}),
            ("again", p, {"request_id": "many-1"}),
        ]
    )
    assert isinstance(got[1], ValueError) and "max_tokens" in str(got[1])
    assert isinstance(got[3], ValueError) and "already in use" in str(got[3])
    assert got[2].request_id == "many-1"
    for h in (got[0], got[2]):
        assert h.result(timeout=WAIT_S).finished
    client.check_invariants()


def test_kv_budget_and_preview(client):
    client.set_kv_budget(64)
    assert client.snapshot_now().info.num_blocks == 64
    client.set_kv_budget(96)
    p = client.preview("Name three colours.", SamplingParams(max_tokens=8))
    assert len(p.token_ids) > p.content_tokens > 0
    assert client.engine.max_completion_tokens(10) > 0
    assert client.engine.has_unfinished_requests() is False


def test_slow_reader_drops_snapshot_frames_never_outputs():
    """A listener that stalls the client's reader: the core keeps stepping, drops (and counts)
    snapshot frames it cannot send, and every output still arrives. (Frames are pushed on a timer
    here; by default the core publishes as fast as they are read, so frames rarely pile up.)"""
    client = EngineClient(EngineConfig(**CFG), push_snapshots=True)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    ref = LLM(**CFG).generate(["Once upon a time"], params)[0].outputs[0].token_ids
    before = client.dropped_snapshot_frames
    client.call("pace", seconds=0.02)
    try:
        h = client.submit("Once upon a time", params, listener=lambda: time.sleep(0.2))
        assert h.result(timeout=WAIT_S).outputs[0].token_ids == ref
        assert wait_until(lambda: client.dropped_snapshot_frames > before, timeout=30)
        client.check_invariants()
    finally:
        client.close()


def test_reconfigure_aborts_in_flight_with_a_reason():
    c = EngineClient(EngineConfig(**CFG))
    try:
        c.call("pace", seconds=0.5)  # still running when the new core is ready
        h = c.submit("Once upon a time", SamplingParams(max_tokens=300, ignore_eos=True))
        assert wait_until(lambda: h.output is not None)
        msg = c.reconfigure(EngineConfig(**{**CFG, "block_size": 8}))
        assert "engine rebuilt" in msg
        with pytest.raises(EngineCrashed, match="reconfigured"):
            h.result(timeout=WAIT_S)
        assert c.healthy and c.snapshot().info.block_size == 8
        assert c.submit("Hello", SamplingParams(max_tokens=3)).result(timeout=WAIT_S).finished
        with pytest.raises(ValueError):
            c.reconfigure(EngineConfig(**{**CFG, "model": "no/such-model-here"}))
        assert c.healthy  # a bad config leaves the running core serving
    finally:
        c.close()


def test_core_crash_reaches_every_client_then_restart():
    c = EngineClient(EngineConfig(**CFG))
    try:
        hs = [c.submit(p, SamplingParams(max_tokens=150, ignore_eos=True)) for p in PROMPTS[:2]]
        c.call("crash_next_step", message="injected fault")
        for h in hs:
            with pytest.raises(EngineCrashed, match="injected fault"):
                h.result(timeout=WAIT_S)
        assert wait_until(lambda: not c.healthy)
        assert "injected fault" in c.error
        assert c.snapshot().healthy is False
        with pytest.raises(EngineCrashed):
            c.submit("Hello", SamplingParams(max_tokens=3))
        c.restart()
        assert c.healthy and c.submit("Hello", SamplingParams(max_tokens=3)).result(timeout=WAIT_S).finished
    finally:
        c.close()


def test_killed_core_fails_requests_nothing_hangs():
    c = EngineClient(EngineConfig(**CFG))
    try:
        h = c.submit("Once upon a time", SamplingParams(max_tokens=300, ignore_eos=True))
        assert wait_until(lambda: h.output is not None)
        os.kill(c.core_pid, 9)
        with pytest.raises(EngineCrashed, match="exited"):
            h.result(timeout=WAIT_S)
        assert not c.healthy
        with pytest.raises(EngineCrashed):
            c.snapshot_now()
    finally:
        c.close()


def test_client_process_dies_core_aborts_its_requests_and_leaks_nothing(tmp_path, repo_root):
    """The client's process is killed mid-generation: its core notices, aborts every request,
    checks the invariants and exits (it reports to KVSCOPE_CORE_EXIT_REPORT)."""
    report = tmp_path / "core_exit.txt"
    script = textwrap.dedent(f"""
        import time
        from engine import SamplingParams
        from engine.config import EngineConfig
        from engine.core.client import EngineClient
        if __name__ == "__main__":
            c = EngineClient(EngineConfig(**{CFG!r}))
            hs = [c.submit(p, SamplingParams(max_tokens=300, ignore_eos=True)) for p in {PROMPTS!r}]
            while hs[0].output is None:
                time.sleep(0.02)
            print(c.core_pid, flush=True)
            time.sleep(600)  # kept: the child stays alive until the test kills it
    """)
    env = {**os.environ, "KVSCOPE_CORE_EXIT_REPORT": str(report), "PYTHONPATH": str(repo_root)}
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env, cwd=repo_root)
    try:
        core_pid = int(p.stdout.readline())
        p.kill()
        p.wait(WAIT_S)
        assert wait_until(lambda: report.exists() and report.read_text().endswith("\n"))
        assert report.read_text().strip() == "aborted-and-invariants-ok blocks_used=0"

        def gone():
            try:
                os.kill(core_pid, 0)
            except ProcessLookupError:
                return True
            with open(f"/proc/{core_pid}/stat") as f:  # a zombie waiting for init counts as gone
                return f.read().split()[2] == "Z"

        assert wait_until(gone)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(WAIT_S)
        p.stdout.close()


def test_config_is_the_cores_resolved_config():
    """max_model_len left unset is resolved by the core's engine (the model's own limit: 8192 for
    the tiny model); the client reports that value, not the None it was handed."""
    cfg = {k: v for k, v in CFG.items() if k != "max_model_len"}
    c = EngineClient(EngineConfig(**cfg))
    try:
        assert EngineConfig(**cfg).max_model_len is None
        assert c.config.max_model_len == 8192
    finally:
        c.shutdown()


def test_core_counts_what_its_clients_ask_and_frames_match_the_engine(client):
    """op_stats (what watched_profile reads): commands by name with their seconds, steps, and the
    snapshot frames built (their bytes); a frame read back equals the core's snapshot_now."""
    before = client.call("stats")
    h = client.submit("Hello there", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    h.result(timeout=WAIT_S)
    after = client.call("stats")
    assert after["ops"]["submit"][0] == before["ops"].get("submit", (0, 0.0))[0] + 1
    assert after["steps"] >= before["steps"] + 6
    assert after["frames"] >= before["frames"] and after["frame_bytes"] >= before["frame_bytes"]
    snap = client.snapshot_now()
    req = snap.request(h.request_id)
    assert req is not None and req.is_terminal and req.output_len == 6
    assert type(req.block_table) is tuple and client.snapshot().request(h.request_id) == req
