"""`python -m engine bench SUITE [--quick] [--json]`: kvscope and its peers on the same workload in
the same process run, with the machine's measured physical limits beside them.

Importing this package does not import torch; the suites import what they need when they run.
Top layer with engine.lab and engine.fleet.

May import: engine, engine.config, engine.observe, engine.model, engine.speculative, engine.core,
engine.serve, engine.lab, engine.fleet.
(tests/engine/test_import_graph.py)
"""

from engine.bench.cli import SUITES, main

__all__ = ["SUITES", "main"]
