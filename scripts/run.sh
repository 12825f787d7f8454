#!/usr/bin/env bash
# Sets everything up (first run: a virtualenv with pinned packages and the embedded model) and
# starts the kvscope app on the embedded default model (SmolLM2-135M-Instruct) AND its
# OpenAI-compatible API on the same engine (app_api.py: an st.App whose lifespan opens the API).
# The engine core runs in a process of its own (KVSCOPE_ENGINE_PROCESS=0: a thread of the app).
# Open the printed URL (default http://127.0.0.1:8501, this machine only; KVSCOPE_SHARE=1 or
# --share serves a room and prints the URL to share); point OpenAI clients, curl or a load
# generator at http://127.0.0.1:8000/v1 (KVSCOPE_API_PORT; "off" for the app alone). Stop with Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PORT=${PORT:-8501}
# This machine only, unless sharing with a room is asked for: KVSCOPE_SHARE=1 or --share.
if [[ "${1:-}" == "--share" ]]; then export KVSCOPE_SHARE=1; shift; fi
ADDR=127.0.0.1
if [[ -n "${KVSCOPE_SHARE:-}" && "${KVSCOPE_SHARE}" != "0" ]]; then
  export KVSCOPE_SHARE=1
  ADDR=0.0.0.0
  HOST_IP=$(hostname -I 2>/dev/null | awk '{print $1}')
  echo "kvscope: SHARED with the room on every interface; share http://${HOST_IP:-<this-machine>}:${PORT}"
  [[ -n "${KVSCOPE_OPERATOR_TOKEN:-}" ]] && echo "kvscope: engine-wide changes need the operator token (sidebar)"
else
  echo "kvscope: app on http://127.0.0.1:${PORT} (this machine only; KVSCOPE_SHARE=1 to share)"
fi
echo "kvscope: model ${KVSCOPE_MODEL:-default}"
if [[ "${KVSCOPE_ENGINE_PROCESS:-1}" =~ ^(0|false|no)$ ]]; then
  echo "kvscope: engine in a thread of the app's process (KVSCOPE_ENGINE_PROCESS=${KVSCOPE_ENGINE_PROCESS})"
else
  echo "kvscope: engine core in its own process (pinned where allowed; Home shows where each runs;" \
       "KVSCOPE_ENGINE_PROCESS=0 for the in-thread engine)"
fi
export KVSCOPE_API_PORT=${KVSCOPE_API_PORT:-8000}
if [ "$KVSCOPE_API_PORT" != "off" ]; then
  echo "kvscope: OpenAI-compatible API on http://${KVSCOPE_API_HOST:-127.0.0.1}:${KVSCOPE_API_PORT}/v1" \
       "(same engine; up once the model has loaded)"
fi
exec .venv/bin/python -m streamlit run app_api.py --server.headless true --server.port "$PORT" \
  --server.address "$ADDR" --browser.gatherUsageStats false --server.fileWatcherType none \
  --client.toolbarMode minimal --runner.postScriptGC false --global.minCachedMessageSize 1e18 "$@"
