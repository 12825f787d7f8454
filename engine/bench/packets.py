"""`python -m engine bench packets`: seed 002's packet-size side channel, measured on the wire
(engine/lab/packet_channel.py): the engine served over TLS on 127.0.0.1, an observer that records
only TLS record lengths, the attack's accuracy without a defence and under each defence, and what
each defence costs in bytes and time. The Claims page's `packets` row reads these fields."""

from __future__ import annotations

from engine.bench import common as C
from engine.bench.report import bar_figure


def suite_packets(ctx) -> C.SuiteResult:
    from engine.config import EngineConfig
    from engine.core.thread import EngineThread
    from engine.lab import packet_channel as P

    C.require_engine()
    res = C.SuiteResult()
    trials = ctx.pick(24, 12, smoke=2)
    new_tokens = ctx.pick(32, 24, smoke=6)
    candidates = ctx.pick(8, 8, smoke=3)
    args = {"model": ctx.model, "max_num_seqs": 4, "max_model_len": 1024, **ctx.engine_args}
    if ctx.threads is not None:
        args["num_threads"] = ctx.threads
    ctx.start("engine")
    th = EngineThread(config=EngineConfig(**args))
    ctx.done("engine")
    try:
        ctx.start("streams through the observer")
        out = P.measure(th, trials=trials, candidates=candidates, new_tokens=new_tokens, temperature=0.0, seed=0)
        ctx.done("streams")
    finally:
        th.shutdown()
    sums = out.summaries()
    res.add("packets_trials", trials, "rounds; each streams the victim's answer once per defence, order turning")
    res.add("packets_candidates", candidates, "possible questions (chance = 1 / this)")
    res.add("packets_new_tokens", new_tokens, "tokens per answer (greedy, ignore_eos)")
    res.add("packets_cipher", out.cipher, "the TLS 1.3 suite negotiated on 127.0.0.1")
    res.add("packets_overhead_bytes", out.k, "a content record = its token text + this (calibrated by the attacker)")
    res.add(
        "packets_answers_reproduced",
        sum(t.answer_matches for t in out.trials) / len(out.trials),
        "streams whose text equals the attacker's copy of that answer",
    )
    base = next((s for s in sums if s.defence == "none"), None)
    for s in sums:
        d = s.defence
        res.add(f"packets_{d}_accuracy", s.accuracy, f"{s.label}: answer picked right (chance {s.chance:.3f})")
        res.add(f"packets_{d}_length_accuracy", s.length_accuracy, f"token lengths read (chance {s.length_chance:.3f})")
        res.add(f"packets_{d}_length_chance", s.length_chance, "", row=False)
        res.add(f"packets_{d}_bits_per_token", s.bits_per_token, "log2(vocab / tokens of the read length), per token")
        res.add(f"packets_{d}_bytes_per_answer", s.bytes_per_answer, "response bytes on the wire, TLS headers included")
        res.add(f"packets_{d}_first_s", s.first_s, "median: request sent -> first content record")
        res.add(f"packets_{d}_total_s", s.total_s, "median: request sent -> last record")
        if base is not None and d != "none":
            ratio = s.bytes_per_answer / base.bytes_per_answer if base.bytes_per_answer else None
            res.add(f"packets_{d}_bytes_ratio", ratio, "bytes per answer vs no defence")
    res.add("packets_chance", 1 / candidates, "", row=False)
    res.figures.append(
        (
            "packets_accuracy",
            bar_figure(
                f"Answer picked from TLS record lengths ({candidates} candidates, chance {100 / candidates:.0f}%)",
                [s.label for s in sums],
                [100 * s.accuracy for s in sums],
                "% right",
            ),
        )
    )
    return res
