"""Speculative decoding: drafters, verification, metrics, and per-class acceptance monitoring.

Hooks (called by LLMEngine.step):
  propose(reqs)                 -> sets req.spec_token_ids for requests in decode (or [])
  record_forward(items, secs)   -> after the target pass: costs, pass counts
  verify(req, drafts, logits)   -> (emitted tokens, marks); logits fp32 [len(drafts)+1, V]
  release(req)                  -> a request finished: drop its draft state and draft KV
  metrics()                     -> SpecMetrics (vLLM's definitions)

Drafters
- "ngram": prompt lookup. The last n tokens (n from prompt_lookup_max down to _min) are matched
  against the request's earlier tokens (most recent occurrence); the tokens that followed it are
  the draft. Deterministic, so its draft distribution q is a point mass.
- "draft_model" (and "self_draft" with draft_quantize="int8"): a second model with the same
  tokenizer and its OWN paged K/V pool (same block ids and block size as the target's). Its
  blocks are tracked in the engine's BlockManager under the id f"{rid}#draft", so they take
  real room in the pool and show in the pool map. Every step the draft's cached tokens are
  compared with the request's tokens; K/V past the common prefix is rolled back (blocks
  released, slots cleared) and the missing tokens are fed again (at most 2 after a verify,
  the whole context on the first decode step or after its draft cache was dropped).
- "self_draft" with draft_layers=L (early exit): the target's first L layers + final norm +
  lm_head, run on the TARGET's pool. Layers < L read the target's own K/V for the computed
  prefix (same weights, same inputs, so exactly what an L-layer model would have cached). The
  draft's writes for the new positions (last token + drafts) land in the target's own
  uncomputed slots, which the verify pass overwrites in every layer before reading them;
  positions past the target's blocks go to blocks borrowed for the duration of propose() only
  (under f"{rid}#draft"). After drafting, every slot the draft wrote is zeroed and the borrowed
  blocks are freed, so the pool is byte-for-byte what it would be without drafting.

Verification
- greedy: accept while draft == argmax(target); the first mismatch is replaced by the target's
  argmax (REPLACED, carrying the rejected draft id); all accepted -> one BONUS token.
- temperature > 0: accept draft x with probability min(1, p(x)/q(x)); on rejection sample from
  normalize(max(0, p - q)); all accepted -> sample the bonus from p of the last row. p is
  exactly the sampler's distribution (temperature, top-k, top-p); the request's own seeded
  generator draws every random number, so a seeded request is reproducible.

Monitoring: per request class, a window of the last `monitor_window` draft tokens. Speculation
pays when the tokens it yields per verify pass (mean acceptance length L) exceed the measured
cost ratio c = (draft time + verify pass time) / plain pass time for the current batch. When
L < c the class falls back to plain decoding (SPEC_FALLBACK) and probes again after
`probe_interval` of its plain steps. Costs come from a table of measured target-pass times by
tokens fed (seeded by a short calibration at start-up, then updated from every pure-decode
step) and the measured draft time per request.
"""
from __future__ import annotations

import copy
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from . import events as ev
from .block_manager import cdiv
from .runner import BatchRow, ModelRunner
from .sampler import probs as sampler_probs
from .snapshot import ACCEPTED, BONUS, REPLACED, SpecMetrics

DRAFT_SUFFIX = "#draft"


def draft_id(request_id: str) -> str:
    return request_id + DRAFT_SUFFIX


# ---------------------------------------------------------------------------- pure functions

