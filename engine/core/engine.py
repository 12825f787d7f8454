"""LLMEngine: add_request / step / abort_request / evict / snapshot (LLM, the batch entry point: engine/core/llm.py).

One step (vLLM v1's shape) = schedule (drafts, then the Scheduler's batch) -> execute (copy-on-write,
one flattened forward pass) -> update from output (sample or verify, stop checks, events and
metrics; engine/core/output_processor.py). Every memory decision becomes an Event with a reason.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass

import torch

from engine.config import EngineConfig, SamplingParams
from engine.core import detokenizer, inputs, output_processor, pool_sizing
from engine.core.block_manager import BlockManager
from engine.core.inputs import chat_ids, check_unicode, prompt_ids
from engine.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.core.pool_sizing import DEFAULT_KV_BYTES as DEFAULT_KV_BYTES  # re-exported (tests read them here)
from engine.core.pool_sizing import MAX_BLOCKS as MAX_BLOCKS
from engine.core.sampler import make_generator
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.sequence import Request, Status, WaitReason
from engine.core.structured import Grammars
from engine.model import kv_quant
from engine.model.device import available_bytes, cuda_memory
from engine.model.families import check_supported
from engine.model.kv_layout import dtype_bytes, kv_bytes_per_token, kv_geometry, kv_scale_bytes, kv_scale_group
from engine.model.models import load_model, resolve_device, resolve_dtype
from engine.model.runner import BatchRow, ModelRunner
from engine.observe import trace_events as ev
from engine.observe.metrics import MetricsTracker
from engine.observe.snapshot import EngineInfo, RequestInfo, Snapshot
from engine.observe.trace_events import EventRing
from engine.speculative.decoder import SpecDecoder
from engine.speculative.drafters import DRAFT_SUFFIX

log = logging.getLogger(__name__)

__all__ = ["LLMEngine", "CompletionOutput", "RequestMetrics", "RequestOutput"]


def _schedule_rows(items, rows) -> list[list]:
    """What one forward pass held, per request: [request_id, kind, num_tokens, start], kind the
    row's phase (ScheduledItem.phase)."""
    return [[row.request_id, it.phase, len(row.tokens), row.start] for it, row in zip(items, rows)]


