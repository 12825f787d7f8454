"""The benchmark suites, one module each (throughput, roofline, memory, prefix, speculative, cache,
threads). Each takes a BenchContext and returns a SuiteResult (JSON fields, table rows, figures);
a suite that needs a missing engine feature raises BenchUnavailable."""

from __future__ import annotations

from .cache import suite_cache
from .common import SuiteResult, _spread  # noqa: F401  (tests and callers use S.*)
from .kvquant import suite_kvquant
from .memory import suite_memory
from .prefix import suite_prefix
from .roofline import suite_roofline
from .speculative import suite_speculative, theory_tokens_per_pass  # noqa: F401
from .threads import suite_threads
from .throughput import suite_throughput

SUITE_FUNCS = {
    "throughput": suite_throughput,
    "roofline": suite_roofline,
    "memory": suite_memory,
    "prefix": suite_prefix,
    "speculative": suite_speculative,
    "cache": suite_cache,
    "threads": suite_threads,
    "kvquant": suite_kvquant,
}
