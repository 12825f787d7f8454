"""The benchmark suites, one module each (throughput, roofline, memory, prefix, speculative, cache,
threads). Each takes a BenchContext and returns a SuiteResult (JSON fields, table rows, figures);
a suite that needs a missing engine feature raises BenchUnavailable."""

from __future__ import annotations

from engine.bench.cache import suite_cache
from engine.bench.common import SuiteResult, spread  # noqa: F401  (tests and callers use S.*)
from engine.bench.kvquant import suite_kvquant
from engine.bench.memory import suite_memory
from engine.bench.prefix import suite_prefix
from engine.bench.roofline import suite_roofline
from engine.bench.speculative import suite_speculative, theory_tokens_per_pass  # noqa: F401
from engine.bench.threads import suite_threads
from engine.bench.throughput import suite_throughput

__all__ = [  # what engine.bench.cli looks up by name (Suite.func_name)
    "suite_throughput",
    "suite_roofline",
    "suite_memory",
    "suite_prefix",
    "suite_speculative",
    "suite_cache",
    "suite_threads",
    "suite_kvquant",
]
