"""engine/fleet/launcher.py error paths: a taken port, a missing router binary, an instance that
does not come up (its log tail in the message; nothing left running), bad arguments, and `fleet
down` with nothing to stop."""

from __future__ import annotations

import socket

import pytest

from engine.fleet import launcher, runs
from engine.fleet.cli import main as fleet_main


def test_plan_ports_and_bad_arguments(tmp_path):
    f = launcher.plan(2, base_port=20000, state_dir=tmp_path)
    assert [(i.engine_id, i.port, i.events_port, i.replay_port) for i in f.instances] == [
        ("e0", 20000, 20100, 20200),
        ("e1", 20001, 20101, 20201),
    ]
    assert f.router.port == 20300
    assert launcher.Fleet.from_dict(f.to_dict()) == f
    with pytest.raises(launcher.FleetError, match="instances"):
        launcher.plan(0, state_dir=tmp_path)
    with pytest.raises(launcher.FleetError, match="policy"):
        launcher.plan(1, policy="fastest", state_dir=tmp_path)
    with pytest.raises(launcher.FleetError, match="base_port"):
        launcher.plan(1, base_port=80, state_dir=tmp_path)


def test_router_command_has_event_sources_only_for_kv_aware(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "router_binary", lambda: "vllm-router")
    f = launcher.plan(2, base_port=20000, state_dir=tmp_path)
    kv = launcher.router_command(f, "kv_aware")
    assert kv.count("--kv-event-source") == 2 and kv.count("--kv-event-replay-source") == 2
    assert "http://127.0.0.1:20000=tcp://127.0.0.1:20100" in kv
    assert kv[kv.index("--kv-event-model") + 1] == "tiny"
    assert "--kv-event-source" not in launcher.router_command(f, "round_robin")


def test_taken_port_is_named(tmp_path):
    base = runs.free_base_port(1)
    f = launcher.plan(1, base_port=base, state_dir=tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", base + 100))
        s.listen()
        with pytest.raises(launcher.FleetError, match=f"port {base + 100} .*e0's KV-event port.* taken"):
            launcher.up(f)
    assert launcher.read_state(tmp_path) is None  # nothing was started


def test_missing_router_binary_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher.sys, "executable", str(tmp_path / "nowhere" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(launcher.FleetError, match="vllm-router is missing.*pip install vllm-router==0.1.17"):
        launcher.router_binary()
    with pytest.raises(launcher.FleetError, match="missing"):
        launcher.up(launcher.plan(1, base_port=runs.free_base_port(1), state_dir=tmp_path))
    assert launcher.read_state(tmp_path) is None


def test_instance_that_does_not_come_up_names_itself_and_its_log(tmp_path):
    try:
        launcher.router_binary()
    except launcher.FleetError as e:
        pytest.skip(str(e))
    f = launcher.plan(1, model=str(tmp_path / "no-such-model"), base_port=runs.free_base_port(1), state_dir=tmp_path)
    with pytest.raises(launcher.FleetError, match=r"instance e0 \(http://127.0.0.1:\d+\) exited.*log") as ei:
        launcher.up(f, timeout_s=300)
    assert "no-such-model" in str(ei.value)  # the log tail says what went wrong
    assert launcher.read_state(tmp_path) is None  # up() stopped what it started
    assert not launcher.port_in_use(f.instances[0].port)


def test_down_with_nothing_running(tmp_path, capsys):
    assert launcher.down(tmp_path) == []
    assert fleet_main(["down", "--state-dir", str(tmp_path)]) == 0
    assert "nothing" in capsys.readouterr().out
    assert fleet_main(["up", "--instances", "0", "--state-dir", str(tmp_path)]) == 1
    assert "instances must be" in capsys.readouterr().err


def test_with_vllm_needs_the_default_model_and_the_peer(tmp_path, monkeypatch):
    with pytest.raises(launcher.FleetError, match="--model default"):
        launcher.plan(1, with_vllm=True, state_dir=tmp_path)
    f = launcher.plan(1, model="default", with_vllm=True, base_port=runs.free_base_port(2), state_dir=tmp_path)
    v = f.instances[-1]
    assert v.kind == "vllm" and v.events.startswith("ipc://") and v.replay.startswith("ipc://")
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "empty"))
    try:
        launcher.router_binary()
    except launcher.FleetError as e:
        pytest.skip(str(e))
    with pytest.raises(launcher.FleetError, match="peers.sh install-vllm"):
        launcher.up(f)
    assert launcher.read_state(tmp_path) is None


def test_cli_up_then_down_stops_exactly_what_it_started(tmp_path):
    import subprocess
    import sys

    try:
        launcher.router_binary()
    except launcher.FleetError as e:
        pytest.skip(str(e))
    base = runs.free_base_port(1)
    up_cmd = [sys.executable, "-m", "engine", "fleet", "up", "--instances", "1", "--policy", "round_robin"]
    up_cmd += ["--base-port", str(base), "--num-blocks", "small", "--state-dir", str(tmp_path)]
    r = subprocess.run(up_cmd, capture_output=True, text=True, timeout=900)
    try:
        assert r.returncode == 0, r.stderr
        assert f"router (round_robin): http://127.0.0.1:{base + 300}/v1" in r.stdout
        f = launcher.read_state(tmp_path)
        pids = [f.instances[0].pid, f.router.pid]
        assert all(launcher.pid_alive(p) for p in pids)
        assert launcher.port_in_use(base) and launcher.port_in_use(base + 300)
    finally:
        d = subprocess.run(
            [sys.executable, "-m", "engine", "fleet", "down", "--state-dir", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert d.returncode == 0 and "e0 (pid" in d.stdout and "router (pid" in d.stdout
    assert not any(launcher.pid_alive(p) for p in pids)
    assert not launcher.port_in_use(base) and launcher.read_state(tmp_path) is None
