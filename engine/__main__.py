"""Command line: python -m engine generate "prompt" [--max-tokens N] [--temperature T] [--json]
python -m engine bench SUITE [--quick] [--json]
python -m engine soak [...]
python -m engine serve [--model M] [--port 8000] [...]   (OpenAI-compatible API)
python -m engine fleet up|down [...]   (N servers behind vllm-router)"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _generate(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m engine generate",
        description="Generate text with kvscope's engine and print a one-line summary.",
    )
    ap.add_argument("prompt", help="the user message (the chat template is applied unless --raw)")
    ap.add_argument("--model", default=os.environ.get("KVSCOPE_MODEL", "default"))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    a = ap.parse_args(argv)
    from engine.config import EngineConfig, SamplingParams

    try:
        params = SamplingParams(
            temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, max_tokens=a.max_tokens, seed=a.seed
        )
        cfg = EngineConfig(model=a.model, device=a.device, block_size=a.block_size, num_kv_blocks=a.num_kv_blocks)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not a.prompt.strip():
        print("error: prompt must not be empty", file=sys.stderr)
        return 2
    from engine.core.engine import LLMEngine

    t_load = time.perf_counter()
    try:
        eng = LLMEngine(cfg)
        prompt = a.prompt if a.raw else eng.apply_chat_template(a.prompt)
        rid = eng.add_request("cli", prompt, params)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - t_load
    sent = ""
    peak_blocks = 0
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
            peak_blocks = max(peak_blocks, len(eng.bm.table(rid)))
            text = o.outputs[0].text
            if not a.json and text.startswith(sent):
                delta = text[len(sent) :] if o.finished else text[len(sent) :].rstrip("\ufffd")
                if delta:
                    sys.stdout.write(delta)
                    sys.stdout.flush()
                    sent += delta
    m = out.metrics
    n = len(out.outputs[0].token_ids)
    decode_s = (m.finish_time - m.first_token_time) if n > 1 else 0.0
    summary = {
        "text": out.outputs[0].text,
        "token_ids": out.outputs[0].token_ids,
        "prompt_tokens": len(out.prompt_token_ids),
        "output_tokens": n,
        "finish_reason": out.outputs[0].finish_reason,
        "ttft_s": round(m.ttft, 4),
        "tok_s": round((n - 1) / decode_s, 2) if decode_s > 0 else None,
        "e2e_s": round(m.e2e_latency, 4),
        "kv_blocks_used": peak_blocks,
        "kv_bytes": peak_blocks * eng.bytes_per_block,
        "block_size": eng.config.block_size,
        "model": cfg.model,
        "device": str(eng.device),
        "load_s": round(load_s, 2),
    }
    if a.json:
        print(json.dumps(summary))
    else:
        print()
        tps = f"{summary['tok_s']} tok/s" if summary["tok_s"] else "n/a tok/s"
        print(
            f"[{n} tokens ({summary['finish_reason']}) | prompt {summary['prompt_tokens']} tokens | "
            f"TTFT {m.ttft * 1000:.0f} ms | {tps} | KV blocks used {peak_blocks} "
            f"({peak_blocks * eng.bytes_per_block / 1024:.0f} KiB, block_size {eng.config.block_size}) | "
            f"{cfg.model} on {eng.device}]",
            file=sys.stderr,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmds = ("generate", "bench", "soak", "serve", "fleet")
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in cmds:
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "generate":
        return _generate(rest)
    if cmd == "bench":
        from engine.bench import main as bench_main

        return bench_main(rest)
    if cmd == "serve":
        from engine.serve.cli import main as serve_main

        return serve_main(rest)
    if cmd == "fleet":
        from engine.fleet.cli import main as fleet_main

        return fleet_main(rest)
    from engine.lab.soak_cli import main as soak_main

    return soak_main(rest)


if __name__ == "__main__":
    sys.exit(main())
