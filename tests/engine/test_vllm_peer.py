"""The Attach page against a REAL vLLM (the CPU build scripts/peers.sh installs), on the default
model's HF folder. Runs only where that peer venv exists: CI has none, and skips with the reason.

vLLM is started with a concrete events endpoint (tcp://127.0.0.1:PORT), so its publisher connects
and the page's subscriber must bind (mode auto, from GET /kv_event_sources). Two prompts of token
ids share 3 of vLLM CPU's 128-token blocks; the tree the page rebuilds from vLLM's events must be
exactly those blocks (token ids per block, one shared chain, two ends), and vLLM's own prefix-cache
hit counter must say the second prompt reused exactly the shared blocks.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request

import pytest

from engine.bench.peers import peers_dir, vllm_command
from engine.serve.ports import free_port
from tests.waiting import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.slow

BLOCK = 128  # vLLM CPU's default block size; the test also reads it from the server
SHARED = list(range(1000, 1000 + 3 * BLOCK))
PROMPT_A = SHARED + list(range(5000, 5000 + BLOCK + 40))
PROMPT_B = SHARED + list(range(9000, 9000 + BLOCK + 10))


def _post(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def vllm_server():
    if vllm_command() is None:
        pytest.skip(f"no vLLM peer venv in {peers_dir()}/vllm (scripts/peers.sh install-vllm)")
    port, ev, rp = free_port(), free_port(), free_port()
    env = dict(
        os.environ,
        VLLM_PORT=str(port),
        VLLM_EVENTS=f"tcp://127.0.0.1:{ev}",
        VLLM_REPLAY=f"tcp://127.0.0.1:{rp}",
        VLLM_WAIT_S="800",
        VLLM_EXTRA_ARGS="--enforce-eager",  # no compile warm-up: a start in ~1-2 min
        VLLM_PIDFILE=os.path.join(peers_dir(), f"vllm-test-{port}.pid"),
        VLLM_LOG=os.path.join(peers_dir(), f"vllm-test-{port}.log"),
    )
    script = os.path.join(ROOT, "scripts", "peers.sh")
    try:
        subprocess.run(["bash", script, "vllm-start"], env=env, check=True, timeout=850)
        yield f"http://127.0.0.1:{port}"
    finally:
        subprocess.run(["bash", script, "vllm-stop"], env=env, check=False, timeout=60)


def test_attach_rebuilds_vllm_prefix_tree(vllm_server):
    from ui.figures import vllm_metrics as vm
    from ui.servers import attach as A

    s = A.AttachSession(vllm_server, None, None, None, interval=0.5, tokenizer=None)
    try:
        assert s.kind == "vllm"
        assert s.events_bind, s.events_mode_reason  # vLLM's publisher connects: we bind
        # kept sleep: the publisher connects some time after our bind and PUB drops until then; a
        # SUB socket has no signal for a peer's connect, and a probe request would add blocks
        time.sleep(3.0)

        def hits() -> float:
            with urllib.request.urlopen(vllm_server + "/metrics", timeout=30) as r:
                return vm.value(vm.parse_metrics(r.read().decode()), vm.PREFIX_HITS) or 0.0

        h0 = hits()
        for p in (PROMPT_A, PROMPT_B):
            _post(vllm_server + "/v1/completions", {"model": "default", "prompt": p, "max_tokens": 1, "temperature": 0})
        reused = hits() - h0

        def tree_size() -> int:
            with s.lock:
                return len(s.tree)

        wait_until(lambda: tree_size() >= 5, "the 5 blocks' events", 60, 0.2)
        time.sleep(1.0)  # kept: "exactly 5 blocks" below needs time for any extra event to arrive
        view = s.vllm_view()
        with s.lock:
            tree = s.tree
            nodes = {h: (n.parent, n.tokens) for h, n in tree.nodes.items()}
            chains, roots = tree.chains(), tree.roots()
        assert view["block_size"] == BLOCK, view["block_size_from"]
        assert view["block_size_from"] == "vllm:cache_config_info"
        assert reused == len(SHARED)  # vLLM: the second prompt hit exactly the 3 shared blocks
        # the full blocks of each prompt, as vLLM hashes them: A 4, B 4, 3 of them shared
        expect = {tuple(p[i : i + BLOCK]) for p in (PROMPT_A, PROMPT_B) for i in range(0, len(p) - BLOCK + 1, BLOCK)}
        assert len(nodes) == len(expect) == 5
        assert {toks for _, toks in nodes.values()} == expect
        assert chains == 2 and len(roots) == 1
        # each block's parent is the block before it in its prompt
        by_tokens = {toks: h for h, (_, toks) in nodes.items()}
        for p in (PROMPT_A, PROMPT_B):
            prev = None
            for i in range(0, len(p) - BLOCK + 1, BLOCK):
                h = by_tokens[tuple(p[i : i + BLOCK])]
                assert nodes[h][0] == prev or prev is None
                prev = h
    finally:
        s.stop()
        s.join(5)