def expected_tokens_per_pass(alpha: float, k: float) -> float:
    """E(α, k) = (1 − α^(k+1)) / (1 − α): tokens per target pass when each of k draft tokens is
    accepted with probability α and the first rejection stops the run."""
    if alpha >= 1:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def break_even_alpha(cost_ratio: float, k: float) -> float | None:
    """The α at which E(α, k) equals cost_ratio (speculation's cost per pass relative to a
    plain pass). 0 when speculation is cheaper than plain decoding even at α=0; None when even
    α=1 (k+1 tokens per pass) cannot pay for it."""
    if cost_ratio <= 1:
        return 0.0
    if cost_ratio >= k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens_per_pass(mid, k) < cost_ratio:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def verify_greedy(drafts: list[int], logits: torch.Tensor) -> tuple[list[int], list, int]:
    """logits [len(drafts)+1, V]. Returns (tokens, marks, num_accepted)."""
    target = logits.argmax(dim=-1).tolist()
    out, marks = [], []
    for j, x in enumerate(drafts):
        if x == target[j]:
            out.append(x)
            marks.append(ACCEPTED)
        else:
            out.append(target[j])
            marks.append((REPLACED, x))
            return out, marks, j
    out.append(target[len(drafts)])
    marks.append(BONUS)
    return out, marks, len(drafts)


def verify_sampling(drafts: list[int], p: torch.Tensor, q: torch.Tensor | None,
                    generator: torch.Generator | None) -> tuple[list[int], list, int]:
    """Rejection sampling (Leviathan et al. 2023; Chen et al. 2023).
    p: target probabilities [len(drafts)+1, V]; q: draft probabilities [len(drafts), V] the
    drafts were sampled from, or None for deterministic drafts (q = point mass on the draft).
    The emitted tokens are distributed exactly as sampling from p one token at a time."""
    out, marks = [], []
    dev = p.device
    for j, x in enumerate(drafts):
        px = float(p[j, x])
        qx = float(q[j, x]) if q is not None else 1.0
        u = float(torch.rand((), generator=generator, device=dev))
        if u * qx < px:                      # accept with probability min(1, p(x)/q(x))
            out.append(x)
            marks.append(ACCEPTED)
            continue
        if q is not None:
            resid = (p[j] - q[j]).clamp_min(0)
        else:
            resid = p[j].clone()
            resid[x] = 0
        s = float(resid.sum())
        if not s > 0:                        # only reachable through rounding (p == q)
            resid, s = p[j], float(p[j].sum())
        y = int(torch.multinomial(resid / s, 1, generator=generator))
        out.append(y)
        marks.append((REPLACED, x))
        return out, marks, j
    y = int(torch.multinomial(p[len(drafts)], 1, generator=generator))
    out.append(y)
    marks.append(BONUS)
    return out, marks, len(drafts)


