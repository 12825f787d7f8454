"""The experiments and measurements the pages run on top of the engine: comparisons on private
engines, the Claims page's rows and the bench results they read, A/B timing, agreement with
transformers, the side channels, the memory calculator's sums, workloads and prompt sets, the soak
and the GPU check (the as-you-type preview is engine.core.preview). lab, bench and fleet are the
top layer: they import each other and everything below them; nothing below imports them (the
pages and scripts do).

May import: engine, engine.config, engine.observe, engine.model, engine.speculative, engine.core,
engine.serve, engine.bench, engine.fleet.
(tests/engine/test_import_graph.py)"""
