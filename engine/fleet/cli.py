"""python -m engine fleet up --instances N --policy P [--model tiny|default] [--num-blocks N]
[--base-port 18000] [--with-vllm] [--state-dir DIR] | fleet down [--state-dir DIR] | fleet status
| fleet record --out trace.json [--instances 3] [--requests 24] [--policies round_robin,kv_aware]
  (starts a fleet on free ports, runs the release-freeze workload per policy, saves a FleetTrace, stops)"""

from __future__ import annotations

import argparse
import json
import sys

from engine.fleet import launcher


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine fleet", description="A local fleet behind vllm-router.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="start N kvscope servers and vllm-router in front")
    u.add_argument("--instances", type=int, default=3)
    u.add_argument("--policy", default="kv_aware", choices=launcher.POLICIES)
    u.add_argument("--model", default="tiny", help="tiny | default | a local folder (as serve --model)")
    u.add_argument("--num-blocks", default="256", help="KV blocks per instance: an integer, or 'small' (64)")
    u.add_argument("--block-size", type=int, default=16)
    u.add_argument("--base-port", type=int, default=18000)
    u.add_argument("--with-vllm", action="store_true", help="add the vLLM peer (scripts/peers.sh) as one more")
    u.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the instances")
    for p in (u, sub.add_parser("down", help="stop what `up` started"), sub.add_parser("status")):
        p.add_argument("--state-dir", default=None)
    r = sub.add_parser("record", help="a fleet session saved as a FleetTrace JSON")
    r.add_argument("--out", required=True)
    r.add_argument("--instances", type=int, default=3)
    r.add_argument("--requests", type=int, default=24)
    r.add_argument("--model", default="tiny")
    r.add_argument("--num-blocks", type=int, default=128)
    r.add_argument("--policies", default="round_robin,kv_aware")
    r.add_argument("--output-tokens", type=int, default=16, help="median max_tokens of the workload")
    r.add_argument("--sample-every", type=float, default=1.0, help="seconds between snapshots")
    r.add_argument("--kill", default="", help="engine id to SIGKILL during the last policy's run (a fault)")
    r.add_argument("--kill-after", type=float, default=2.0, help="seconds into that run")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "record":
            from engine.fleet.runs import run_session

            pols = tuple(p.strip() for p in a.policies.split(",") if p.strip())
            bad = [p for p in pols if p not in launcher.POLICIES]
            if not pols or bad:
                print(f"error: --policies: each must be one of {launcher.POLICIES}, got {bad or pols}", file=sys.stderr)
                return 2
            sess = run_session(
                model=a.model,
                n_instances=a.instances,
                n_requests=a.requests,
                num_blocks=a.num_blocks,
                output_median=a.output_tokens,
                policies=pols,
                sample_every_s=a.sample_every,
                kill=a.kill,
                kill_after_s=a.kill_after,
            )
            cmd = "python -m engine fleet " + " ".join(argv if argv is not None else sys.argv[2:])
            meta = {"command": cmd.strip(), "model": a.model, "instances": a.instances, "policies": list(pols)}
            if a.kill:
                meta["fault"] = f"{a.kill} killed (SIGKILL) {a.kill_after:g} s into the {pols[-1]} run"
            sess.trace(meta).save(a.out)
            for run in sess.runs:
                print(
                    f"{run.policy}: hit rate {run.fleet_hit_rate}, TTFT p50 {run.ttft_p50_s} s, "
                    f"p99 {run.ttft_p99_s} s, {run.output_tok_s} tok/s, dup blocks {run.duplicated_blocks}, "
                    f"errors {run.errors}/{run.requests}, per instance {run.per_instance_requests}"
                )
            print(f"wrote {a.out}")
            return 0
        if a.cmd == "up":
            nb = 64 if a.num_blocks == "small" else int(a.num_blocks)
            fleet = launcher.plan(
                a.instances,
                policy=a.policy,
                model=a.model,
                base_port=a.base_port,
                block_size=a.block_size,
                num_blocks=nb,
                with_vllm=a.with_vllm,
                state_dir=a.state_dir,
            )
            fleet = launcher.up(fleet, timeout_s=a.timeout)
            for i in fleet.instances:
                print(f"{i.engine_id}: {i.url} (events {i.events}, replay {i.replay}, pid {i.pid}, log {i.log})")
            print(f"router ({fleet.router.policy}): {fleet.router.url}/v1 (pid {fleet.router.pid})")
            print(f"state: {fleet.state_dir}/{launcher.STATE_FILE}; stop with `python -m engine fleet down`")
            return 0
        if a.cmd == "down":
            stopped = launcher.down(a.state_dir)
            print("stopped: " + (", ".join(stopped) if stopped else "nothing (no fleet running)"))
            return 0
        fleet = launcher.read_state(a.state_dir)
        print(json.dumps(fleet.to_dict() if fleet else None, indent=1))
        return 0
    except ValueError as e:
        print(f"error: --num-blocks: {e}", file=sys.stderr)
        return 2
    except launcher.FleetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
