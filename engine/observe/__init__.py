"""What the engine shows: immutable Snapshots, the engine's own trace events, metrics and the rate
definitions, vLLM's KV events (wire format, publisher, subscriber) and recording an engine's run.
Pure data and bookkeeping.

May import: engine.config.
(never the model, the step loop, pages or servers: tests/engine/test_import_graph.py)"""
