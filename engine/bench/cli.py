"""Command line: `python -m engine bench SUITE [SUITE ...] [--quick] [--json] [options]`.

stdout carries the table(s) and, with --json, one JSON object as its LAST line; the progress bar
and library chatter go to stderr. Exit status: 0 when every suite ran, 2 when a suite reported
"not available: <reason>" (a missing engine feature), 1 when a suite failed with an error.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback
from dataclasses import dataclass


@dataclass(frozen=True)
class Suite:
    name: str
    func_name: str  # attribute of engine.bench.suites (imported lazily: it pulls in torch)
    phases: int  # progress-bar steps (normal mode; --quick uses the same bar)
    about: str
    module: str = "suites"  # engine.bench.<module> holds func_name


SUITES: dict[str, Suite] = {
    s.name: s
    for s in (
        Suite(
            "throughput",
            "suite_throughput",
            8,
            "W16 on kvscope vs transformers sequential / static batch / "
            "generate_batch, plus W64 (kvscope, static); outputs_match",
        ),
        Suite(
            "roofline",
            "suite_roofline",
            8,
            "measured matmul GFLOP/s and read bandwidth; kvscope W16 vs the compute "
            "roof and batch-1 decode vs the memory roof",
        ),
        Suite(
            "memory",
            "suite_memory",
            3,
            "release-freeze workload on the paged and contiguous allocators: waste, max concurrency",
        ),
        Suite(
            "prefix",
            "suite_prefix",
            3,
            "1,000-token shared system prompt, 16 questions: TTFT with and without prefix caching",
        ),
        Suite("speculative", "suite_speculative", 6, "plain vs each drafter on passage-editing and open-ended prompts"),
        Suite("cache", "suite_cache", 2, "cost per generated token with and without the KV cache as context grows"),
        Suite("threads", "suite_threads", 2, "matmul time at 1 vs all threads, idle and with one core busy"),
        Suite(
            "kvquant",
            "suite_kvquant",
            7,
            "each kv_cache_dtype vs the fp32 pool: greedy agreement, KL, short-prompt top-1 agreement, needle "
            "recall, recall at growing context, tokens per MiB, decode tok/s (engine/bench/kvquant.py)",
        ),
        Suite(
            "serve",
            "suite_serve",
            4,
            "W16 through the HTTP API (16 concurrent streams) vs in-process LLM.generate; client-side TTFT / ITL",
            module="serve",
        ),
        Suite(
            "peers",
            "suite_peers",
            5,
            "kvscope vs vLLM CPU and llama.cpp on the same weights (scripts/peers.sh): batch-1 decode, "
            "W16 over HTTP, greedy agreement, TTFT with a cached 1k prefix",
            module="vs_peers",
        ),
        Suite(
            "packets",
            "suite_packets",
            2,
            "the packet-size side channel over TLS on 127.0.0.1: the attack on record lengths without a "
            "defence and with obfuscation / coalescing / fixed-size chunks, their bytes and time",
            module="packets",
        ),
        Suite(
            "weights",
            "suite_weights",
            3,
            "batch-1 decode tok/s per weight format (fp32 copies, Q8_0 and Q4_1 read in place) beside the "
            "bytes each reads per step and the per-op split",
            module="weight_formats",
        ),
        Suite(
            "scaling",
            "suite_scaling",
            8,
            "cost as work grows, kvscope vs llama.cpp vs vLLM CPU: TTFT against prompt length (128 -> 8k), "
            "decode tok/s against context, output tok/s against concurrency (1 -> 64), each point beside its "
            "limit (engine/bench/scaling.py)",
            module="scaling",
        ),
        Suite(
            "fleet",
            "suite_fleet",
            2,
            "3 kvscope servers behind vllm-router, release-freeze under round_robin / kv_aware / cache_aware: "
            "fleet hit rate, TTFT p50/p99, output tok/s, duplicated blocks (engine/bench/fleet.py)",
            module="fleet",
        ),
    )
}
DEFAULT_ALL = ("throughput", "roofline", "memory", "prefix", "speculative", "cache")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m engine bench",
        description="Benchmarks kvscope against transformers on the same workload in one process run, "
        "with the machine's measured limits beside them.",
        epilog="suites: "
        + "; ".join(f"{s.name}: {s.about}" for s in SUITES.values())
        + f"; all: {', '.join(DEFAULT_ALL)}",
    )
    p.add_argument("suites", nargs="+", metavar="SUITE", help=f"one or more of {', '.join(SUITES)}, or all")
    p.add_argument(
        "--quick", action="store_true", help="smaller workloads (each suite well under 3 minutes on 2 cores)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line of stdout")
    p.add_argument("--model", default="default", help="model for kvscope and the peers (default: %(default)s)")
    p.add_argument(
        "--threads",
        default="auto",
        help="torch intra-op threads for kvscope and the peers alike: a number, 'auto' (measure "
        "1 vs all cores on the model's matmuls and take the faster; the default) or "
        "'default' (leave torch's own setting)",
    )
    p.add_argument("--out", default=None, help="results folder (default: ./results or $KVSCOPE_RESULTS_DIR)")
    p.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    p.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # tests: tiny workloads
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="extra EngineConfig field for kvscope runs, e.g. --set max_num_batched_tokens=1024",
    )
    return p


def parse_set(items: list[str]) -> dict:
    """--set k=v pairs -> dict with ints/floats/bools/None parsed."""
    out = {}
    for it in items:
        if "=" not in it:
            raise ValueError(f"--set expects FIELD=VALUE, got {it!r}")
        k, v = it.split("=", 1)
        k, v = k.strip(), v.strip()
        low = v.lower()
        if low in ("true", "false"):
            val = low == "true"
        elif low in ("none", "null"):
            val = None
        else:
            try:
                val = int(v)
            except ValueError:
                try:
                    val = float(v)
                except ValueError:
                    val = v
        out[k] = val
    return out


def parse_threads(v):
    """'auto' | 'default' | an integer >= 1."""
    if v in ("auto", "default"):
        return v
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise ValueError(f"--threads must be a number, 'auto' or 'default', got {v!r}") from None
    if n < 1:
        raise ValueError("--threads must be >= 1")
    return n


def resolve_suites(names: list[str]) -> list[str]:
    out = []
    for n in names:
        if n == "all":
            out.extend(s for s in DEFAULT_ALL if s not in out)
        elif n in SUITES:
            if n not in out:
                out.append(n)
        else:
            raise ValueError(f"unknown suite {n!r}: choose from {', '.join(SUITES)} or all")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":  # tolerate being handed the sub-command name too
        argv = argv[1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        names = resolve_suites(args.suites)
        engine_args = parse_set(args.set)
        threads = parse_threads(args.threads)
    except ValueError as e:
        parser.error(str(e))  # exits 2 with usage

    from engine.bench import report as rep
    from engine.bench.common import BenchContext, machine_info

    out = sys.stdout
    import torch  # (after argument errors, which should be fast)

    out_dir = rep.results_dir(args.out)
    total = sum(SUITES[n].phases for n in names) + (1 if threads == "auto" else 0)
    progress = rep.Progress(total, label="bench")
    ctx = BenchContext(
        quick=args.quick or args.smoke,
        smoke=args.smoke,
        model=args.model,
        out_dir=out_dir,
        engine_args=engine_args,
        plots=not args.no_plots,
        progress=progress,
    )
    thread_policy = {"requested": args.threads}
    if isinstance(threads, int):
        torch.set_num_threads(threads)
        ctx.threads = threads
    elif threads == "auto":
        progress.start("thread probe (1 vs all cores)")
        try:
            from engine.bench.machine_rates import probe_threads
            from engine.bench.roofline import ModelShape

            with contextlib.redirect_stdout(sys.stderr):
                shape = ModelShape.from_config(ctx.hf()[0].config)
                probe = probe_threads(shape, rounds=2 if args.smoke else 3)
            torch.set_num_threads(probe["threads"])
            ctx.threads = probe["threads"]
            thread_policy["probe_ms"] = probe["ms"]
        except Exception as e:  # the probe must never stop a run: fall back to torch's default
            thread_policy["probe_error"] = f"{type(e).__name__}: {e}"
        progress.advance("thread probe")
    thread_policy["used"] = torch.get_num_threads()
    machine = machine_info()
    try:  # the path the C kernels were built for: every figure is read beside it
        from engine.model import kernel_isa

        machine["isa"] = kernel_isa.summary()
    except Exception as e:  # never stops a run
        machine["isa"] = f"unknown ({type(e).__name__})"
    summary = {
        "suite": names[0] if len(names) == 1 else ",".join(names),
        "quick": args.quick,
        "model": args.model,
        "torch_threads": machine["torch_threads"],
        "thread_policy": thread_policy,
        "machine": machine,
        "suites": {},
    }
    status = 0
    tables = []
    t_all = time.perf_counter()
    for name in names:
        suite = SUITES[name]
        t0 = time.perf_counter()
        import importlib

        func = getattr(importlib.import_module(f".{suite.module}", __package__), suite.func_name)
        try:
            with contextlib.redirect_stdout(sys.stderr):  # stray prints must not break the table/JSON
                result = func(ctx)
        except rep.BenchUnavailable as e:
            msg = f"not available: {e}"
            summary["suites"][name] = msg
            tables.append(f"== {name} ==\n{msg}")
            print(f"[{name}] {msg}", file=sys.stderr)
            status = status or 2
            continue
        except Exception as e:  # a failing suite is reported, the others still run
            msg = f"error: {type(e).__name__}: {e}"
            summary["suites"][name] = msg
            tables.append(f"== {name} ==\n{msg}")
            traceback.print_exc(file=sys.stderr)
            status = 1
            continue
        wall = time.perf_counter() - t0
        summary["suites"][name] = "ok"
        for k, v in result.fields.items():
            # the first suite to report a field keeps its plain name (throughput's kvscope_tok_s
            # in `all`); a later suite's same field is prefixed (roofline_kvscope_tok_s)
            key = k if k not in summary else f"{name}_{k}"
            summary[key] = v
        summary[f"{name}_wall_s"] = wall
        plot_notes = []
        if ctx.plots:
            for stem, fig in result.figures:
                path = os.path.join(out_dir, f"{name}-{stem}.png")
                note = rep.save_png(fig, path, width=900, height=500)
                if note:
                    plot_notes.append(note)
                    break  # same reason for every plot
                ctx.files.append(path)
        for n_ in plot_notes:
            ctx.note(n_)
        fpath = rep.write_results(
            name,
            {
                "suite": name,
                "quick": args.quick,
                "model": args.model,
                "machine": machine,
                "wall_s": wall,
                "fields": result.fields,
                "notes": ctx.notes,
            },
            out_dir,
        )
        ctx.files.append(fpath)
        head = (
            f"== {name} == ({'quick, ' if args.quick else ''}{args.model}, {ctx.dtype()}, "
            f"torch threads {machine['torch_threads']}, {wall:.0f} s)"
        )
        tables.append(rep.format_table(result.rows, title=head))
    progress.close()
    summary["wall_s"] = time.perf_counter() - t_all
    summary["notes"] = ctx.notes
    summary["files"] = ctx.files
    summary["exit_status"] = status

    text = "\n\n".join(tables)
    out.write(text + "\n")
    probe = thread_policy.get("probe_ms")
    foot = [
        f"machine: {machine['nproc']} cpus, {machine['cpu']}"
        f"{' (' + machine['cpu_id'] + ')' if machine.get('cpu_id') else ''}, torch {machine['torch']} "
        f"({machine['torch_threads']} threads, --threads {args.threads}"
        + (", probe ms " + ", ".join(f"{k} thr {v:.1f}" for k, v in probe.items()) if probe else "")
        + f"), transformers {machine['transformers']}, load avg {machine['load_avg_1m_at_start']}",
        f"isa: {machine['isa']} (the C kernels' build, engine/model/kernel_isa.py)",
    ]
    foot += [f"note: {n}" for n in ctx.notes]
    if ctx.files:
        foot.append(f"wrote: {', '.join(ctx.files)}")
    out.write("\n".join(foot) + "\n")
    if args.json:
        out.write(rep.json_line(summary) + "\n")
    out.flush()
    return status
