"""Record the Replay page's demo traces (assets/traces/*.jsonl) with the real engine.

    .venv/bin/python scripts/record_demo_traces.py [--model default]

Each trace is a run stepped synchronously (so the steps and events are reproducible; the
times in it are the wall times of this machine): requests are added when the run's virtual
clock (STEP_S per step) passes their arrival time. Snapshots are slimmed like the live pages'
(no per-request token lists or histories) but keep the block pool every KEYFRAME_EVERY steps, so the
replay can draw the pool map near any tick. Events: every kind except per-token decode/prefill chunks
(the per-step SCHEDULE events keep who was in each forward pass). The Demo page tells its chapters
from release-freeze.jsonl and speculation.jsonl.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.lab.workloads import make_workload  # noqa: E402
from engine.observe.recording import RECORDED_EXCLUDE, append_snapshot, slim_snapshot  # noqa: E402
from engine.observe.trace_events import trace_to_string  # noqa: E402
from ui.figures.demo import RECORDINGS, speculation_requests  # noqa: E402

STEP_S = 0.05
MAX_SNAPSHOTS = 120
KEYFRAME_EVERY = 3  # steps between snapshots that keep the whole block pool

DEMOS = {
    RECORDINGS["release-freeze"]["file"]: RECORDINGS["release-freeze"],
    # one system prompt, many questions: shared blocks with ref counts, prefix hits
    "shared-system-prompt.jsonl": dict(
        scenario="shared-system-prompt",
        n=8,
        params=dict(
            system_words=120, prompt_median=12, output_median=24, output_min=8, output_max=32, arrival_rate=20.0
        ),
        config=dict(block_size=16, num_kv_blocks=64, max_num_seqs=8, max_model_len=1024, enable_prefix_caching=True),
    ),
    RECORDINGS["speculation"]["file"]: RECORDINGS["speculation"],
}


def record_sequential(model: str, spec: dict) -> str:
    from engine.config import SpeculativeConfig

    conf = dict(spec["config"])
    conf["speculative"] = SpeculativeConfig(**conf["speculative"])
    eng = LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", seed=0, num_threads=1, **conf))
    series = [slim_snapshot(eng.snapshot(), keep_blocks=True)]
    for r in speculation_requests(eng.tokenizer, spec):
        eng.add_request(r.request_id, r.prompt, SamplingParams(**r.sampling_kwargs()))
        while eng.has_unfinished_requests():
            eng.step()
            keep = eng.step_num % KEYFRAME_EVERY == 0 or not eng.has_unfinished_requests()
            series = append_snapshot(series, slim_snapshot(eng.snapshot(), keep_blocks=keep), MAX_SNAPSHOTS)
    events = [e for e in eng.events if e.kind not in RECORDED_EXCLUDE]
    return trace_to_string(series, events)


def record(model: str, spec: dict) -> str:
    if spec.get("sequential"):
        return record_sequential(model, spec)
    cfg = EngineConfig(model=model, device="cpu", dtype="float32", seed=0, num_threads=1, **spec["config"])
    eng = LLMEngine(cfg)
    reqs = make_workload(spec["scenario"], spec["n"], 0, **spec["params"])
    pending = sorted(reqs, key=lambda r: r.arrival_s)
    series = [slim_snapshot(eng.snapshot(), keep_blocks=True)]
    step = 0
    while pending or eng.has_unfinished_requests():
        clock = step * STEP_S
        while pending and pending[0].arrival_s <= clock:
            r = pending.pop(0)
            try:
                eng.add_request(r.request_id, r.prompt, SamplingParams(**r.sampling_kwargs()))
            except ValueError as e:  # recorded as a reject event by the engine
                print(f"  {r.request_id} rejected: {e}", file=sys.stderr)
        if eng.has_unfinished_requests():
            eng.step()
            keep = eng.step_num % KEYFRAME_EVERY == 0 or not eng.has_unfinished_requests()
            series = append_snapshot(series, slim_snapshot(eng.snapshot(), keep_blocks=keep), MAX_SNAPSHOTS)
        step += 1
        if step > 100_000:
            raise RuntimeError("run did not finish")
    events = [e for e in eng.events if e.kind not in RECORDED_EXCLUDE]
    return trace_to_string(series, events)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", default=str(ROOT / "assets" / "traces"))
    ap.add_argument("--only", nargs="*", help="trace file names to record (default: all)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, spec in DEMOS.items():
        if a.only and name not in a.only:
            continue
        text = record(a.model, spec)
        (out / name).write_text(text)
        print(f"{name}: {len(text.splitlines())} lines, {len(text) / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
