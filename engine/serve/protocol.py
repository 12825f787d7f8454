"""Request bodies of the OpenAI routes as pydantic models, and their mapping to SamplingParams.

Unknown fields are accepted and ignored as vLLM does (extra="allow"); `ignored_fields()` lists
them (plus accepted-but-unused OpenAI fields) for the x-kvscope-ignored-fields header and the
server log. `null` means "the default" for every field (vLLM accepts null for n, logprobs, stream,
penalties, ...). Fields kvscope implements keep strict checks: types are strict (a string is not a number),
ranges follow vLLM's: max_tokens >= 1, temperature in [0, 100] (engine limit), top_p in (0, 1],
top_k -1/0 (off) or >= 1, n in [1, MAX_N], logprobs / top_logprobs in [0, 20]. kvscope extras:
tier, request_class, cache_salt, speculative (per-request on/off); stream_options.include_obfuscation
(OpenAI's, on by default as there) and kvscope's coalesce_tokens / pad_chunks_to, the defences
against the packet-size side channel (render.obfuscation, engine/lab/packet_channel.py)."""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.config import MAX_LOGPROBS, SamplingParams
from engine.core.inputs import MAX_PROMPT_CHARS
from engine.serve import tools as tools_mod

MAX_N = 16  # choices per request (each one is a request in the engine)
MAX_STOP = 16  # stop strings (SamplingParams' limit)
MAX_PROMPTS = 64  # prompts in one /v1/completions batch