def ngram_propose(tokens, k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup: the longest suffix n-gram (n_max..n_min) that occurred earlier; returns
    the k tokens that followed its most recent earlier occurrence."""
    arr = np.asarray(tokens, dtype=np.int64)
    L = len(arr)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        pat = arr[L - n:]
        # candidate starts i with arr[i:i+n] == pat and i + n < L (something follows it)
        win = np.lib.stride_tricks.sliding_window_view(arr[:L - 1], n)   # starts 0..L-1-n
        hits = np.flatnonzero((win == pat).all(axis=1))
        if hits.size:
            # copy what followed the match; when the copy reaches the end of the context it
            # continues from its own output (a repeating loop keeps drafting full length)
            ext = arr.tolist()
            src = int(hits[-1]) + n
            for j in range(k):
                ext.append(ext[src + j])
            return ext[L:]
    return []


# ---------------------------------------------------------------------------- costs

class CostModel:
    """Measured target-pass seconds by tokens fed, for pure-decode steps (every row a decode
    or verify row). EMA per token count; costs at unmeasured counts come from a least-squares
    line a + b·T through the measured points."""

    EMA = 0.2

    def __init__(self):
        self.table: dict[int, float] = {}
        self.counts: dict[int, int] = {}
        self.draft_s_per_req: float | None = None     # EMA of draft seconds per drafted request

    def add(self, tokens: int, secs: float) -> None:
        old = self.table.get(tokens)
        self.table[tokens] = secs if old is None else (1 - self.EMA) * old + self.EMA * secs
        self.counts[tokens] = self.counts.get(tokens, 0) + 1

    def add_draft(self, secs_per_req: float) -> None:
        d = self.draft_s_per_req
        self.draft_s_per_req = secs_per_req if d is None else (1 - self.EMA) * d + self.EMA * secs_per_req

    def cost(self, tokens: float) -> float | None:
        t = self.table
        if not t:
            return None
        if tokens in t:
            return t[tokens]
        if len(t) == 1:
            (t0, c0), = t.items()
            return c0 * max(tokens, 1) / max(t0, 1) if tokens > t0 else c0
        xs = np.array(list(t), dtype=float)
        ys = np.array(list(t.values()), dtype=float)
        b, a = np.polyfit(xs, ys, 1)
        b = max(b, 0.0)
        a = float(np.mean(ys - b * xs))
        return max(a + b * tokens, float(ys.min()) * 0.5)

    def ratio(self, k: float) -> float | None:
        """Measured cost of a (k+1)-token pass / a 1-token pass (one request)."""
        c1, ck = self.cost(1), self.cost(1 + k)
        return ck / c1 if c1 and ck else None

    def break_even(self, batch: int, k: float) -> float | None:
        """c = (draft time for the batch + verify pass) / plain pass, for `batch` decode rows
        each drafting k tokens."""
        plain = self.cost(batch)
        verify = self.cost(batch * (1 + k))
        if not plain or not verify:
            return None
        return (batch * (self.draft_s_per_req or 0.0) + verify) / plain


# ---------------------------------------------------------------------------- monitoring

@dataclass(slots=True)
class ClassState:
    speculating: bool = True
    window: deque = field(default_factory=deque)      # (draft tokens, accepted) per verify pass
    window_tokens: int = 0
    plain_steps: int = 0
    num_fallbacks: int = 0
    k: int | None = None                                # per-class k override
    enabled: bool = True                                # per-class switch

    def add(self, n_draft: int, n_acc: int, limit: int) -> None:
        self.window.append((n_draft, n_acc))
        self.window_tokens += n_draft
        while len(self.window) > 1 and self.window_tokens - self.window[0][0] >= limit:
            self.window_tokens -= self.window.popleft()[0]

    def clear(self) -> None:
        self.window.clear()
        self.window_tokens = 0


# ---------------------------------------------------------------------------- model drafters

class ModelDrafter:
    """Drafts with a model: either its own pool (draft_model / int8 copy) or, for early exit,
    the target's pool. See the module docstring."""

    def __init__(self, spec: "SpecDecoder", model, num_layers: int | None, shared_pool: bool):
        eng = spec.engine
        self.spec = spec
        self.engine = eng
        self.num_layers = num_layers
        self.shared = shared_pool
        if shared_pool:
            self.runner = eng.runner
        else:
            dtype = next(model.parameters()).dtype if not _is_quantized(model) else torch.float32
            if dtype not in (torch.float32, torch.float16, torch.bfloat16):
                dtype = torch.float32
            self.runner = ModelRunner(model, num_blocks=eng.bm.capacity, block_size=eng.bm.block_size,
                                      dtype=dtype, device=eng.device, num_layers=num_layers,
                                      linear_backend=eng.config.linear_backend,
                                      attention_backend=eng.config.attention_backend)
        self.dtoks: dict[str, list[int]] = {}           # own pool: tokens whose draft K/V are cached

    # ----------------------------------------------------------- own-pool bookkeeping
    def drop(self, rid: str, reason: str) -> None:
        self.dtoks.pop(rid, None)
        if self.shared:
            return
        bm = self.engine.bm
        freed = bm.free(draft_id(rid))
        if freed:
            self.engine._emit(ev.BLOCK_FREE, draft_id(rid), blocks=list(freed), reason=reason)

    def owned(self) -> list[str]:
        return list(self.dtoks)

    def _rollback(self, rid: str, keep: int) -> None:
        bm = self.engine.bm
        did = draft_id(rid)
        old = bm.num_tokens.get(did, 0)
        if keep >= old:
            return
        bs = bm.block_size
        table = bm.table(did)
        self.runner.clear_slots([table[p // bs] * bs + p % bs for p in range(keep, old) if p // bs < len(table)])
        released = bm.commit(did, keep)
        self.dtoks[rid] = self.dtoks[rid][:keep]
        if released:
            self.engine._emit(ev.BLOCK_FREE, did, blocks=released,
                              reason="draft KV rolled back past the tokens the target kept")

    # ----------------------------------------------------------- propose
    def propose(self, reqs: list, ks: dict[str, int]) -> dict[str, tuple[list[int], torch.Tensor | None]]:
        """reqs: requests in decode that may draft; ks: rid -> number of draft tokens wanted.
        Returns rid -> (drafts, q rows or None for greedy)."""
        eng = self.engine
        bm = eng.bm
        bs = bm.block_size
        # blocks the target's decode rows need this step come first
        reserve = sum(bm.blocks_needed(r.request_id, r.num_computed_tokens + 1) for r in eng.scheduler.running
                      if r.num_tokens - r.num_computed_tokens == 1)
        waiting_on_memory = any((w.waiting_reason or "").startswith("no free KV blocks") for w in eng.scheduler.waiting)
        if waiting_on_memory and not self.shared:
            for rid in list(self.dtoks):
                self.drop(rid, "draft KV dropped: waiting requests need the blocks")
            return {}
        plan = []   # (req, k, start, feed tokens)
        borrowed: dict[str, tuple[int, int]] = {}   # shared mode: rid -> (first draft pos, end pos)
        for req in reqs:
            rid = req.request_id
            k = ks[rid]
            ctx = req.all_token_ids
            N = len(ctx)
            if self.shared:
                start = req.num_computed_tokens           # == N - 1
                table = bm.table(rid)
                while k >= 1:
                    need = max(0, cdiv(start + k, bs) - len(table))
                    if need <= bm.num_free_blocks - reserve:
                        break
                    k -= 1
                if k < 1:
                    continue
                if need:
                    bm.allocate(draft_id(rid), need * bs)
                copies = bm.ensure_writable(rid, start, min(start + k, len(table) * bs))
                if copies:
                    self.runner.copy_blocks(copies)
                borrowed[rid] = (start, start + k)
                plan.append((req, k, start, [ctx[-1]]))
                continue
            did = draft_id(rid)
            have = self.dtoks.get(rid, [])
            common = 0
            lim = min(len(have), N - 1)                   # always re-feed the last token
            while common < lim and have[common] == ctx[common]:
                common += 1
            if rid in self.dtoks:
                self._rollback(rid, common)
            while k >= 1:
                need = bm.blocks_needed(did, N + k - 1)
                if need <= bm.num_free_blocks - reserve:
                    break
                k -= 1
            if k < 1:
                if rid in self.dtoks:
                    self.drop(rid, "draft KV dropped: no free blocks beyond what the target needs")
                continue
            bm.allocate(did, N + k - 1)
            self.dtoks.setdefault(rid, list(ctx[:common]))
            plan.append((req, k, common, list(ctx[common:])))
        if not plan:
            return {}
        out: dict[str, tuple[list[int], list | None]] = {}
        state = [[req, k, start, feed, []] for req, k, start, feed in plan]
        active = state
        while active:
            rows = []
            for req, k, start, feed, drafts in active:
                kv_id = req.request_id if self.shared else draft_id(req.request_id)
                table = bm.table(kv_id)
                if self.shared:
                    table = table + bm.table(draft_id(req.request_id))
                rows.append(BatchRow(kv_id, start, feed, table, len(feed) - 1))
            logits = self.runner.forward(rows, num_layers=self.num_layers)
            nxt = []
            for i, st in enumerate(active):
                req, k, start, feed, drafts = st
                p = req.params
                if p.greedy:
                    tok = int(torch.argmax(logits[i]))
                    qrow = None
                else:
                    qrow = sampler_probs(logits[i], p)
                    tok = int(torch.multinomial(qrow, 1, generator=req.generator))
                drafts.append((tok, qrow))
                st[2] = start + len(feed)
                st[3] = [tok]
                if len(drafts) < k:
                    nxt.append(st)
            active = nxt
        for req, k, start, feed, drafts in state:
            rid = req.request_id
            ids = [t for t, _ in drafts]
            q = None if req.params.greedy else torch.stack([r for _, r in drafts])
            out[rid] = (ids, q)
            if self.shared:
                first, end = borrowed[rid]
                table = bm.table(rid) + bm.table(draft_id(rid))
                self.runner.clear_slots([table[p // bs] * bs + p % bs for p in range(first, end)])
                lent = bm.free(draft_id(rid))
                # back to the head of the free queue, in their order: the verify pass allocates
                # these same (now hash-less) blocks instead of evicting more cached prefixes
                for bid in reversed(lent):
                    if bid in bm.free_queue:
                        bm.free_queue.move_to_end(bid, last=False)
            else:
                did = draft_id(rid)
                n = len(req.all_token_ids) + len(ids) - 1
                bm.commit(did, n)
                self.dtoks[rid] = req.all_token_ids + ids[:-1]
        return out


def _is_quantized(model) -> bool:
    return any("quantized" in type(m).__module__ for m in model.modules())


def _check_same_tokenizer(name: str, draft_model, draft_tok, target_model, target_tok) -> None:
    tv, dv = target_model.config.vocab_size, draft_model.config.vocab_size
    if tv != dv:
        raise ValueError(f"speculative.draft_model {name!r}: vocab size {dv} differs from the target's {tv}; "
                         "the draft must use the target's tokenizer")
    if draft_tok is not target_tok:
        if len(draft_tok) != len(target_tok) or draft_tok.get_vocab() != target_tok.get_vocab():
            raise ValueError(f"speculative.draft_model {name!r}: its tokenizer's vocabulary differs from the "
                             "target's; the draft must use the same tokenizer")
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        a, b = getattr(target_tok, attr, None), getattr(draft_tok, attr, None)
        if a != b:
            raise ValueError(f"speculative.draft_model {name!r}: {attr} is {b}, the target's is {a}")


# ---------------------------------------------------------------------------- the decoder

class SpecDecoder:
    def __init__(self, engine, config):
        self.engine = engine
        self.config = config
        self.method = config.method
        self.k = config.num_speculative_tokens
        self.drafter: ModelDrafter | None = None
        self.kind = "ngram"
        if config.method == "draft_model":
            self.drafter = self._load_draft_model(config.draft_model, config.draft_layers)
            self.kind = f"draft_model {config.draft_model}"
        elif config.method == "self_draft":
            n_layers = engine.runner.num_layers
            L = config.draft_layers
            if L is not None and L >= n_layers:
                raise ValueError(f"speculative.draft_layers={L} must be below the target's {n_layers} layers")
            if config.draft_quantize == "int8":
                self.drafter = ModelDrafter(self, self._int8_copy(), L, shared_pool=False)
                self.kind = "self_draft int8" + (f" L={L}" if L else "")
            else:
                if L is None:
                    L = max(1, (n_layers * 4) // 5)
                self.drafter = ModelDrafter(self, engine.model, L, shared_pool=True)
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
        from .models import load_model
        eng = self.engine
        model, tok = load_model(name, eng.config.device, eng.config.dtype)
        _check_same_tokenizer(name, model, tok, eng.model, eng.tokenizer)
        if num_layers is not None and num_layers > model.config.num_hidden_layers:
            raise ValueError(f"speculative.draft_layers={num_layers} exceeds the draft model's "
                             f"{model.config.num_hidden_layers} layers")
        return ModelDrafter(self, model, num_layers, shared_pool=False)

    def _int8_copy(self):
        eng = self.engine
        if eng.device.type != "cpu" or eng.dtype != torch.float32:
            raise ValueError("speculative.draft_quantize='int8' (dynamic int8) needs device='cpu' and float32 weights")
        from torch.ao.quantization import quantize_dynamic
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = quantize_dynamic(copy.deepcopy(eng.model), {torch.nn.Linear}, dtype=torch.qint8)
        m.eval()
        return m

    @torch.inference_mode()
    def _calibrate(self) -> None:
        """Time a 1-token and a (k+1)-token target pass at a short context, before any request
        exists, on blocks that are free and hold nothing (zeroed again afterwards)."""
        eng = self.engine
        bm = eng.bm
        if bm.tables or bm.swapped:
            return
        bs = bm.block_size
        ctx = 32
        while ctx > 1 and cdiv(ctx + self.k + 1, bs) > bm.num_free_blocks:
            ctx //= 2
        if cdiv(ctx + self.k + 1, bs) > bm.num_free_blocks:
            return
        table = list(bm.free_queue)[:cdiv(ctx + self.k + 1, bs)]
        toks = [(i * 7919) % min(eng.vocab_size, 30000) + 10 for i in range(ctx + self.k + 1)]
        r = eng.runner
        r.forward([BatchRow("calib", 0, toks[:ctx], table, ctx - 1)])
        t1, tk = [], []
        for _ in range(4):
            a = time.perf_counter()
            r.forward([BatchRow("calib", ctx, toks[ctx:ctx + 1], table, 0)])
            t1.append(time.perf_counter() - a)
            a = time.perf_counter()
            r.forward([BatchRow("calib", ctx, toks[ctx:ctx + self.k + 1], table, 0)])
            tk.append(time.perf_counter() - a)
        r.clear_slots([b * bs + o for b in table for o in range(bs)])
        self.costs.add(1, float(np.median(t1[1:])))
        self.costs.add(self.k + 1, float(np.median(tk[1:])))
        self.calibration = {"context": ctx, "plain_s": float(np.median(t1[1:])), "verify_s": float(np.median(tk[1:]))}

    # ------------------------------------------------------------------ per class
    def class_state(self, name: str) -> ClassState:
        st = self.classes.get(name)
        if st is None:
            st = self.classes[name] = ClassState()
        return st

    def configure_class(self, request_class: str, *, enabled: bool | None = None,
                        num_speculative_tokens: int | None = None) -> None:
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

    def propose(self, reqs: list) -> None:
        t0 = time.perf_counter()
        eng = self.engine
        running = {r.request_id for r in eng.scheduler.running}
        if self.drafter is not None:
            for rid in self.drafter.owned():
                if rid not in running:
                    self.drafter.drop(rid, "draft KV freed: its request is not running (finished, preempted or swapped)")
        for rid in [r for r in self._q if r not in eng.requests]:
            self._q.pop(rid, None)
            self._draft_s.pop(rid, None)
        self._monitor(reqs)
        eligible, ks = [], {}
        max_len = eng.config.max_model_len
        for req in reqs:
            req.spec_token_ids = []
            if not req.params.speculative or req.params.logprobs is not None \
                    or req.num_output_tokens < req.params.min_tokens:
                continue     # logprobs and min_tokens masking are done on plain decode steps
            st = self.class_state(req.request_class)
            if not (st.enabled and st.speculating):
                continue
            k = min(st.k or self.k, req.params.max_tokens - req.num_output_tokens - 1,
                    max_len - req.num_tokens - 1)
            if self.drafter is not None and not self.drafter.shared and draft_id(req.request_id) in eng.requests:
                continue     # a user request is literally named "<rid>#draft": never share its table
            if k >= 1:
                eligible.append(req)
                ks[req.request_id] = k
        if not eligible:
            return
        if self.drafter is None:
            cfg = self.config
            for req in eligible:
                d = ngram_propose(req.all_token_ids, ks[req.request_id], cfg.prompt_lookup_min, cfg.prompt_lookup_max)
                req.spec_token_ids = d
                self._q[req.request_id] = None
        else:
            for rid, (d, q) in self.drafter.propose(eligible, ks).items():
                eng.requests[rid].spec_token_ids = d
                self._q[rid] = q
        secs = time.perf_counter() - t0
        self.draft_time_s += secs
        drafted = [r for r in eligible if r.spec_token_ids]
        if drafted:
            per = secs / len(drafted)
            self.costs.add_draft(per)
            for r in drafted:
                self._draft_s[r.request_id] = per

    def record_forward(self, items, forward_seconds: float) -> None:
        self._last_fwd_s = forward_seconds
        decode_items = [it for it in items if it.req.num_computed_tokens > 0
                        and it.num_new_tokens - it.num_spec_tokens == 1]
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
    def verify(self, req, drafts: list[int], logits: torch.Tensor):
        params = req.params
        n = len(drafts)
        if params.greedy:
            tokens, marks, n_acc = verify_greedy(drafts, logits)
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
        st.add(n, n_acc, self.config.monitor_window)
        # event
        dec = self.engine.tokenizer.decode
        rejected = drafts[n_acc] if n_acc < n else None
        data = dict(method=self.method, k=n, proposed=list(drafts), proposed_text=[dec([t]) for t in drafts],
                    accepted=n_acc, rejected=rejected, rejected_text=dec([rejected]) if rejected is not None else None,
                    replacement=tokens[-1] if rejected is not None else None,
                    replacement_text=dec([tokens[-1]]) if rejected is not None else None,
                    bonus=tokens[-1] if rejected is None else None,
                    bonus_text=dec([tokens[-1]]) if rejected is None else None,
                    draft_s=self._draft_s.get(req.request_id, 0.0), verify_s=self._last_fwd_s,
                    request_class=req.request_class)
        if rejected is None:
            data["reason"] = f"all {n} draft tokens accepted, plus a bonus token"
        else:
            data["reason"] = (f"accepted {n_acc} of {n}; draft {data['rejected_text']!r} rejected, "
                              f"target chose {data['replacement_text']!r}")
        self.engine._emit(ev.SPEC_VERIFY, req.request_id, **data)
        return tokens, marks

    # ------------------------------------------------------------------ fallback
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
                    self.engine._emit(ev.SPEC_FALLBACK, None, request_class=name, speculating=True,
                                      reason=f"probing again after {cfg.probe_interval} plain steps")
                continue
            if not cfg.enable_fallback or st.window_tokens < cfg.monitor_window:
                continue
            drafted = sum(d for d, _ in st.window)
            acc = sum(a for _, a in st.window)
            passes = len(st.window)
            k_mean = drafted / passes
            mal = 1 + acc / passes                     # tokens per verify pass in the window
            c = self.costs.break_even(batch, k_mean)
            if c is None or mal >= c:
                continue
            st.speculating = False
            st.plain_steps = 0
            st.num_fallbacks += 1
            a_star = break_even_alpha(c, k_mean)
            self.engine._emit(
                ev.SPEC_FALLBACK, None, request_class=name, speculating=False,
                acceptance_rate=acc / drafted, mean_acceptance_length=mal, cost_ratio=c,
                break_even_alpha=a_star, mean_k=k_mean, batch=batch,
                draft_s_per_request=self.costs.draft_s_per_req, plain_pass_s=self.costs.cost(batch),
                verify_pass_s=self.costs.cost(batch * (1 + k_mean)),
                reason=(f"class {name!r}: {mal:.2f} tokens per verify pass < measured cost ratio {c:.2f} "
                        f"(draft + verify vs a plain pass); acceptance {acc / drafted:.2f}"
                        + (f" < break-even {a_star:.2f}" if a_star is not None else ", no α can break even")
                        + f"; plain decoding, probing again in {cfg.probe_interval} steps"))

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> SpecMetrics:
        return SpecMetrics(
            method=self.kind if self.method != "ngram" else "ngram",
            num_speculative_tokens=self.k, num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted, accepted_per_position=tuple(self.acc_pos),
            drafts_per_position=tuple(self.draft_pos), num_target_passes=self.num_target_passes,
            num_emitted_tokens=self.num_emitted, draft_time_s=self.draft_time_s, verify_time_s=self.verify_time_s,
            verify_cost_ratio=self.costs.ratio(self.k),
            fallback_classes=tuple(sorted(n for n, s in self.classes.items() if not s.speculating)))

    def summary(self) -> dict:
        """Plain numbers for reports and benchmarks: the metrics plus derived values. alpha_geo
        is accepted / positions the target judged (a position after a rejection is never
        judged): the geometric model's α, the one E(α, k) assumes."""
        m = self.metrics()
        judged = self.num_accepted + self.num_rejections
        alpha_geo = self.num_accepted / judged if judged else None
        k_mean = self.num_draft_tokens / self.num_drafts if self.num_drafts else None
        d = {
            "method": m.method, "k": self.k, "num_drafts": m.num_drafts, "num_draft_tokens": m.num_draft_tokens,
            "num_accepted_tokens": m.num_accepted_tokens, "acceptance_rate": m.acceptance_rate,
            "alpha_geo": alpha_geo, "mean_draft_len": k_mean,
            "mean_acceptance_length": m.mean_acceptance_length,
            "num_target_passes": m.num_target_passes, "num_emitted_tokens": m.num_emitted_tokens,
            "tokens_per_target_pass": (m.num_emitted_tokens / m.num_target_passes) if m.num_target_passes else None,
            "verify_cost_ratio": m.verify_cost_ratio, "draft_time_s": m.draft_time_s,
            "verify_time_s": m.verify_time_s, "fallback_classes": list(m.fallback_classes),
            "calibration": getattr(self, "calibration", None),
        }
        if alpha_geo is not None:
            d["theory_tokens_per_verify_pass"] = expected_tokens_per_pass(alpha_geo, k_mean)
        return d


# ---------------------------------------------------------------------------- measurement

def speedup_vs_plain(config, prompt, params, repeats: int = 1) -> dict:
    """Wall-clock speedup of speculative decoding over plain decoding for the same request, in
    this process: runs `prompt` alone on a plain engine and on one with `config.speculative`
    (alternating, best of `repeats`), and reports both times, whether the outputs are identical
    (they must be for greedy), and the speculative metrics for those runs."""
    from .engine import LLMEngine
    if config.speculative is None:
        raise ValueError("speedup_vs_plain needs an EngineConfig with speculative set")
    plain = LLMEngine(config.replace(speculative=None))
    spec = LLMEngine(config)

    def once(eng):
        rid = eng.add_request(None, prompt, params)
        t = time.perf_counter()
        out = None
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.request_id == rid and o.finished:
                    out = o
        return out, time.perf_counter() - t

    tp, ts = [], []
    for _ in range(max(1, repeats)):
        po, a = once(plain)
        so, b = once(spec)
        tp.append(a)
        ts.append(b)
    n = len(so.outputs[0].token_ids)
    return {"plain_s": min(tp), "spec_s": min(ts), "speedup": min(tp) / min(ts), "tokens": n,
            "plain_tok_s": len(po.outputs[0].token_ids) / min(tp), "spec_tok_s": n / min(ts),
            "identical": po.outputs[0].token_ids == so.outputs[0].token_ids, "spec": spec.spec.summary()}
