"""kvscope's inference engine: paged KV cache, continuous batching, prefix caching, preemption,
speculative decoding, over Hugging Face transformers models. Imports neither streamlit nor plotly."""

from engine.config import EngineConfig, SamplingParams, SpeculativeConfig, TierConfig
from engine.model import kernel_isa

kernel_isa.limit_runtime()  # KVSCOPE_ISA=avx2: torch's own kernels as on an AVX2-only CPU, before any op

__all__ = [
    "EngineConfig",
    "SamplingParams",
    "SpeculativeConfig",
    "TierConfig",
    "LLM",
    "LLMEngine",
    "EngineThread",
    "RequestOutput",
]


def __getattr__(name):  # lazy: importing engine.config must not import torch
    if name in ("RequestOutput", "CompletionOutput", "RequestMetrics"):
        from engine.core import outputs

        return getattr(outputs, name)
    if name == "LLM":
        from engine.core.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.core.engine import LLMEngine

        return LLMEngine
    if name == "EngineThread":
        from engine.core.thread import EngineThread

        return EngineThread
    raise AttributeError(name)
