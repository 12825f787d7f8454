"""Validated configuration dataclasses: EngineConfig, SamplingParams, SpeculativeConfig, TierConfig.

Every check raises ValueError naming the field and the limit, before anything is allocated.
The choice lists (KV cache dtypes, backends, weight formats, hash algorithms) are defined here once.

May import: nothing from engine (every package reads it: tests/engine/test_import_graph.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

ALLOCATORS = ("paged", "contiguous")
PREEMPTION_MODES = ("recompute", "swap")
VICTIM_POLICIES = ("last_admitted", "lru")
SPEC_METHODS = ("ngram", "draft_model", "self_draft")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# the one list of K/V pool formats (engine/model/kv_quant.py stores them; the UI imports this)
KV_CACHE_DTYPES = ("auto", "fp32", "bf16", "fp16", "fp8_e4m3", "int8", "int4", "int2")
QUANTIZED_KV_CACHE_DTYPES = ("fp8_e4m3", "int8", "int4", "int2")  # codes + scales, highest precision first
LINEAR_BACKENDS = ("auto", "torch")
ATTENTION_BACKENDS = ("auto", "torch", "flex")
DECODE_BACKENDS = ("auto", "c", "transformers")
WEIGHT_FORMATS = ("auto", "gguf", "fp32", "bf16", "fp16")
PREFIX_HASH_ALGOS = ("sha256", "sha256_cbor")  # vLLM's names (engine/core/prefix_hash.py computes them)
MIN_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_LOGIT_BIAS = 1024  # entries in one request's logit_bias


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


MAX_SCHEMA_CHARS = 64_000


def check_response_format(rf) -> None:
    """ValueError naming the field unless rf is {"type": "json_object"} or {"type": "json_schema",
    "json_schema": {"schema": {...}, ...}} (OpenAI's shapes)."""
    if isinstance(rf, dict) and rf.get("type") == "lark":
        if not isinstance(rf.get("lark"), str) or not rf["lark"]:
            raise ValueError("response_format: a lark grammar must be a non-empty string")
        return
    if not isinstance(rf, dict) or rf.get("type") not in ("json_object", "json_schema"):
        raise ValueError("response_format: type must be 'text', 'json_object' or 'json_schema'")
    if rf["type"] == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format: json_schema.schema must be a JSON object (the schema)")
        if len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
            raise ValueError(f"response_format: the schema must be at most {MAX_SCHEMA_CHARS} characters")


@dataclass(slots=True)
class TierConfig:
    """A pricing/priority tier: its own context cap (prompt + max_tokens) and a priority
    (lower number = more important; preempted last under the last_admitted policy)."""

    name: str
    max_context: int
    priority: int = 0

    def __post_init__(self):
        _check(
            isinstance(self.name, str) and 0 < len(self.name) <= 64,
            "tier.name must be a non-empty string of at most 64 characters",
        )
        _check(
            _is_int(self.max_context) and self.max_context >= 1,
            f"tier.max_context must be an integer >= 1, got {self.max_context!r}",
        )
        _check(_is_int(self.priority), f"tier.priority must be an integer, got {self.priority!r}")


def default_tiers() -> dict[str, TierConfig]:
    return {
        "free": TierConfig("free", max_context=1024, priority=2),
        "pro": TierConfig("pro", max_context=4096, priority=1),
        "enterprise": TierConfig("enterprise", max_context=8192, priority=0),
    }


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding. method: "ngram" (prompt lookup), "draft_model" (a separate HF model
    with the same tokenizer), "self_draft" (early exit at `draft_layers`, or `draft_quantize`
    ="int8" dynamic-int8 copy of the target)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    # ngram: draft at most (match length + 1) tokens, so a short, weak match costs a short verify
    # pass; False: always k tokens after a match (vLLM's ngram proposer)
    prompt_lookup_match_bound: bool = True
    draft_model: str | None = None
    draft_layers: int | None = None
    draft_quantize: str | None = None
    # acceptance monitoring / fallback
    monitor_window: int = 32  # per request class, its last monitor_window / k verify passes are judged
    probe_interval: int = 64  # plain steps of a fallen-back class before probing again
    enable_fallback: bool = True

    def __post_init__(self):
        _check(self.method in SPEC_METHODS, f"speculative.method must be one of {SPEC_METHODS}, got {self.method!r}")
        _check(
            _is_int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= 16,
            f"speculative.num_speculative_tokens must be an integer in [1, 16], got {self.num_speculative_tokens!r}",
        )
        _check(
            _is_int(self.prompt_lookup_min) and self.prompt_lookup_min >= 1,
            "speculative.prompt_lookup_min must be an integer >= 1",
        )
        _check(
            _is_int(self.prompt_lookup_max) and self.prompt_lookup_max >= self.prompt_lookup_min,
            "speculative.prompt_lookup_max must be an integer >= prompt_lookup_min",
        )
        _check(
            isinstance(self.prompt_lookup_match_bound, bool),
            f"speculative.prompt_lookup_match_bound must be true or false, got {self.prompt_lookup_match_bound!r}",
        )
        if self.method == "draft_model":
            _check(
                isinstance(self.draft_model, str) and self.draft_model,
                "speculative.draft_model must name a model (path or hub id) when method='draft_model'",
            )
        if self.draft_quantize is not None:
            _check(self.draft_quantize == "int8", "speculative.draft_quantize must be None or 'int8'")
        if self.draft_layers is not None:
            _check(
                _is_int(self.draft_layers) and self.draft_layers >= 1,
                "speculative.draft_layers must be an integer >= 1",
            )
        _check(
            _is_int(self.monitor_window) and self.monitor_window >= 1,
            "speculative.monitor_window must be an integer >= 1",
        )
        _check(
            _is_int(self.probe_interval) and self.probe_interval >= 1,
            "speculative.probe_interval must be an integer >= 1",
        )


# vLLM's speculative_config keys that differ from SpeculativeConfig's field names
_VLLM_SPEC_KEYS = {"model": "draft_model"}


def speculative_from_dict(d) -> SpeculativeConfig:
    """vLLM's `speculative_config` dict -> SpeculativeConfig. Keys: SpeculativeConfig's fields, and
    vLLM's "model" for the draft model (method "draft_model" when a model is given without one)."""
    if isinstance(d, SpeculativeConfig):
        return d
    _check(isinstance(d, dict), f"speculative_config must be a dict, got {type(d).__name__}")
    known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    kw = {}
    for k, v in d.items():
        name = _VLLM_SPEC_KEYS.get(k, k)
        _check(
            name in known,
            f"speculative_config has an unknown key {k!r} (known: {sorted(known | set(_VLLM_SPEC_KEYS))})",
        )
        kw[name] = v
    if "draft_model" in kw and "method" not in kw:
        kw["method"] = "draft_model"
    _check(
        kw.get("method", "ngram") in SPEC_METHODS,
        f"speculative_config.method must be one of {SPEC_METHODS}, got {kw.get('method')!r}",
    )
    return SpeculativeConfig(**kw)


@dataclass(slots=True)
class EngineConfig:
    model: str = "default"
    device: str = "auto"
    dtype: str = "auto"
    # what the K/V pool stores (vLLM's field name): "auto" = the model dtype; "int8" / "fp8_e4m3"
    # one byte per number plus a float32 scale per (token, KV head) row (engine/model/kv_quant.py);
    # "int4" / "int2" the same with 4 / 2 bits per number, packed
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit pool size, or
    kv_cache_bytes: int | None = None  # a byte budget (K and V, all layers); default 256 MiB, at most 4096 blocks
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    # None: the model's own limit (its HF config's max_position_embeddings), memory permitting;
    # explicit: refused where over that limit or (default-sized pool) where one such sequence
    # does not fit; engine/core/pool_sizing.py resolve_max_model_len. The engine's config holds the
    # resolved number
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # how full blocks are hashed for prefix caching, as vLLM's option of that name: "sha256" (its
    # default, pickle + SHA-256) or "sha256_cbor" (engine/core/prefix_hash.py)
    prefix_caching_hash_algo: str = "sha256"
    preemption_mode: str = "recompute"
    victim_policy: str = "last_admitted"
    swap_space_bytes: int = 64 * 1024 * 1024
    allocator: str = "paged"
    kv_cache: bool = True
    tiers: dict[str, TierConfig] = field(default_factory=default_tiers)
    default_tier: str | None = None
    speculative: SpeculativeConfig | None = None
    # vLLM's spelling: speculative_config=dict(method="ngram", num_speculative_tokens=4, ...), turned
    # into `speculative` (a SpeculativeConfig) here; give one of the two
    speculative_config: dict | None = None
    seed: int = 0
    # torch intra-op threads on CPU. None = 1: on these 2-core machines a 2-thread matmul of 1-64
    # rows slowed ~10x whenever another process was busy (measured: a 9-block preemption run took
    # 234 s with 2 threads vs 23 s with 1 beside other work). Set 2+ on a dedicated machine.
    num_threads: int | None = None
    # "auto": on CPU, Linear weights packed once for the engine's C kernel (or oneDNN where it
    # cannot be built) and q/k/v, gate/up merged into one matmul each (engine/model/linear.py);
    # "torch": transformers' own F.linear everywhere
    linear_backend: str = "auto"
    # "auto": on CPU in fp32, decode attention reads K/V in place from the blocks with the C
    # kernel of engine/model/csrc (built on first use; torch fallback); on CUDA the torch path until the
    # GPU check has verified "flex" there (engine/model/device.py); "torch": gather + SDPA always;
    # "flex": every row in one FlexAttention call reading K/V in place (engine/model/paged_flex.py)
    attention_backend: str = "auto"
    # CUDA, when neither num_kv_blocks nor kv_cache_bytes is given: the fraction of the device's
    # total memory this engine may use (weights and activations included); the KV pool gets the
    # rest (vLLM's gpu_memory_utilization; engine/model/device.py)
    gpu_memory_utilization: float = 0.9
    # "gguf": on CPU in fp32, Linears whose GGUF tensor (the model's source file) is Q4_1 / Q8_0
    # compute from those blocks, as on the de-quantized weights (bitwise, or within fp32 rounding
    # where AVX-512 sums each block factorized; engine/model/linear.py);
    # "fp32": the de-quantized fp32 weights; "bf16" / "fp16": fp32 weights that are exactly such
    # values (a 16-bit checkpoint loaded in fp32) held and read at 16 bits, widened exactly;
    # "auto": "gguf" where the model came from a GGUF, else bf16 / fp16 where every weight is
    # exactly one, else "fp32" (always "fp32" where the C kernel cannot be built)
    weight_format: str = "auto"
    # "c": every decoder layer in kvscope's C (engine/model/fused_decode.py: CPU fp32, Llama-family, fp32
    # pool), an error where it cannot run; "transformers": the HF layer code; "auto": "c" where it runs
    decode_backend: str = "auto"
    event_ring_size: int = 20000
    history_len: int = 512  # per-request history points kept for the UI

    def __post_init__(self):
        _check(isinstance(self.model, str) and self.model, "model must be a non-empty string")
        _check(
            isinstance(self.device, str)
            and (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")),
            f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}",
        )
        _check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
        )
        _check(
            _is_int(self.block_size) and 1 <= self.block_size <= 256,
            f"block_size must be an integer in [1, 256], got {self.block_size!r}",
        )
        if self.num_kv_blocks is not None:
            _check(
                _is_int(self.num_kv_blocks) and 1 <= self.num_kv_blocks <= 1_000_000,
                f"num_kv_blocks must be an integer in [1, 1000000], got {self.num_kv_blocks!r}",
            )
        if self.kv_cache_bytes is not None:
            _check(
                _is_int(self.kv_cache_bytes) and self.kv_cache_bytes >= 1,
                f"kv_cache_bytes must be a positive integer, got {self.kv_cache_bytes!r}",
            )
        _check(
            _is_int(self.max_num_seqs) and 1 <= self.max_num_seqs <= 4096,
            f"max_num_seqs must be an integer in [1, 4096], got {self.max_num_seqs!r}",
        )
        _check(
            _is_int(self.max_num_batched_tokens) and self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be an integer >= 1, got {self.max_num_batched_tokens!r}",
        )
        _check(
            self.max_model_len is None or (_is_int(self.max_model_len) and 2 <= self.max_model_len <= 1_048_576),
            f"max_model_len must be an integer in [2, 1048576], got {self.max_model_len!r}",
        )
        _check(
            isinstance(self.prefix_caching_hash_algo, str) and self.prefix_caching_hash_algo in PREFIX_HASH_ALGOS,
            f"prefix_caching_hash_algo must be one of {PREFIX_HASH_ALGOS}, got {self.prefix_caching_hash_algo!r}",
        )
        _check(
            self.preemption_mode in PREEMPTION_MODES,
            f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}",
        )
        _check(
            self.victim_policy in VICTIM_POLICIES,
            f"victim_policy must be one of {VICTIM_POLICIES}, got {self.victim_policy!r}",
        )
        _check(
            _is_int(self.swap_space_bytes) and self.swap_space_bytes >= 0, "swap_space_bytes must be an integer >= 0"
        )
        _check(self.allocator in ALLOCATORS, f"allocator must be one of {ALLOCATORS}, got {self.allocator!r}")
        _check(isinstance(self.kv_cache, bool), "kv_cache must be True or False")
        _check(
            isinstance(self.tiers, dict) and all(isinstance(t, TierConfig) for t in self.tiers.values()),
            "tiers must be a dict of name -> TierConfig",
        )
        if self.default_tier is not None:
            _check(
                self.default_tier in self.tiers, f"default_tier {self.default_tier!r} is not one of {list(self.tiers)}"
            )
        if self.speculative_config is not None:
            _check(self.speculative is None, "give speculative or speculative_config, not both")
            self.speculative = speculative_from_dict(self.speculative_config)
            self.speculative_config = None
        if self.speculative is not None:
            _check(isinstance(self.speculative, SpeculativeConfig), "speculative must be a SpeculativeConfig")
        if self.num_threads is not None:
            _check(
                _is_int(self.num_threads) and 1 <= self.num_threads <= 256, "num_threads must be an integer in [1, 256]"
            )
        _check(
            self.linear_backend in LINEAR_BACKENDS,
            f"linear_backend must be one of {LINEAR_BACKENDS}, got {self.linear_backend!r}",
        )
        _check(
            self.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}",
        )
        gmu = self.gpu_memory_utilization
        _check(
            isinstance(gmu, (int, float)) and not isinstance(gmu, bool) and 0 < gmu <= 1,
            f"gpu_memory_utilization must be a number in (0, 1], got {self.gpu_memory_utilization!r}",
        )
        _check(
            self.weight_format in WEIGHT_FORMATS,
            f"weight_format must be one of {WEIGHT_FORMATS}, got {self.weight_format!r}",
        )
        _check(
            self.decode_backend in DECODE_BACKENDS,
            f"decode_backend must be one of {DECODE_BACKENDS}, got {self.decode_backend!r}",
        )
        _check(
            _is_int(self.event_ring_size) and 16 <= self.event_ring_size <= 10_000_000,
            "event_ring_size must be an integer in [16, 10000000]",
        )
        _check(_is_int(self.history_len) and 2 <= self.history_len <= 100_000, "history_len must be in [2, 100000]")

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    max_tokens: int = 64
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    tier: str | None = None  # admission tier (context cap, priority)
    request_class: str | None = None  # speculative acceptance monitoring group
    cache_salt: str | None = None  # isolates prefix-cache sharing between tenants
    speculative: bool = True  # allow speculation for this request when the engine has it on
    min_tokens: int = 0  # EOS / stop_token_ids masked (and stop strings ignored) until this many
    logprobs: int | None = None  # None: none; N: the sampled token's logprob and the top N (vLLM: <= 20)
    num_speculative_tokens: int | None = None  # this request's draft length (<= the engine's k; None = engine's)
    presence_penalty: float = 0.0  # OpenAI / vLLM: minus this for every token already generated
    frequency_penalty: float = 0.0  # minus this times the token's count among the generated tokens
    repetition_penalty: float = 1.0  # HF / vLLM: prompt + generated tokens' logits / this (x this if < 0)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (ids checked against the vocab)
    min_p: float = 0.0  # drop tokens with p < min_p * p_max (after temperature)
    include_stop_str_in_output: bool = False  # vLLM: keep the matched stop string in the text
    response_format: dict | None = (
        None  # OpenAI's json_object / json_schema: a grammar mask (engine/core/structured.py)
    )
    skip_special_tokens: bool = True  # vLLM's default: special tokens (EOS, <|im_end|>, ...) left out of the text

    def __post_init__(self):
        # below MIN_TEMPERATURE, logits / temperature overflows float32 (inf - inf = nan) and sampling fails
        _check(
            isinstance(self.temperature, (int, float))
            and not isinstance(self.temperature, bool)
            and (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= 100),
            f"temperature must be 0 (greedy) or a number in [{MIN_TEMPERATURE}, 100], got {self.temperature!r}",
        )
        _check(_is_int(self.top_k) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}")
        _check(
            isinstance(self.top_p, (int, float)) and not isinstance(self.top_p, bool) and 0 < self.top_p <= 1,
            f"top_p must be in (0, 1], got {self.top_p!r}",
        )
        _check(
            self.num_speculative_tokens is None
            or (_is_int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= 16),
            f"num_speculative_tokens must be None or an integer in [1, 16], got {self.num_speculative_tokens!r}",
        )
        _check(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        if self.seed is not None:
            _check(
                _is_int(self.seed) and 0 <= self.seed < 2**63,
                f"seed must be an integer in [0, 2^63), got {self.seed!r}",
            )
        if self.stop is not None:
            if isinstance(self.stop, str):
                self.stop = [self.stop]
            _check(
                isinstance(self.stop, list)
                and all(isinstance(s, str) and s for s in self.stop)
                and len(self.stop) <= 16,
                "stop must be a list of at most 16 non-empty strings",
            )
        if self.stop_token_ids is not None:
            _check(
                isinstance(self.stop_token_ids, list) and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids must be a list of non-negative integers",
            )
        _check(isinstance(self.ignore_eos, bool), "ignore_eos must be True or False")
        _check(isinstance(self.include_stop_str_in_output, bool), "include_stop_str_in_output must be True or False")
        _check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
        )
        if self.logprobs is not None:
            _check(
                _is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_is_num(v) and -2 <= v <= 2, f"{name} must be a number in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        _check(_is_num(rp) and 0 < rp <= 2, f"repetition_penalty must be a number in (0, 2], got {rp!r}")
        _check(_is_num(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if self.logit_bias is not None:
            _check(
                isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_LOGIT_BIAS,
                f"logit_bias must be a mapping of at most {MAX_LOGIT_BIAS} token ids to numbers",
            )
            for t, b in self.logit_bias.items():
                _check(_is_int(t) and t >= 0, f"logit_bias: token id must be an integer >= 0, got {t!r}")
                _check(_is_num(b) and -100 <= b <= 100, f"logit_bias[{t}] must be a number in [-100, 100], got {b!r}")
        _check(isinstance(self.skip_special_tokens, bool), "skip_special_tokens must be true or false")
        if self.response_format is not None:
            check_response_format(self.response_format)
        if self.tier is not None:
            _check(isinstance(self.tier, str), "tier must be a string")
        if self.request_class is not None:
            _check(
                isinstance(self.request_class, str) and len(self.request_class) <= 64,
                "request_class must be a string of at most 64 characters",
            )
        if self.cache_salt is not None:
            _check(
                isinstance(self.cache_salt, str) and len(self.cache_salt) <= 256,
                "cache_salt must be a string of at most 256 characters",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_logits_processors(self) -> bool:
        """True when a penalty, logit_bias or min_p changes the logits (all neutral: the plain path)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_p
        )
