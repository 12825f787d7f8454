"""python -m engine fleet up --instances N --policy P [--model tiny|default] [--num-blocks N]
[--base-port 18000] [--with-vllm] [--state-dir DIR] | fleet down [--state-dir DIR] | fleet status"""

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
    a = ap.parse_args(argv)
    try:
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
