"""LLM: vLLM's offline entry point, LLM(model=..., **EngineConfig fields).generate(prompts, params),
over one LLMEngine."""

from __future__ import annotations

import itertools

from engine.config import EngineConfig, SamplingParams
from engine.core.engine import LLMEngine
from engine.core.inputs import prompt_ids
from engine.core.outputs import RequestOutput


class LLM:
    """vLLM-shaped offline entry point: LLM(model="default", **EngineConfig fields).generate(...)"""

    def __init__(self, model: str = "default", **config):
        self.engine = LLMEngine(EngineConfig(model=model, **config))
        self.tokenizer = self.engine.tokenizer
        self._n = itertools.count()

    def generate(
        self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = False
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple))
            and prompts
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts)
        ):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a string, a list of token ids, or a non-empty list of either")
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        # validate all before adding any
        for p in prompts:
            prompt_ids(self.engine.tokenizer, self.engine.vocab_size, p)
        ids = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.engine.add_request(f"gen-{next(self._n)}", p, sp))
        except ValueError:
            self.engine.abort_request(ids)
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            if not self.engine.has_unfinished_requests():
                break
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]
