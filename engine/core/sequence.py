"""A request's state machine and token bookkeeping.

waiting --admit--> running --finish--> finished
   ^                 |  \\--abort/error--> aborted
   |                 |--preempt(recompute)--> preempted (waiting, front of the queue)
   |                 \\--preempt(swap)--> swapped --swap in--> running
rejected (never admitted: over a cap, bad input at admission)
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from engine.config import SamplingParams
from engine.observe.snapshot import HistoryPoint, RequestState, TokenMark


class WaitReason(enum.StrEnum):
    """Why a request did not run this step, typed: Request.wait_reason (and a WAIT event's
    `wait_reason`). The sentence shown to people is Request.wait_reason_text, which snapshots
    carry as RequestInfo.waiting_reason (the name traces hold)."""

    QUEUED = "queued"  # behind earlier requests (FCFS), or not yet looked at
    TOKEN_BUDGET = "token_budget"  # max_num_batched_tokens used up this step
    SEQ_LIMIT = "seq_limit"  # max_num_seqs running
    NO_FREE_BLOCKS = "no_free_blocks"  # not enough free KV blocks to admit it
    NO_CONTIGUOUS_RUN = "no_contiguous_run"  # contiguous allocator: no free run long enough
    MEMORY_PRESSURE = "memory_pressure"  # someone was preempted this step
    PREEMPTED = "preempted"  # waiting to recompute after a preemption / eviction
    SWAPPED = "swapped"  # swapped out, waiting for blocks to swap back in


# The request state machine's states (the contract's RequestState; `Status` is its engine-side name).
Status = RequestState


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    prompt_text: str = ""
    tier: str | None = None
    priority: int = 0
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the pool
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    admit_order: int = -1  # admission counter (for the last_admitted victim policy)
    last_scheduled_step: int = -1  # for the LRU victim policy
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    wait_reason: WaitReason | None = None  # why it is not running, typed (None: it runs)
    wait_reason_text: str | None = None  # the same as the sentence shown (RequestInfo.waiting_reason)
    num_preemptions: int = 0
    output_text: str = ""
    stop_reason: str | int | None = None
    generator: object | None = None  # torch.Generator for seeded sampling
    matcher: object | None = None  # structured output: the grammar state (engine/structured.Matcher)
    token_marks: deque = field(default_factory=lambda: deque(maxlen=2048))
    history: deque = field(default_factory=lambda: deque(maxlen=512))
    token_times: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)  # rates.itl(token_times), kept by rates.itl_extend
    # speculative decoding
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    request_class: str = "default"
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify next step
    detok_offset: int = 0  # output tokens decoded once into detok_prefix (engine/core/detokenizer.py)
    detok_prefix: str = ""
    origin: str = "engine"  # who submitted it: "engine" (Python API), "app", "http"
    logprobs: list = field(default_factory=list)  # per output token (logprob, ((id, logprob), ...)) if asked

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def in_decode(self) -> bool:
        """The one rule for "this request decodes next": every token but the newest is computed and
        the newest is an output token. A prompt's last token alone (a final 1-token chunk, or the
        token a full prefix hit recomputes) is prefill; so is a recompute after preemption until
        it reaches the newest token."""
        return self.num_computed_tokens == self.num_tokens - 1 and self.num_output_tokens > 0

    @property
    def is_finished(self) -> bool:
        return self.status.is_terminal

    def add_history(self, step: int, t: float, num_blocks: int, bytes_per_token: int, phase: str) -> None:
        self.history.append(
            HistoryPoint(
                step, t, self.num_computed_tokens, num_blocks, self.num_computed_tokens * bytes_per_token, phase
            )
        )

    def mark(
        self,
        token_id: int,
        text: str,
        kind: str,
        step: int,
        rejected_id=None,
        rejected_text=None,
        p=None,
        q=None,
        u=None,
    ) -> None:
        self.token_marks.append(TokenMark(token_id, text, kind, step, rejected_id, rejected_text, p, q, u))
