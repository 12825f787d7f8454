"""What LLMEngine.step() and LLM.generate() return, with vLLM's names: RequestOutput holding one
CompletionOutput per sequence and the request's RequestMetrics (defined in engine/observe/metrics.py)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.observe.metrics import RequestMetrics  # defined beside its formulas; returned here


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list | None = None  # per token (logprob, ((token_id, logprob), ...)) when asked for


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
