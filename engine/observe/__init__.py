"""What the engine shows: immutable Snapshots, the engine's own trace events, metrics and the rate
definitions, vLLM's KV events (wire format, publisher, subscriber) and recording an engine's run.
Pure data and bookkeeping: imports engine.config at most, never the step loop, pages or servers."""
