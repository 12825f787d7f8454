"""`python -m engine bench SUITE [--quick] [--json]`: kvscope and its peers on the same workload in
the same process run, with the machine's measured physical limits beside them.

Importing this package does not import torch; the suites import what they need when they run.
"""

from engine.bench.cli import SUITES, main

__all__ = ["SUITES", "main"]
