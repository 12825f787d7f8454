"""Speculative decoding: drafters (n-gram prompt lookup, a draft model, early-exit self-draft),
verification (greedy; rejection sampling that keeps the target distribution), the per-class
monitor that falls back to plain decoding when speculation does not pay, and E(alpha, k).

    math.py      expected_tokens_per_pass (E(alpha, k)), break_even_alpha
    verify.py    verify_greedy, verify_sampling, Verdict (each emitted token's mark, with p / q / u)
    drafters.py  ngram_propose, ModelDrafter, SpecContext, draft ids ("<rid>#draft")
    monitor.py   CostModel, ClassState
    decoder.py   SpecDecoder (the hooks LLMEngine.step calls)

The plain-vs-speculative speedup lives in engine/lab/experiments.py (compare_speculative).
engine.core.engine calls these hooks; a draft model runs on its own Scheduler and BlockManager, so
this package uses those two and the sampler from the step loop, never the engine itself.

May import: engine.config, engine.observe, engine.model, engine.core.sampler, engine.core.scheduler,
engine.core.block_manager.
(tests/engine/test_import_graph.py)
"""

from engine.speculative.decoder import SpecDecoder
from engine.speculative.drafters import DRAFT_SUFFIX, ModelDrafter, SpecContext, draft_id, ngram_propose
from engine.speculative.math import break_even_alpha, expected_tokens_per_pass
from engine.speculative.monitor import ClassState, CostModel
from engine.speculative.verify import Verdict, verify_greedy, verify_sampling

__all__ = [
    "DRAFT_SUFFIX",
    "ClassState",
    "CostModel",
    "ModelDrafter",
    "SpecContext",
    "SpecDecoder",
    "Verdict",
    "break_even_alpha",
    "draft_id",
    "expected_tokens_per_pass",
    "ngram_propose",
    "verify_greedy",
    "verify_sampling",
]
