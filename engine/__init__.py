"""kvscope's inference engine: paged KV cache, continuous batching, prefix caching, preemption,
speculative decoding, over Hugging Face transformers models. Imports neither streamlit nor plotly."""

from .config import EngineConfig, SamplingParams, SpeculativeConfig, TierConfig

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
        from . import outputs

        return getattr(outputs, name)
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name == "LLMEngine":
        from .engine import LLMEngine

        return LLMEngine
    if name == "EngineThread":
        from .thread import EngineThread

        return EngineThread
    raise AttributeError(name)
