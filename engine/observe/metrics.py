"""Serving metrics with vLLM's definitions.

TTFT, TPOT, ITL, e2e and the prefix hit rate come from engine/observe/rates.py (their one home,
vLLM's definitions); kv_cache_usage_perc = blocks owned by
requests / usable blocks (cached-free blocks count as free); prefix-cache queries/hits count tokens."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.observe import rates
from engine.observe.rates import prefix_hit_rate
from engine.observe.snapshot import EngineMetrics, RequestState, SpecMetrics

WINDOW = 1000


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    ttft: float | None
    tpot: float | None
    e2e_latency: float | None
    itl: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0


class MetricsTracker:
    def __init__(self):
        self.ttft = deque(maxlen=WINDOW)
        self.tpot = deque(maxlen=WINDOW)
        self.e2e = deque(maxlen=WINDOW)
        self.num_finished = 0
        self.num_aborted = 0
        self.num_rejected = 0
        self.num_errors = 0
        self.num_evictions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.busy_s = 0.0
        self.last_step_s = 0.0
        self._listeners: list = []  # callables(req) told of every finished/aborted request (the /metrics exporter)

    def subscribe(self, fn) -> None:
        """fn(req) is called on the engine's thread for every finished or aborted request; an
        exception in fn is swallowed (an observer never takes the engine down)."""
        self._listeners.append(fn)

    def subscribers(self) -> tuple:
        return tuple(self._listeners)

    def unsubscribe(self, fn) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    def on_first_token(self, req) -> None:
        self.ttft.append(rates.ttft(req.arrival_time, req.first_token_time))
        self.prompt_tokens += req.num_prompt_tokens

    def on_step(self, new_tokens: int, dt: float) -> None:
        self.generation_tokens += new_tokens
        self.busy_s += dt
        self.last_step_s = dt

    def on_finish(self, req) -> None:
        if req.status == RequestState.FINISHED:
            self.num_finished += 1
        elif req.status == RequestState.ABORTED:
            self.num_aborted += 1
        m = self.request_metrics(req)
        if m.e2e_latency is not None:
            self.e2e.append(m.e2e_latency)
        if m.tpot is not None:
            self.tpot.append(m.tpot)
        for fn in list(self._listeners):
            try:
                fn(req)
            except Exception:  # an observer never takes the engine down
                pass

    @staticmethod
    def request_metrics(req):
        return RequestMetrics(
            req.arrival_time,
            req.first_scheduled_time,
            req.first_token_time,
            req.finish_time,
            rates.ttft(req.arrival_time, req.first_token_time),
            rates.tpot(req.first_token_time, req.token_times, req.num_output_tokens),
            rates.e2e_latency(req.arrival_time, req.finish_time),
            list(req.itl),
            req.num_cached_tokens,
            req.num_preemptions,
            req.spec_num_drafts,
            req.spec_num_draft_tokens,
            req.spec_num_accepted_tokens,
        )

    def snapshot(self, bm, s, spec: SpecMetrics | None) -> EngineMetrics:
        """bm: the BlockManager; s: the Scheduler; spec: the speculative decoder's metrics."""
        slots_alloc, slots_filled = bm.slot_usage()
        n_cached = bm.num_cached_free_blocks
        preempted_waiting = sum(1 for r in s.waiting if r.status == RequestState.PREEMPTED)
        spec = spec if spec is not None else SpecMetrics()
        q, h = bm.prefix_queries, bm.prefix_hits
        return EngineMetrics(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_swapped=len(s.swapped),
            num_preempted=preempted_waiting,
            num_finished=self.num_finished,
            num_rejected=self.num_rejected,
            num_aborted=self.num_aborted,
            num_preemptions_total=s.num_preemptions,
            num_swaps_total=s.num_swaps,
            num_evictions_total=self.num_evictions,
            kv_cache_usage_perc=bm.usage(),
            num_blocks_used=bm.num_used_blocks,
            num_blocks_cached=n_cached,
            num_blocks_free=bm.num_free_blocks - n_cached,
            slots_allocated=slots_alloc,
            slots_filled=slots_filled,
            waste_fraction=(1 - slots_filled / slots_alloc) if slots_alloc else 0.0,
            prefix_cache_queries=q,
            prefix_cache_hits=h,
            prefix_cache_hit_rate=prefix_hit_rate(h, q),
            swap_blocks_used=bm.num_swap_used,
            swap_blocks_total=bm.num_swap_blocks,
            prompt_tokens_total=self.prompt_tokens,
            generation_tokens_total=self.generation_tokens,
            throughput_tok_s=(self.generation_tokens / self.busy_s) if self.busy_s else 0.0,
            ttft_s=tuple(self.ttft),
            tpot_s=tuple(self.tpot),
            e2e_latency_s=tuple(self.e2e),
            step_time_s=self.last_step_s,
            spec=spec,
        )
