#!/usr/bin/env bash
# Sets everything up (first run: a virtualenv with pinned packages and the embedded model) and
# starts the kvscope app on the embedded default model (SmolLM2-135M-Instruct) AND its
# OpenAI-compatible API on the same engine (app_api.py: an st.App whose lifespan opens the API).
# Open the printed URL (default http://localhost:8501); point OpenAI clients, curl or a load
# generator at http://127.0.0.1:8000/v1 (KVSCOPE_API_PORT; "off" for the app alone). Stop with Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PORT=${PORT:-8501}
export KVSCOPE_API_PORT=${KVSCOPE_API_PORT:-8000}
echo "kvscope: app on http://localhost:${PORT} (model: ${KVSCOPE_MODEL:-default})"
if [ "$KVSCOPE_API_PORT" != "off" ]; then
  echo "kvscope: OpenAI-compatible API on http://${KVSCOPE_API_HOST:-127.0.0.1}:${KVSCOPE_API_PORT}/v1" \
       "(same engine; up once the model has loaded)"
fi
exec .venv/bin/python -m streamlit run app_api.py --server.headless true --server.port "$PORT" \
  --browser.gatherUsageStats false --server.fileWatcherType none --client.toolbarMode minimal "$@"