@dataclass(slots=True)
class ModelOutput:
    """What execute() hands to update_from_output(): the rows fed, their logits and the forward
    pass's seconds, or the error that failed the pass."""

    rows: list[BatchRow]
    logits: torch.Tensor | None = None
    forward_s: float = 0.0
    error: str | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        if config is None:
            config = EngineConfig(**kwargs)
        elif kwargs:
            config = config.replace(**kwargs)
        self.config = config
        self.device = resolve_device(config.device)
        self.cpu_threads = (config.num_threads or 1) if self.device.type == "cpu" else None
        self._own_threads()
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model, self.tokenizer = load_model(config.model, config.device, config.dtype)
        self.incremental_detok = detokenizer.concatenative(self.tokenizer)  # engine/core/detokenizer.py
        # a concatenative tokenizer's decode is its backend's, less transformers' ~1.5 us a call
        self._decode = self.tokenizer.backend_tokenizer.decode if self.incremental_detok else None
        self._token_text: dict[int, str] = {}  # token id -> decode([id]), filled as tokens appear
        hf = self.model.config
        self.vocab_size = hf.vocab_size
        self.grammars = Grammars(self.tokenizer, self.vocab_size)  # structured output (built on first use)
        model_limit = getattr(hf, "max_position_embeddings", None) or pool_sizing.FALLBACK_MAX_MODEL_LEN
        if config.max_model_len is not None and config.max_model_len > model_limit:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings={model_limit}"
            )
        check_supported(hf, config.max_model_len or model_limit)
        self.kv_cache_dtype = kv_quant.resolve(config.kv_cache_dtype, self.dtype)
        n_layers, n_kv, head_dim = kv_geometry(hf)
        kv_quant.check_head_dim(self.kv_cache_dtype, head_dim)
        self.bytes_per_token = kv_bytes_per_token(
            n_layers,
            n_kv,
            head_dim,
            dtype_bytes(self.kv_cache_dtype),
            scale_bytes=kv_scale_bytes(self.kv_cache_dtype),
            scale_group=kv_scale_group(self.kv_cache_dtype),
        )
        self.bytes_per_block = self.bytes_per_token * config.block_size
        avail = available_bytes(self.device)
        num_blocks, field_name = pool_sizing.pool_blocks(
            config,
            self.bytes_per_block,
            self.device.type,
            lambda: self._gpu_pool_blocks(hf),
            want_tokens=config.max_model_len or model_limit,
            avail=avail,
        )
        # max_model_len unset: the model's limit, memory permitting (pool_sizing.resolve_max_model_len)
        max_model_len, self.max_model_len_note = pool_sizing.resolve_max_model_len(
            config, model_limit, num_blocks, field_name, self.bytes_per_block
        )
        if self.max_model_len_note:
            log.warning("kvscope: %s", self.max_model_len_note)
        config = self.config = config.replace(max_model_len=max_model_len)
        # sized from free device memory already under gpu_memory_utilization
        if field_name.startswith("gpu_memory_utilization"):
            avail = None
        pool_sizing.check_pool(config, num_blocks, field_name, self.bytes_per_block, self.device.type, avail)
        slab_tokens = config.max_model_len
        num_swap = pool_sizing.swap_blocks(config, self.bytes_per_block)
        if num_swap:
            cpu_avail = available_bytes(torch.device("cpu"))
            if cpu_avail is not None and self.device.type == "cpu":
                cpu_avail = max(0, cpu_avail - num_blocks * self.bytes_per_block)
            pool_sizing.check_swap(config, num_swap, self.bytes_per_block, cpu_avail)
        self.num_blocks = num_blocks
        self.bm = BlockManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching and config.kv_cache,
            allocator=config.allocator,
            slab_tokens=slab_tokens,
            num_swap_blocks=num_swap,
            hash_algo=config.prefix_caching_hash_algo,
        )
        self.runner = ModelRunner(
            self.model,
            num_blocks=num_blocks,
            block_size=config.block_size,
            dtype=self.dtype,
            device=self.device,
            num_swap_blocks=num_swap,
            linear_backend=config.linear_backend,
            attention_backend=config.attention_backend,
            kv_cache_dtype=self.kv_cache_dtype,
            weight_format=config.weight_format,
            decode_backend=config.decode_backend,
        )
        self.events = EventRing(config.event_ring_size)
        self.engine_id = uuid.uuid4().hex[:12]
        self.t0 = time.perf_counter()
        self.step_num = 0
        self.scheduler = Scheduler(
            config,
            self.bm,
            self.emit,
            self.runner.swap_out,
            self.runner.swap_in,
            clock=self.now,
            bytes_per_token=self.bytes_per_token,
        )
        self.requests: dict[str, Request] = {}
        self.finished: deque[Request] = deque(maxlen=64)
        self._kv_lock = threading.Lock()  # the block manager's KV events, stamped with their step
        self._kv_stamped: list[tuple] = []
        self.metrics = MetricsTracker()
        self._ids = itertools.count()
        self.eos_ids = self._eos_ids()
        self.spec = None
        if config.speculative is not None:
            self.spec = SpecDecoder(
                config.speculative,
                engine_config=config,
                bm=self.bm,
                runner=self.runner,
                scheduler=self.scheduler,
                emit=self.emit,
                model=self.model,
                tokenizer=self.tokenizer,
                device=self.device,
                dtype=self.dtype,
                is_live=self.requests.__contains__,
            )
        self.fault_injector = None  # tests: callable(step_items) that may raise
        self.emit(
            ev.CONFIG,
            None,
            model=config.model,
            num_blocks=num_blocks,
            block_size=config.block_size,
            bytes_per_token=self.bytes_per_token,
            reason="engine started",
        )

    # ------------------------------------------------------------------ helpers
    def _gpu_pool_blocks(self, hf) -> tuple[int, str]:
        """(blocks, the field that sized them) for a CUDA pool sized by gpu_memory_utilization."""
        budget = self._gpu_budget(hf, self.dtype.itemsize)
        return pool_sizing.gpu_pool_blocks(budget, self.bytes_per_block, self.config.gpu_memory_utilization)

    def _gpu_budget(self, hf, itemsize: int) -> int:
        """KV bytes on CUDA from free device memory (engine/model/device.py), read after the weights loaded."""
        mem = cuda_memory(self.device)
        hidden = getattr(hf, "hidden_size", 0)
        return pool_sizing.gpu_budget(
            mem, self.config, itemsize, hidden, getattr(hf, "intermediate_size", None), hf.vocab_size
        )

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def emit(self, kind: str, request_id: str | None = None, **data):
        return self.events.emit(self.step_num, self.now(), kind, request_id, **data)

    def _eos_ids(self) -> set[int]:
        ids = set()
        for src in (
            getattr(self.tokenizer, "eos_token_id", None),
            getattr(getattr(self.model, "generation_config", None), "eos_token_id", None),
        ):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(x) for x in src)
        return ids

    def apply_chat_template(self, text: str) -> list[int]:
        check_unicode(text)
        return chat_ids(self.tokenizer, [{"role": "user", "content": text}])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._decode is not None:
            return self._decode(ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, tok: int) -> str:
        """The tokenizer's text of one token on its own (special tokens kept), as each token's mark
        shows it; decoded once per id."""
        text = self._token_text.get(tok)
        if text is None:
            text = self._token_text[tok] = self.tokenizer.decode([tok])
        return text

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str | None,
        prompt,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        *,
        origin: str = "engine",
        prompt_text: str | None = None,
    ) -> str:
        """Validates everything before allocating anything; raises ValueError naming the field
        and the limit (a rejection event is recorded too). `origin`: who submitted it ("engine",
        "app", "http"); `prompt_text`: the text shown for a prompt of ids (a chat message)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        inputs.check_request_fields(request_id, self.requests, DRAFT_SUFFIX, origin, prompt_text)
        try:
            ids, text = prompt_ids(self.tokenizer, self.vocab_size, prompt)
            tier = self.admission_check(ids, params)
        except ValueError as e:
            self.emit(ev.REJECT, request_id, reason=str(e))
            self.metrics.num_rejected += 1
            raise
        req = Request(
            request_id,
            ids,
            params,
            self.now() if arrival_time is None else arrival_time,
            prompt_text=text if prompt_text is None else prompt_text,
            tier=tier.name if tier else None,
            priority=tier.priority if tier else 0,
            request_class=params.request_class or (tier.name if tier else "default"),
            history=deque(maxlen=self.config.history_len),  # EngineConfig.history_len bounds the UI history
            generator=make_generator(params, self.device),
            origin=origin,
        )
        if params.response_format is not None:
            try:
                req.matcher = self.grammars.matcher(params.response_format)
            except ValueError as e:
                self.emit(ev.REJECT, request_id, reason=str(e))
                self.metrics.num_rejected += 1
                raise
        req.wait_reason, req.wait_reason_text = WaitReason.QUEUED, "queued"
        self.requests[request_id] = req
        self.scheduler.add(req)
        req.add_history(self.step_num, self.now(), 0, self.bytes_per_token, "waiting")
        return request_id

    def admission_check(self, ids: list[int], params: SamplingParams):
        """inputs.admission_check on this engine's config, vocabulary and live pool (reads only:
        add_request and the as-you-type preview use it). Returns the request's TierConfig or None."""
        return inputs.admission_check(
            self.config, self.vocab_size, self.bm.num_blocks, self.scheduler.blocks_for_whole_request, ids, params
        )

    def max_completion_tokens(self, prompt_len: int, tier: str | None = None) -> int:
        """inputs.completion_room on this engine's live pool: the default max_tokens (serve)."""
        return inputs.completion_room(self.config, self.bm.num_blocks, prompt_len, tier)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        s = self.scheduler
        return len(s.waiting) + len(s.running) + len(s.swapped)

    def finish_request(self, req: Request, status: Status, reason: str, error: str | None = None) -> None:
        freed = self.scheduler.remove(req)
        req.status = status
        req.finish_reason = reason
        req.error = error
        req.finish_time = self.now()
        if self.spec is not None:
            self.spec.release(req)  # its draft model's K/V blocks ("<rid>#draft")
        req.add_history(self.step_num, req.finish_time, 0, self.bytes_per_token, "finished")
        if freed:
            self.emit(ev.BLOCK_FREE, req.request_id, blocks=list(freed), reason=reason)
        kind = {Status.FINISHED: ev.FINISH, Status.ABORTED: ev.ABORT}.get(status, ev.FINISH)
        if error:
            kind = ev.ERROR
        self.emit(
            kind, req.request_id, finish_reason=reason, output_tokens=req.num_output_tokens, reason=error or reason
        )
        self.requests.pop(req.request_id, None)
        self.finished.append(req)
        self.metrics.on_finish(req)

    def abort_request(self, request_id) -> bool:
        """Abort a request. Unknown or already-finished ids are harmless (returns False)."""
        ids = request_id if isinstance(request_id, (list, tuple)) else [request_id]
        done = False
        for rid in ids:
            req = self.requests.get(rid) if isinstance(rid, str) else None
            if req is None or req.is_finished:
                continue
            self.finish_request(req, Status.ABORTED, "abort")
            done = True
        return done

    def evict(self, request_id: str) -> dict:
        """Drop a running request's KV cache (the "Evict the KV cache" button): its blocks are
        freed (not kept in the prefix cache), and it recomputes prompt + generated tokens."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            raise ValueError(f"request {request_id!r} is not running (unknown or finished)")
        if req.status != Status.RUNNING:
            raise ValueError(f"request {request_id!r} is {req.status.value}, not running: nothing to evict")
        table = list(self.bm.table(request_id))
        tokens = req.num_computed_tokens
        self.bm.drop_hashes(request_id)  # so the recompute really recomputes
        self.scheduler.preempt(req, "manual eviction", mode="recompute")
        self.metrics.num_evictions += 1
        self.emit(
            ev.EVICT,
            request_id,
            blocks_freed=len(table),
            tokens_to_recompute=req.num_tokens,
            cached_tokens_dropped=tokens,
            reason="manual eviction (Evict KV cache)",
        )
        return {"blocks_freed": len(table), "tokens_to_recompute": req.num_tokens}

    def set_num_blocks(self, n: int) -> None:
        """Change the KV budget live (within the allocated pool)."""
        old = self.bm.num_blocks
        self.bm.set_num_blocks(n)
        self.emit(ev.CONFIG, None, num_blocks=n, previous=old, reason=f"KV budget changed from {old} to {n} blocks")

    def _own_threads(self) -> None:
        """torch's thread count set to this engine's (CPU): the count is one per process (and per
        OpenMP thread), so another engine built since, or a bench pass, may have changed it."""
        if self.cpu_threads and torch.get_num_threads() != self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        with self._kv_lock:  # KV events from before this step keep the step number they happened in
            self._stamp_kv_events()
            self.step_num += 1
        t_step = time.perf_counter()
        sched = self._schedule()
        if not sched.items:
            self.bm.apply_target()
            self.end_step(t_step)
            return []
        self._own_threads()
        out = self._execute(sched)
        return output_processor.update_from_output(self, sched, out, t_step)

    def _schedule(self) -> SchedulerOutput:
        """Drafts for the requests in decode (speculative decoding), then the Scheduler's batch."""
        if self.spec is not None:
            decoding = [r for r in self.scheduler.running if r.in_decode]
            try:
                self.scheduler.set_drafts(decoding, self.spec.propose(decoding))
            except Exception as e:  # a failed draft costs speed, never the requests
                self.scheduler.set_drafts(decoding, {})
                self.emit(
                    ev.ERROR,
                    None,
                    reason=f"drafting failed, decoding plainly this step: {type(e).__name__}: {str(e)[:200]}",
                )
        return self.scheduler.schedule(self.step_num)

    def _execute(self, sched: SchedulerOutput) -> ModelOutput:
        """Copy-on-write where needed, then one flattened forward pass over the scheduled rows."""
        rows: list[BatchRow] = []
        for it in sched.items:
            req = it.req
            start = req.num_computed_tokens
            copies = self.bm.ensure_writable(req.request_id, start, start + it.num_new_tokens)
            if copies:
                self.runner.copy_blocks(copies)
            all_ids = req.all_token_ids
            toks = (
                all_ids[start : start + it.num_new_tokens - it.num_spec_tokens]
                + req.spec_token_ids[: it.num_spec_tokens]
            )
            completes = start + it.num_new_tokens - it.num_spec_tokens >= req.num_tokens
            logits_from = (len(toks) - 1 - it.num_spec_tokens) if completes else -1
            rows.append(BatchRow(req.request_id, start, toks, self.bm.table(req.request_id), logits_from))
            if req.first_scheduled_time is None:
                req.first_scheduled_time = self.now()
        self._flush_bm_events()
        try:
            if self.fault_injector is not None:
                self.fault_injector(sched.items)
            t_fwd = time.perf_counter()
            logits = self.runner.forward(rows)
            fwd_s = time.perf_counter() - t_fwd
            self.emit(ev.SCHEDULE, None, rows=_schedule_rows(sched.items, rows), forward_s=fwd_s)
            return ModelOutput(rows, logits, fwd_s)
        except Exception as e:  # fail only the requests in this step
            return ModelOutput(rows, error=f"step {self.step_num} failed: {type(e).__name__}: {str(e)[:300]}")

    def end_step(self, t_step: float) -> None:
        self._flush_bm_events()
        self.last_step_s = time.perf_counter() - t_step

    def _flush_bm_events(self) -> None:
        for kind, rid, data in self.bm.drain_events():
            self.emit(kind, rid, **data)

    # ------------------------------------------------------------------ KV events
    def enable_kv_events(self) -> list[tuple]:
        """Start queueing vLLM's KV events (engine/observe/kv_events.py publishes them); returns
        every block cached now as a "stored" event. Each event: (step, kind, hash, parent hash,
        token ids, extra keys)."""
        with self._kv_lock:
            self._kv_stamped = []
            return [(self.step_num, *e) for e in self.bm.enable_kv_events()]

    def disable_kv_events(self) -> None:
        with self._kv_lock:
            self.bm.disable_kv_events()
            self._kv_stamped = []

    def take_kv_events(self) -> list[tuple]:
        """The KV events since the last call (any thread may call it, during a step too)."""
        with self._kv_lock:
            self._stamp_kv_events()
            out, self._kv_stamped = self._kv_stamped, []
        return out

    def _stamp_kv_events(self) -> None:  # with _kv_lock held
        self._kv_stamped.extend((self.step_num, *e) for e in self.bm.take_kv_events())

    # ------------------------------------------------------------------ outputs
    def request_output(self, req: Request) -> RequestOutput:
        return output_processor.request_output(self, req)

    def get_request(self, request_id: str) -> Request | None:
        r = self.requests.get(request_id)
        if r is None:
            for f in self.finished:
                if f.request_id == request_id:
                    return f
        return r

    # ------------------------------------------------------------------ snapshot
    def info(self) -> EngineInfo:
        c = self.config
        spec = None
        if c.speculative is not None:
            spec = f"{c.speculative.method} k={c.speculative.num_speculative_tokens}"
        return EngineInfo(
            model=c.model,
            device=str(self.device),
            dtype=str(self.dtype).replace("torch.", ""),
            num_layers=self.runner.num_layers,
            num_kv_heads=self.runner.num_kv_heads,
            head_dim=self.runner.head_dim,
            block_size=c.block_size,
            num_blocks=self.bm.num_blocks,
            bytes_per_token=self.bytes_per_token,
            bytes_per_block=self.bytes_per_block,
            kv_cache_bytes=self.bm.num_blocks * self.bytes_per_block,
            max_model_len=c.max_model_len,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            allocator=c.allocator,
            kv_cache=c.kv_cache,
            enable_prefix_caching=self.bm.enable_prefix_caching,
            preemption_mode=c.preemption_mode,
            victim_policy=c.victim_policy,
            speculative=spec,
            kv_capacity_blocks=self.bm.capacity,
            linear_backend=self.runner.linear_pack.kernel if self.runner.linear_pack is not None else "torch",
            attention_backend=self.runner.attention_backend,
            kv_cache_dtype=self.kv_cache_dtype,
            weight_format=self.runner.weight_format,
            weight_bytes_per_step=self.runner.weight_bytes_per_step,
            decode_backend=self.runner.decode_backend,
        )

    def check_invariants(self) -> None:
        self.bm.check_invariants()
        s = self.scheduler
        live = list(s.waiting)
        for req in s.running:
            n = self.bm.num_tokens(req.request_id)
            assert n == req.num_computed_tokens, (
                f"{req.request_id}: block manager holds {n} tokens, request says {req.num_computed_tokens}"
            )
        for req in live:
            if req.status != Status.RUNNING:
                assert not self.bm.has_table(req.request_id) or req.num_computed_tokens > 0, (
                    f"waiting {req.request_id} holds blocks"
                )
        for req in s.swapped:
            assert self.bm.is_swapped(req.request_id) and not self.bm.has_table(req.request_id)
        ids = [r.request_id for r in itertools.chain(s.waiting, s.running, s.swapped)]
        assert len(ids) == len(set(ids)), "a request is in two queues"
        for rid in self.bm.request_ids():
            if rid.endswith(DRAFT_SUFFIX) and rid[: -len(DRAFT_SUFFIX)] in self.requests:
                continue  # a live request's draft-model K/V (engine/speculative.py)
            assert rid in self.requests, f"blocks held by unknown request {rid}"

    def snapshot(self, max_finished: int = 16) -> Snapshot:
        s = self.scheduler
        reqs = [self._request_info(r) for r in itertools.chain(s.running, s.waiting, s.swapped)]
        reqs += [self._request_info(r) for r in list(self.finished)[-max_finished:]]
        metrics = self.metrics.snapshot(self.bm, s, self.spec.metrics() if self.spec is not None else None)
        return Snapshot(
            step=self.step_num,
            time=self.now(),
            info=self.info(),
            blocks=tuple(self.bm.block_infos()),
            requests=tuple(reqs),
            metrics=metrics,
            waiting_ids=tuple(r.request_id for r in s.waiting),
            running_ids=tuple(r.request_id for r in s.running),
            swapped_ids=tuple(r.request_id for r in s.swapped),
            engine_id=self.engine_id,
        )

    def _request_info(self, r: Request) -> RequestInfo:
        table = tuple(self.bm.table(r.request_id))
        n = self.bm.num_tokens(r.request_id) if table else 0
        return RequestInfo(
            request_id=r.request_id,
            state=r.status,
            tier=r.tier,
            prompt_len=r.num_prompt_tokens,
            output_len=r.num_output_tokens,
            num_computed_tokens=n,
            num_cached_tokens=r.num_cached_tokens,
            block_table=table,
            slots_allocated=len(table) * self.bm.block_size,
            kv_bytes=n * self.bytes_per_token,
            priority=r.priority,
            arrival_time=r.arrival_time,
            first_token_time=r.first_token_time,
            finish_time=r.finish_time,
            finish_reason=r.finish_reason,
            last_token_time=r.token_times[-1] if r.token_times else None,
            waiting_reason=r.wait_reason_text,
            error=r.error,
            num_preemptions=r.num_preemptions,
            prompt_preview=(r.prompt_text or self.decode(r.prompt_token_ids[:64]))[:200],
            output_text=r.output_text[-4000:],
            tokens=tuple(r.token_marks),
            history=tuple(r.history),
            spec_num_drafts=r.spec_num_drafts,
            spec_num_draft_tokens=r.spec_num_draft_tokens,
            spec_num_accepted_tokens=r.spec_num_accepted_tokens,
            origin=r.origin,
        )
