"""SpecDecoder: speculative decoding's hooks, called by LLMEngine.step:

  propose(reqs)                 -> {request id: draft token ids} for requests in decode (the
                                   scheduler records them: Scheduler.set_drafts)
  record_forward(items, secs)   -> after the target pass: costs, pass counts
  verify(req, drafts, logits)   -> (emitted tokens, marks); logits fp32 [len(drafts)+1, V]
  release(req)                  -> a request finished: drop its draft state and draft KV
  metrics()                     -> SpecMetrics (vLLM's definitions)

Drafters are in drafters.py, verification in verify.py, the cost model and per-class window in
monitor.py. When a class's tokens per verify pass fall below the measured cost ratio it falls back
to plain decoding (SPEC_FALLBACK) and probes again after `probe_interval` of its plain steps.
"""

from __future__ import annotations

import copy
import time

import numpy as np
import torch

from engine.core.sampler import probs as sampler_probs
from engine.observe import rates
from engine.observe import trace_events as ev
from engine.observe.snapshot import SpecMetrics
from engine.speculative import verify_cost
from engine.speculative.drafters import (
    ModelDrafter,
    SpecContext,
    check_same_tokenizer,
    draft_id,
    ngram_propose,
)
from engine.speculative.math import break_even_alpha, expected_tokens_per_pass
from engine.speculative.monitor import ClassState, CostModel
from engine.speculative.verify import verify_greedy, verify_sampling


