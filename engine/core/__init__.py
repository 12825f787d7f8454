"""The step loop and the state it owns: LLMEngine (schedule -> execute -> update from output), the
Scheduler, the BlockManager (the only writer of block tables), requests and their sequence states,
sampling, stops, structured output, detokenization, input rules and outputs; LLM and EngineThread
on top. Imports engine.config, engine.model, engine.observe and engine.speculative; never
engine.lab, engine.serve or engine.bench."""
