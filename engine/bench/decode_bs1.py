"""Batch-1 decode measurements for `bench roofline`: one request alone, weight formats / decode
backends alternating round by round in one process, and where a step's time goes (engine/bench/
roofline.py reports them against the memory roof and llama.cpp)."""

from __future__ import annotations

import time


class KernelTimer:
    """Within the block, wall time spent in the engine's packed Linears (the weights) and in the
    paged decode-attention kernel, summed over calls; the rest of a step is everything else
    (norms, rotary, K/V writes, sampling, Python). Timing is a perf_counter pair per call
    (121 Linear groups + 30 attention calls a step for the default model). Each is also timed in
    this thread's CPU time (`*_cpu_s`): on a machine shared with other work, wall time includes
    the slices other processes took, CPU time only the work (exact for the engine's default of one
    thread, where the kernels run on the calling thread)."""

    def __init__(self, runner):
        self.runner = runner
        self.weights_s = self.attention_s = self.weights_cpu_s = self.attention_cpu_s = 0.0
        self.ops_s: dict = {}  # the C stack's per-op seconds (engine/model/csrc/layer.c), where it runs

    def _wrap(self, fn, slot):
        def timed(*a, **kw):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                setattr(self, slot, getattr(self, slot) + time.perf_counter() - t)
                setattr(
                    self,
                    slot.replace("_s", "_cpu_s"),
                    getattr(self, slot.replace("_s", "_cpu_s")) + time.thread_time() - c,
                )

        return timed

    def __enter__(self):
        from engine.model import cpu_kernels

        fused = getattr(self.runner, "fused", None)
        if fused is not None:  # the C stack: its own per-op timer (engine/model/fused_decode.py)
            fused.profile_start()
        pack = self.runner.linear_pack
        self._groups = {id(g): g for g, _ in pack.members.values()}.values() if pack is not None else ()
        self._saved = [(g, g.matmul) for g in self._groups]
        for g, mm in self._saved:
            g.matmul = self._wrap(mm, "weights_s")
        self._attn = cpu_kernels.paged_decode_attention
        cpu_kernels.paged_decode_attention = self._wrap(self._attn, "attention_s")
        return self

    def restart_ops(self) -> None:
        """The C stack's per-op seconds from zero again (decode_steps: after the prefill step)."""
        fused = getattr(self.runner, "fused", None)
        if fused is not None:
            fused.profile_start()

    def __exit__(self, *exc):
        from engine.model import cpu_kernels

        fused = getattr(self.runner, "fused", None)
        if fused is not None:
            from engine.model.fused_decode import LINEAR_OPS

            p = self.ops_s = fused.profile_stop()
            self.attention_s = self.attention_cpu_s = p["attention"]
            self.weights_s = self.weights_cpu_s = self.weights_s + sum(p[k] for k in LINEAR_OPS)
        for g, mm in self._saved:
            g.matmul = mm
        cpu_kernels.paged_decode_attention = self._attn


def decode_steps(llm, prompt, params, request_id: str, timer=None) -> tuple[int, float, float]:
    """(decode steps, their summed wall seconds, their summed CPU seconds in this thread) for one
    request alone, its prefill step excluded."""
    eng = llm.engine
    eng.add_request(request_id, prompt, params)
    steps, total, cpu, first = 0, 0.0, 0.0, True
    while eng.has_unfinished_requests():
        if timer is not None and first:
            saved = (timer.weights_s, timer.attention_s, timer.weights_cpu_s, timer.attention_cpu_s)
        t, c = time.perf_counter(), time.thread_time()
        eng.step()
        dt, dc = time.perf_counter() - t, time.thread_time() - c
        if first:  # the prefill step: not decode
            first = False
            if timer is not None:
                timer.weights_s, timer.attention_s, timer.weights_cpu_s, timer.attention_cpu_s = saved
                timer.restart_ops()  # the per-op split counts decode steps only, as the step time does
            continue
        steps += 1
        total += dt
        cpu += dc
    return steps, total, cpu


def decode_bs1_by_format(
    ctx,
    prompt: list[int],
    n_new: int,
    formats=("auto", "fp32"),
    rounds: int = 2,
    configs: dict | None = None,
    alongside=(),
) -> dict:
    """Batch-1 decode of one request with each weight format, in one process, the formats
    alternating round by round (on a shared machine the CPU share drifts; alternation keeps the
    ratio honest). Per format: best tok/s over the rounds, the format the engine resolved, the
    weight bytes it reads per step, and the step split (ms per decode step in the Linears, the
    attention kernel and the rest) from one extra timed run. `configs`: label -> EngineConfig
    fields for labels that are not a weight_format name (another model, e.g. bench weights'
    Q8_0 copy of the default model). `alongside`: callables run once a round after the formats'
    runs (a peer's timed pass, engine/bench/peers.LlamaCppBs1.one), so its rounds alternate with
    these in the same minutes."""
    from engine.bench import common as C

    _, SamplingParams, _ = C.require_engine()

    def cfg(f):  # "transformers": the default weights through the HF layer code
        if configs and f in configs:
            return dict(configs[f])
        if f == "transformers":
            return {"weight_format": "auto", "decode_backend": "transformers"}
        return {"weight_format": f}

    llms = {
        f: C.make_llm(ctx, max_num_seqs=4, num_kv_blocks=C.blocks_for([len(prompt)], n_new) + 8, **cfg(f))
        for f in formats
    }
    out = {f: {"rates": []} for f in formats}
    try:
        for f, llm in llms.items():
            C.warm_up(llm, SamplingParams, prompt)
            info = llm.engine.info()
            out[f]["format"] = info.weight_format
            out[f]["weight_bytes"] = info.weight_bytes_per_step
            out[f]["decode_backend"] = getattr(info, "decode_backend", "transformers")
        params = C.greedy(SamplingParams, n_new)
        for i in range(rounds):
            for f, llm in llms.items():
                steps, secs, _ = decode_steps(llm, prompt, params, f"bs1-{f}-{i}")
                if steps and secs > 0:
                    out[f]["rates"].append(steps / secs)
            for peer_round in alongside:
                peer_round()
        for f, llm in llms.items():
            with KernelTimer(llm.engine.runner) as kt:
                steps, secs, cpu = decode_steps(llm, prompt, params, f"bs1-split-{f}", timer=kt)
            if steps:
                for key, total, w, a in (
                    ("split_ms", secs, kt.weights_s, kt.attention_s),
                    ("split_cpu_ms", cpu, kt.weights_cpu_s, kt.attention_cpu_s),
                ):
                    step, w, a = total / steps * 1e3, w / steps * 1e3, a / steps * 1e3
                    out[f][key] = {"step": step, "weights": w, "attention": a, "rest": step - w - a}
                out[f]["ops_ms"] = {k: v / steps * 1e3 for k, v in kt.ops_s.items()}
    finally:
        for llm in llms.values():
            C.free_llm(llm)
    for f in formats:
        out[f]["tok_s"] = max(out[f]["rates"]) if out[f]["rates"] else None
    return out
