"""Structured output (response_format json_object / json_schema; the engine's own "lark" kind,
{"type": "lark", "lark": grammar, "param": field}, for forced tool calls) as a token mask, with llguidance
(the grammar library vLLM also uses; CPU only, no torch dependency, pinned in requirements.txt).

One `LLTokenizer` per engine tokenizer (built once, ~1 s); one `LLMatcher` per request, advanced on
every emitted token. `allowed()` is the mask for the next token: the sampler sets every other
logit to -inf (sampling and greedy alike). Requests with a grammar are not speculated
(engine/speculative/decoder.py), so each emitted token is sampled under its own exact mask."""

from __future__ import annotations

import json

import torch

from engine.config import MAX_SCHEMA_CHARS, check_response_format  # noqa: F401 (validated with the config)


def schema_of(rf: dict) -> dict:
    if rf["type"] == "json_object":
        return {"type": "object"}
    js = rf["json_schema"]
    return js.get("schema", js.get("json_schema"))


class Grammars:
    """Per-engine: the llguidance tokenizer and compiled-grammar cache."""

    def __init__(self, tokenizer, vocab_size: int):
        self.hf_tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lltok = None
        self._cache: dict[str, str] = {}

    @property
    def lltok(self):
        if self._lltok is None:
            import llguidance.hf

            try:
                self._lltok = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size)
            except ValueError as e:  # not a fast HF tokenizer (an id-only model)
                raise ValueError(f"response_format: this model's tokenizer cannot be used for grammars ({e})") from e
        return self._lltok

    def matcher(self, rf: dict) -> Matcher:
        """A fresh matcher for this response_format; ValueError naming the field for a bad schema."""
        import llguidance

        check_response_format(rf)
        lark = rf["type"] == "lark"
        field, what = (rf.get("param") or "response_format", "grammar") if lark else ("response_format", "JSON schema")
        key = rf["lark"] if lark else json.dumps(schema_of(rf), sort_keys=True)
        grammar = self._cache.get(key)
        if grammar is None:
            try:
                if lark:
                    grammar = llguidance.grammar_from("lark", key)
                else:
                    grammar = llguidance.LLMatcher.grammar_from_json_schema(
                        key, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
                    )
            except ValueError as e:
                raise ValueError(f"{field}: invalid {what}: {str(e)[:200]}") from e
            is_err, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.lltok)
            if is_err:
                raise ValueError(f"{field}: unsupported {what}: {msgs[0][:300]}")
            if len(self._cache) >= 256:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = grammar
        m = llguidance.LLMatcher(self.lltok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"{field}: unsupported {what}: {m.get_error()[:300]}")
        return Matcher(m, self.vocab_size)


_BITS = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)


class Matcher:
    """One request's grammar state."""

    def __init__(self, m, vocab_size: int):
        self.m, self.vocab_size = m, vocab_size

    def allowed(self) -> torch.Tensor:
        """Bool [vocab_size]: the tokens the grammar allows next (EOS only once it is complete)."""
        raw = torch.frombuffer(bytearray(self.m.compute_bitmask()), dtype=torch.uint8)
        bits = (raw[:, None] & _BITS) != 0  # little-endian bit order within each 32-bit word
        return bits.reshape(-1)[: self.vocab_size]

    def advance(self, tok: int) -> None:
        if not self.m.consume_token(tok):
            raise ValueError(
                f"structured output: token {tok} is not allowed by the grammar ({self.m.get_error()[:200]})"
            )


def mask_logits(logits: torch.Tensor, matcher: Matcher) -> torch.Tensor:
    """logits [V] -> fp32 logits with every token the grammar forbids at -inf."""
    x = logits.float().clone()
    allowed = matcher.allowed()
    n = min(x.shape[-1], allowed.shape[-1])
    x[:n] = x[:n].masked_fill(~allowed[:n], float("-inf"))
    x[n:] = float("-inf")
    return x
