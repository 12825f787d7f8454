"""A fleet of kvscope (or vLLM) servers behind vLLM's router: launcher, collector, workload, what-if.
Top layer with engine.lab and engine.bench.

May import: engine.config, engine.observe, engine.lab, engine.bench, engine.serve.
(tests/engine/test_import_graph.py)"""
