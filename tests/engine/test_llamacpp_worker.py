"""engine/bench/peers.LlamaCppBs1: llama.cpp's batch-1 decode kept loaded in a subprocess, one timed
pass per call, so `bench roofline`, `bench peers` and scripts/bs1_vs_llamacpp.py alternate its passes
with kvscope's rounds. The peer venv is not installed in the test run: a stand-in `llama_cpp` module
(the four calls the worker makes) is put on the subprocess's path and this Python serves as the peer's."""

import sys
import textwrap

import pytest

from engine.bench import peers

FAKE = textwrap.dedent(
    """
    import os
    __version__ = "0.0-test"

    class Llama:
        def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, n_batch, verbose):
            if os.environ.get("FAKE_LLAMA_FAIL") == "load":
                raise RuntimeError("cannot load " + model_path)
            print("a library's chatter on stdout", flush=True)
            self.n_ctx, self.seq = n_ctx, []

        def reset(self):
            self.seq = []

        def eval(self, toks):
            if os.environ.get("FAKE_LLAMA_FAIL") == "eval" and len(self.seq) > 3:
                raise RuntimeError("eval failed")
            if os.environ.get("FAKE_LLAMA_FAIL") == "hang":
                import time
                time.sleep(60)
            self.seq += list(toks)
            assert len(self.seq) <= self.n_ctx

        def sample(self, temp):
            return (sum(self.seq) * 31 + len(self.seq)) % 1000
    """
)


@pytest.fixture
def fake_peer(tmp_path, monkeypatch):
    (tmp_path / "llama_cpp.py").write_text(FAKE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(peers, "llamacpp_python", lambda: sys.executable)
    return tmp_path


def greedy(prompt, n):
    seq, out = list(prompt), []
    for _ in range(n):
        tok = (sum(seq) * 31 + len(seq)) % 1000
        out.append(tok)
        seq.append(tok)
    return out


def test_passes_alternate_with_the_callers_work_and_the_worker_stops(fake_peer):
    prompt = [5, 7, 11]
    with peers.LlamaCppBs1("/some.gguf", prompt, 6, 1, max_passes=3, timeout=60) as lc:
        assert lc.why is None and lc.version == "0.0-test"
        proc = lc.proc
        rates = [lc.one() for _ in range(3)]
        assert all(r > 0 for r in rates) and lc.rates == rates
        assert lc.tokens == greedy(prompt, 6)  # the worker's own greedy passes, its stdout chatter skipped
        assert lc.one() is None and "at most 3 passes" in lc.why  # bounded
        r = lc.result()
    assert r["tok_s"] == max(rates) and r["rates"] == rates and r["tokens"] == greedy(prompt, 6)
    assert lc.proc is None and proc.poll() == 0 and lc.returncode == 0  # asked to quit, and it did


def test_llamacpp_decode_bs1_is_the_worker_on_its_own(fake_peer):
    r = peers.llamacpp_decode_bs1("/some.gguf", [1, 2], 4, 2, reps=2, timeout=60)
    assert len(r["rates"]) == 2 and r["tokens"] == greedy([1, 2], 4) and r["version"] == "0.0-test"


@pytest.mark.parametrize("fail", ["load", "eval"])
def test_a_failing_peer_says_why_and_returns_none(fake_peer, monkeypatch, fail):
    monkeypatch.setenv("FAKE_LLAMA_FAIL", fail)
    lc = peers.LlamaCppBs1("/some.gguf", [1, 2], 4, 1, timeout=60)
    # the warm-up pass fails in both cases, so the worker never says it is ready
    assert lc.why.startswith("llama.cpp peer failed: exited with 1") and "RuntimeError" in lc.why
    assert lc.one() is None and lc.result() == {"why": lc.why} and lc.proc is None and lc.returncode == 1


def test_a_hung_peer_times_out_and_is_killed(fake_peer, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_FAIL", "hang")
    lc = peers.LlamaCppBs1("/some.gguf", [1, 2], 4, 1, timeout=1)
    assert "no answer in 1 s" in lc.why and lc.proc is None
    assert lc.returncode == -9  # killed, not waited out (the stand-in sleeps 60 s)


def test_without_the_peer_environment_it_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(peers, "llamacpp_python", lambda: None)
    lc = peers.LlamaCppBs1("/some.gguf", [1], 2, 1)
    assert "scripts/peers.sh install-llamacpp" in lc.why and lc.one() is None
    lc.close()
    assert peers.llamacpp_decode_bs1("/some.gguf", [1], 2, 1)["why"] == lc.why
