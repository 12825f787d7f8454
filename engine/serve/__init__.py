"""kvscope's OpenAI-compatible HTTP server (`python -m engine serve`), shaped as vLLM's answers.

One EngineThread serves every door: this server, the Streamlit app in the same process
(scripts/run.sh), the Python API. Modules: protocol (request bodies, extra fields forbidden),
errors (OpenAI-shaped error bodies, auth, body limit), metrics (/metrics with vLLM's names),
routes (the endpoints), app (create_app / run_in_background), cli (argument parsing), ports (free_port).
Imported on demand only: `import engine` does not pull in FastAPI.

May import: engine.config, engine.observe, engine.model, engine.core.
(never engine.lab, engine.bench or engine.fleet: tests/engine/test_import_graph.py)"""

from engine.serve.app import ServerState, create_app, run_in_background

__all__ = ["ServerState", "create_app", "run_in_background"]
