"""The step loop and the state it owns: LLMEngine (schedule -> execute -> update from output), the
Scheduler, the BlockManager (the only writer of block tables), requests and their sequence states,
sampling, stops, structured output, detokenization, input rules and outputs; LLM and EngineThread
on top.

May import: engine.config, engine.observe, engine.model, engine.speculative.
(never engine.serve, engine.lab, engine.bench or engine.fleet: tests/engine/test_import_graph.py)"""
