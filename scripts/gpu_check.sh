#!/usr/bin/env bash
# One command on a bare GPU machine: scripts/gpu_check.sh OUT_DIR
# Needs only this repository and a Python with torch (CUDA build) and transformers installed
# (no streamlit, plotly, gguf, model weights or tokenizer files: the models are random-weight
# models of real shapes built in code, fed token ids). Runs under 8 minutes; writes
# OUT_DIR/gpu_check.log and OUT_DIR/gpu_check.json and prints one line `GPU_CHECK_JSON {...}`.
# See engine/lab/gpu_check.py for what it measures. Extra arguments go to the module
# (e.g. --cpu-smoke to exercise it on a machine without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu_check_out}"
shift || true
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$PY" - <<'PYEOF'
import sys
import torch, transformers
print(f"python {sys.version.split()[0]} torch {torch.__version__} transformers {transformers.__version__} "
      f"cuda {torch.cuda.is_available()} {torch.cuda.get_device_name(0) if torch.cuda.is_available() else ''}")
PYEOF
# a hang guard for the GPU machine's short lease; KVSCOPE_GPU_CHECK_TIMEOUT=0 turns it off (tests)
LIMIT="${KVSCOPE_GPU_CHECK_TIMEOUT:-470}"
if [ "$LIMIT" = 0 ]; then
  exec "$PY" -m engine.lab.gpu_check "$OUT" "$@"
fi
exec timeout "$LIMIT" "$PY" -m engine.lab.gpu_check "$OUT" "$@"