class _Lenient(BaseModel):
    """Unknown fields kept in model_extra (reported, never used); null -> the field's default."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if isinstance(data, dict):
            fields = cls.model_fields
            data = {k: v for k, v in data.items() if not (v is None and k in fields and fields[k].default is not None)}
        return data

    def extra_fields(self, prefix: str = "") -> list[str]:
        return [prefix + k for k in sorted(self.model_extra or {})]


MAX_COALESCE_TOKENS = 64  # stream_options.coalesce_tokens
MIN_PAD_CHUNKS_TO, MAX_PAD_CHUNKS_TO = 32, 4096  # stream_options.pad_chunks_to (bytes), 0 = off


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    # OpenAI's: an `obfuscation` string of random length in every chunk, on unless false
    include_obfuscation: bool = True
    # kvscope extras: hold tokens back until this many are ready for one chunk (the last may
    # hold fewer); pad every chunk's event to a multiple of this many bytes (0: off)
    coalesce_tokens: int = Field(1, ge=1, le=MAX_COALESCE_TOKENS)
    pad_chunks_to: int = Field(0, ge=0, le=MAX_PAD_CHUNKS_TO)

    @model_validator(mode="after")
    def _check_pad(self):
        if 0 < self.pad_chunks_to < MIN_PAD_CHUNKS_TO:
            raise ValueError(
                f"pad_chunks_to must be 0 (off) or {MIN_PAD_CHUNKS_TO}..{MAX_PAD_CHUNKS_TO} bytes, "
                f"got {self.pad_chunks_to}"
            )
        return self


class _Common(_Lenient):
    model: str | None = Field(None, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_tokens: int = Field(0, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    seed: int | None = Field(None, ge=0, lt=2**63)
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    presence_penalty: float = Field(0.0, ge=-2, le=2)  # engine/core/sampler.py process()
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's form) -> bias in [-100, 100]
    min_p: float = Field(0.0, ge=0, le=1)
    skip_special_tokens: bool = True  # vLLM's default; False keeps EOS / <|im_end|> / ... in the text
    include_stop_str_in_output: bool = False  # vLLM: the matched stop string kept in the text
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema (engine/core/structured.py)
    # kvscope extras
    tier: str | None = Field(None, max_length=64)
    request_class: str | None = Field(None, max_length=64)
    cache_salt: str | None = Field(None, max_length=256)
    speculative: bool = True

    @model_validator(mode="after")
    def _check_common(self):
        if isinstance(self.stop, list):
            if len(self.stop) > MAX_STOP:
                raise ValueError(f"stop: at most {MAX_STOP} strings, got {len(self.stop)}")
            if any(not s for s in self.stop):
                raise ValueError("stop: strings must not be empty")
        elif self.stop == "":
            raise ValueError("stop: must not be an empty string")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.top_k is not None and self.top_k < 0 and self.top_k != -1:
            raise ValueError("top_k: must be -1 (off), 0 (off) or >= 1")
        if self.temperature is not None and 0 < self.temperature < 1e-5:
            raise ValueError("temperature: must be 0 (greedy) or >= 1e-05")
        for k, v in (self.logit_bias or {}).items():
            if not k.strip().isdigit():
                raise ValueError(f"logit_bias: keys must be token ids (non-negative integers), got {k!r}")
            if not -100 <= v <= 100:
                raise ValueError(f"logit_bias: the bias of token {k} must be in [-100, 100], got {v!r}")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            from engine.config import check_response_format

            if self.response_format.get("type") not in ("json_object", "json_schema"):
                raise ValueError("response_format: type must be 'text', 'json_object' or 'json_schema'")

            check_response_format(self.response_format)  # ValueError naming response_format
        return self

    def ignored_fields(self) -> list[str]:
        """Fields present in the body that do nothing here (sorted): unknown ones and the known
        OpenAI / vLLM ones kvscope does not use."""
        out = self.extra_fields()
        if self.stream_options is not None:
            out += self.stream_options.extra_fields("stream_options.")
        return sorted(set(out))

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the field (SamplingParams' own checks)."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=max(0, self.top_k or 0),
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            tier=self.tier,
            request_class=self.request_class,
            cache_salt=self.cache_salt,
            speculative=self.speculative,
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            repetition_penalty=float(self.repetition_penalty),
            logit_bias={int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None,
            min_p=float(self.min_p),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            response_format=None
            if (self.response_format or {}).get("type", "text") == "text"
            else self.response_format,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def stream_opts(self) -> StreamOptions:
        """The stream options with their defaults where the request gave none."""
        return self.stream_options if self.stream_options is not None else StreamOptions()


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)
    echo: bool = False
    suffix: None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @model_validator(mode="after")
    def _check_prompt(self):
        p = self.prompt
        if isinstance(p, list):
            if not p:
                raise ValueError("prompt: must not be an empty list")
            if isinstance(p[0], (str, list)) and len(p) > MAX_PROMPTS:
                raise ValueError(f"prompt: at most {MAX_PROMPTS} prompts in one request, got {len(p)}")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of == n is supported")
        return self

    def prompts(self) -> list:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Lenient):
    name: str = Field(max_length=256)
    arguments: str = ""


class ToolCall(_Lenient):
    id: str | None = Field(None, max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Lenient):
    """One history message. An assistant message as the server returned it (tool_calls [] or
    a list, refusal null, reasoning_content, ...) is taken back unchanged: the OpenAI SDK
    multi-turn pattern appends r.choices[0].message to the history."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)
    tool_call_id: str | None = Field(None, max_length=256)
    refusal: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        choice = self.resolved_tool_choice()  # ValueError naming tools.i... / tool_choice
        if choice not in (None, "none", "auto") and (self.response_format or {}).get("type", "text") != "text":
            raise ValueError("tool_choice: a forced tool call cannot be combined with response_format")
        return self

    def tool_defs(self) -> list[dict] | None:
        """The request's tools, checked and normalized (engine/serve/tools.py); None without any."""
        return tools_mod.check_tools(self.tools) if self.tools else None

    def resolved_tool_choice(self) -> str | None:
        """None (no tools), "none", "auto", "required" or the forced tool's name."""
        return tools_mod.resolve_tool_choice(self.tool_choice, self.tool_defs())

    @property
    def parses_tool_calls(self) -> bool:
        return self.resolved_tool_choice() not in (None, "none")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        params = super().sampling_params(max_tokens, logprobs)
        choice = self.resolved_tool_choice()
        forced = tools_mod.forced_format(self.tool_defs(), choice) if choice else None
        return dataclasses.replace(params, response_format=forced) if forced else params

    def chat_messages(self) -> list[dict]:
        """Messages for the chat template: developer -> system; tool_calls (when non-empty) with
        their arguments as a mapping when they are a JSON object (vLLM's rule: HF templates apply
        `tojson` to them), and tool_call_id passed on."""
        out = []
        for m in self.messages:
            d: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.tool_calls:
                d["tool_calls"] = [
                    {
                        "id": t.id,
                        "type": "function",
                        "function": {"name": t.function.name, "arguments": _arguments(t.function.arguments)},
                    }
                    for t in m.tool_calls
                ]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.name is not None and m.role == "tool":
                d["name"] = m.name
            out.append(d)
        return out

    def ignored_fields(self) -> list[str]:
        out = super().ignored_fields()
        for i, m in enumerate(self.messages):
            out += m.extra_fields(f"messages.{i}.")
        return sorted(set(out))


def _arguments(text: str):
    """A tool call's arguments for the template: the JSON object they hold, else the text itself."""
    try:
        obj = json.loads(text)
    except ValueError:
        return text
    return obj if isinstance(obj, dict) else text


class TokenizeRequest(_Lenient):
    """vLLM's /tokenize body: either prompt (completions form) or messages (chat form)."""

    model: str | None = Field(None, max_length=256)
    prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=1024)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        return self

    def chat_messages(self) -> list[dict]:
        return ChatCompletionRequest.model_construct(messages=self.messages).chat_messages()


class DetokenizeRequest(_Lenient):
    model: str | None = Field(None, max_length=256)
    tokens: list[Annotated[int, Field(ge=0)]] = Field(max_length=1_000_000)