class SpecDecoder:
    def __init__(self, config, *, engine_config, bm, runner, scheduler, emit, model, tokenizer, device, dtype, is_live):
        """config: the SpeculativeConfig; the rest are the engine's parts this decoder uses
        (see SpecContext). is_live(request_id) says whether an id is a live request."""
        self.ctx = ctx = SpecContext(
            engine_config, bm, runner, scheduler, emit, model, tokenizer, device, dtype, is_live
        )
        self.bm = bm
        self.config = config
        self.method = config.method
        self.k = config.num_speculative_tokens
        self.drafter: ModelDrafter | None = None
        self.kind = "ngram"
        if config.method == "draft_model":
            self.drafter = self._load_draft_model(config.draft_model, config.draft_layers)
            self.kind = f"draft_model {config.draft_model}"
        elif config.method == "self_draft":
            n_layers = runner.num_layers
            L = config.draft_layers
            if L is not None and L >= n_layers:
                raise ValueError(f"speculative.draft_layers={L} must be below the target's {n_layers} layers")
            if config.draft_quantize == "int8":
                self.drafter = ModelDrafter(ctx, self._int8_copy(), L, shared_pool=False)
                self.kind = "self_draft int8" + (f" L={L}" if L else "")
            else:
                if L is None:
                    L = max(1, (n_layers * 4) // 5)
                self.drafter = ModelDrafter(ctx, model, L, shared_pool=True)
                self.kind = f"self_draft early-exit L={L}"
        self.draft_layers = self.drafter.num_layers if self.drafter else None
        # per-request state
        self._q: dict[str, torch.Tensor | None] = {}
        self._draft_s: dict[str, float] = {}
        self._last_fwd_s = 0.0
        # metrics
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted = 0
        self.num_rejections = 0
        self.acc_pos = [0] * self.k
        self.draft_pos = [0] * self.k
        self.num_target_passes = 0
        self.num_emitted = 0
        self.draft_time_s = 0.0
        self.verify_time_s = 0.0
        self.plain_decode_time_s = 0.0
        self.classes: dict[str, ClassState] = {}
        self.costs = CostModel()
        self._calibrate()

    # ------------------------------------------------------------------ setup
    def _load_draft_model(self, name: str, num_layers: int | None) -> ModelDrafter:
        from engine.model.models import load_model

        ctx = self.ctx
        model, tok = load_model(name, ctx.engine_config.device, ctx.engine_config.dtype)
        check_same_tokenizer(name, model, tok, ctx.model, ctx.tokenizer)
        if num_layers is not None and num_layers > model.config.num_hidden_layers:
            raise ValueError(
                f"speculative.draft_layers={num_layers} exceeds the draft model's "
                f"{model.config.num_hidden_layers} layers"
            )
        return ModelDrafter(self.ctx, model, num_layers, shared_pool=False)

    def _int8_copy(self):
        ctx = self.ctx
        if ctx.device.type != "cpu" or ctx.dtype != torch.float32:
            raise ValueError("speculative.draft_quantize='int8' (dynamic int8) needs device='cpu' and float32 weights")
        import warnings

        from torch.ao.quantization import quantize_dynamic

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = quantize_dynamic(copy.deepcopy(ctx.model), {torch.nn.Linear}, dtype=torch.qint8)
        m.eval()
        return m

    def _calibrate(self) -> None:
        """Time a 1-token and a (k+1)-token target pass at a short context, before any request
        exists, on free blocks the block manager lends for it (engine/speculative/verify_cost.py)."""
        bm = self.bm
        if not bm.is_empty:
            return
        ctx = 32
        while ctx > 1 and not verify_cost.fits(bm, ctx, self.k + 1):
            ctx //= 2
        if not verify_cost.fits(bm, ctx, self.k + 1):
            return
        vocab_size = self.ctx.model.config.vocab_size
        times = verify_cost.time_target_passes(self.ctx.runner, bm, (1, self.k + 1), ctx, 4, vocab_size)
        t1, tk = times[1], times[self.k + 1]
        self.costs.add(1, float(np.median(t1[1:])))
        self.costs.add(self.k + 1, float(np.median(tk[1:])))
        self.calibration = {"context": ctx, "plain_s": float(np.median(t1[1:])), "verify_s": float(np.median(tk[1:]))}

    # ------------------------------------------------------------------ per class
    def class_state(self, name: str) -> ClassState:
        st = self.classes.get(name)
        if st is None:
            st = self.classes[name] = ClassState()
        return st

    def configure_class(
        self, request_class: str, *, enabled: bool | None = None, num_speculative_tokens: int | None = None
    ) -> None:
        """Per request class: switch speculation off/on, or use another k (1..configured k)."""
        st = self.class_state(request_class)
        if enabled is not None:
            st.enabled = bool(enabled)
        if num_speculative_tokens is not None:
            if not (isinstance(num_speculative_tokens, int) and 1 <= num_speculative_tokens <= self.k):
                raise ValueError(f"num_speculative_tokens for class {request_class!r} must be in [1, {self.k}]")
            st.k = num_speculative_tokens

    # ------------------------------------------------------------------ hooks
    def release(self, req) -> None:
        rid = req.request_id
        self._q.pop(rid, None)
        self._draft_s.pop(rid, None)
        if self.drafter is not None:
            self.drafter.drop(rid, "request finished: its draft KV is freed")

    def propose(self, reqs: list) -> dict[str, list[int]]:
        """Drafts for the requests in decode, by request id (absent or [] = a plain step). Reads
        the requests; writes nothing into them."""
        t0 = time.perf_counter()
        running = {r.request_id for r in self.ctx.scheduler.running}
        if self.drafter is not None:
            for rid in self.drafter.owned():
                if rid not in running:
                    self.drafter.drop(
                        rid, "draft KV freed: its request is not running (finished, preempted or swapped)"
                    )
        for rid in [r for r in self._q if not self.ctx.is_live(r)]:
            self._q.pop(rid, None)
            self._draft_s.pop(rid, None)
        self._monitor(reqs)
        eligible, ks = [], {}
        max_len = self.ctx.engine_config.max_model_len
        drafts: dict[str, list[int]] = {}
        for req in reqs:
            if (
                not req.params.speculative
                or req.params.logprobs is not None
                or req.num_output_tokens < req.params.min_tokens
                or req.params.has_logits_processors
                or req.matcher is not None
            ):
                continue  # logprobs, min_tokens, logits processors, grammars: plain decode steps only
            st = self.class_state(req.request_class)
            if not (st.enabled and st.speculating):
                continue
            # a request may ask for fewer draft tokens than the engine's k (SamplingParams), never more
            k = min(
                req.params.num_speculative_tokens or st.k or self.k,
                st.k or self.k,
                req.params.max_tokens - req.num_output_tokens - 1,
                max_len - req.num_tokens - 1,
            )
            if self.drafter is not None and not self.drafter.shared and self.ctx.is_live(draft_id(req.request_id)):
                continue  # a user request is literally named "<rid>#draft": never share its table
            if k >= 1:
                eligible.append(req)
                ks[req.request_id] = k
        if not eligible:
            return drafts
        if self.drafter is None:
            cfg = self.config
            for req in eligible:
                d = ngram_propose(
                    req.all_token_ids,
                    ks[req.request_id],
                    cfg.prompt_lookup_min,
                    cfg.prompt_lookup_max,
                    cfg.prompt_lookup_match_bound,
                )
                drafts[req.request_id] = d
                self._q[req.request_id] = None
        else:
            for rid, (d, q) in self.drafter.propose(eligible, ks).items():
                drafts[rid] = d
                self._q[rid] = q
        secs = time.perf_counter() - t0
        self.draft_time_s += secs
        drafted = [r for r in eligible if drafts.get(r.request_id)]
        if drafted:
            per = secs / len(drafted)
            self.costs.add_draft(per)
            for r in drafted:
                self._draft_s[r.request_id] = per
        return drafts

    def record_forward(self, items, forward_seconds: float) -> None:
        self._last_fwd_s = forward_seconds
        decode_items = [it for it in items if it.phase != "prefill"]
        if decode_items and len(decode_items) == len(items):
            self.costs.add(sum(it.num_new_tokens for it in items), forward_seconds)
        n_plain = 0
        for it in decode_items:
            self.num_target_passes += 1
            if not it.num_spec_tokens:
                self.num_emitted += 1
                n_plain += 1
        if any(it.num_spec_tokens for it in items):
            self.verify_time_s += forward_seconds
        elif n_plain:
            self.plain_decode_time_s += forward_seconds

    @torch.inference_mode()
    def verify(self, req, drafts: list[int], logits: torch.Tensor, argmax: list[int] | None = None):
        """logits [len(drafts) + 1, V]; argmax: their rows' argmax where the caller has it (greedy)."""
        params = req.params
        n = len(drafts)
        if params.greedy:
            tokens, marks, n_acc = verify_greedy(drafts, logits, argmax)
        else:
            q = self._q.get(req.request_id)
            if q is not None:
                q = q[:n]
            tokens, marks, n_acc = verify_sampling(drafts, sampler_probs(logits, params), q, req.generator)
        # metrics (vLLM): one draft = one verify pass with >= 1 draft token
        self.num_drafts += 1
        self.num_draft_tokens += n
        self.num_accepted += n_acc
        self.num_rejections += n_acc < n
        self.num_emitted += len(tokens)
        for i in range(n):
            self.draft_pos[i] += 1
            if i < n_acc:
                self.acc_pos[i] += 1
        req.spec_num_drafts += 1
        req.spec_num_draft_tokens += n
        req.spec_num_accepted_tokens += n_acc
        st = self.class_state(req.request_class)
        st.add(n, n_acc, self.window_passes(st))
        # event
        dec = self.ctx.tokenizer.decode
        rejected = drafts[n_acc] if n_acc < n else None
        data = dict(
            method=self.method,
            k=n,
            proposed=list(drafts),
            proposed_text=[dec([t]) for t in drafts],
            accepted=n_acc,
            rejected=rejected,
            rejected_text=dec([rejected]) if rejected is not None else None,
            replacement=tokens[-1] if rejected is not None else None,
            replacement_text=dec([tokens[-1]]) if rejected is not None else None,
            bonus=tokens[-1] if rejected is None else None,
            bonus_text=dec([tokens[-1]]) if rejected is None else None,
            draft_s=self._draft_s.get(req.request_id, 0.0),
            verify_s=self._last_fwd_s,
            request_class=req.request_class,
        )
        if rejected is None:
            data["reason"] = f"all {n} draft tokens accepted, plus a bonus token"
        else:
            data["reason"] = (
                f"accepted {n_acc} of {n}; draft {data['rejected_text']!r} rejected, "
                f"target chose {data['replacement_text']!r}"
            )
        self.ctx.emit(ev.SPEC_VERIFY, req.request_id, **data)
        return tokens, marks

    # ------------------------------------------------------------------ fallback
    def window_passes(self, st: ClassState) -> int:
        """The verify passes a class's window holds: monitor_window draft tokens' worth at its k
        (counted in passes, so drafts shorter than k, as the n-gram drafter's after a short
        match, do not stretch the time before a verdict)."""
        return -(-self.config.monitor_window // (st.k or self.k))

    def _monitor(self, reqs: list) -> None:
        if not reqs:
            return
        cfg = self.config
        batch = len(reqs)
        present = {r.request_class for r in reqs if r.params.speculative}
        for name in present:
            st = self.class_state(name)
            if not st.enabled:
                continue
            if not st.speculating:
                st.plain_steps += 1
                if st.plain_steps >= cfg.probe_interval:
                    st.speculating = True
                    st.plain_steps = 0
                    st.clear()
                    self.ctx.emit(
                        ev.SPEC_FALLBACK,
                        None,
                        request_class=name,
                        speculating=True,
                        reason=f"probing again after {cfg.probe_interval} plain steps",
                    )
                continue
            if not cfg.enable_fallback or len(st.window) < self.window_passes(st):
                continue
            drafted = sum(d for d, _ in st.window)
            acc = sum(a for _, a in st.window)
            passes = len(st.window)
            k_mean = drafted / passes
            mal = rates.mean_acceptance_length(acc, passes)  # tokens per verify pass in the window
            c = self.costs.break_even(batch, k_mean)
            if c is None or mal >= c:
                continue
            st.speculating = False
            st.plain_steps = 0
            st.num_fallbacks += 1
            a_star = break_even_alpha(c, k_mean)
            self.ctx.emit(
                ev.SPEC_FALLBACK,
                None,
                request_class=name,
                speculating=False,
                acceptance_rate=rates.acceptance_rate(acc, drafted),
                mean_acceptance_length=mal,
                cost_ratio=c,
                break_even_alpha=a_star,
                mean_k=k_mean,
                batch=batch,
                draft_s_per_request=self.costs.draft_s_per_req,
                plain_pass_s=self.costs.cost(batch),
                verify_pass_s=self.costs.cost(batch * (1 + k_mean)),
                reason=(
                    f"class {name!r}: {mal:.2f} tokens per verify pass < measured cost ratio {c:.2f} "
                    f"(draft + verify vs a plain pass); acceptance {rates.acceptance_rate(acc, drafted):.2f}"
                    + (f" < break-even {a_star:.2f}" if a_star is not None else ", no α can break even")
                    + f"; plain decoding, probing again in {cfg.probe_interval} steps"
                ),
            )

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> SpecMetrics:
        return SpecMetrics(
            method=self.kind if self.method != "ngram" else "ngram",
            num_speculative_tokens=self.k,
            num_drafts=self.num_drafts,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted,
            accepted_per_position=tuple(self.acc_pos),
            drafts_per_position=tuple(self.draft_pos),
            num_target_passes=self.num_target_passes,
            num_emitted_tokens=self.num_emitted,
            draft_time_s=self.draft_time_s,
            verify_time_s=self.verify_time_s,
            verify_cost_ratio=self.costs.ratio(self.k),
            fallback_classes=tuple(sorted(n for n, s in self.classes.items() if not s.speculating)),
        )

    def summary(self) -> dict:
        """Plain numbers for reports and benchmarks: the metrics plus derived values. alpha_geo
        is accepted / positions the target judged (a position after a rejection is never
        judged): the geometric model's α, the one E(α, k) assumes."""
        m = self.metrics()
        judged = self.num_accepted + self.num_rejections
        alpha_geo = rates.acceptance_rate(self.num_accepted, judged)
        k_mean = self.num_draft_tokens / self.num_drafts if self.num_drafts else None
        d = {
            "method": m.method,
            "k": self.k,
            "num_drafts": m.num_drafts,
            "num_draft_tokens": m.num_draft_tokens,
            "num_accepted_tokens": m.num_accepted_tokens,
            "acceptance_rate": m.acceptance_rate,
            "alpha_geo": alpha_geo,
            "mean_draft_len": k_mean,
            "mean_acceptance_length": m.mean_acceptance_length,
            "num_target_passes": m.num_target_passes,
            "num_emitted_tokens": m.num_emitted_tokens,
            "tokens_per_target_pass": (m.num_emitted_tokens / m.num_target_passes) if m.num_target_passes else None,
            "verify_cost_ratio": m.verify_cost_ratio,
            "draft_time_s": m.draft_time_s,
            "verify_time_s": m.verify_time_s,
            "fallback_classes": list(m.fallback_classes),
            "calibration": getattr(self, "calibration", None),
        }
        if alpha_geo is not None:
            d["theory_tokens_per_verify_pass"] = expected_tokens_per_pass(alpha_geo, k_mean)
        return d
