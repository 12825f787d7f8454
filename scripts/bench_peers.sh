#!/usr/bin/env bash
# Installs the optional benchmark peers into their own virtual environment (never the project's,
# never by the tests): llama.cpp through llama-cpp-python, which builds llama.cpp from source
# (several minutes to an hour on 2 cores). `bench roofline` then measures llama.cpp's
# single-stream decode of the same GGUF in the same run (llamacpp_decode_bs1_tok_s).
#   KVSCOPE_PEERS_VENV   where (default: $KVSCOPE_CACHE_DIR or ~/.cache/kvscope, then /peers-venv)
set -euo pipefail
PIN="llama-cpp-python==0.3.36"
VENV="${KVSCOPE_PEERS_VENV:-${KVSCOPE_CACHE_DIR:-$HOME/.cache/kvscope}/peers-venv}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
  echo "llama.cpp peer already in $VENV ($("$VENV/bin/python" -c 'import llama_cpp; print(llama_cpp.__version__)'))"
  exit 0
fi
python3 -m venv "$VENV"
# GGML_NATIVE: built for this CPU (AVX2/FMA/F16C where present), as kvscope's kernels are
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" nice "$VENV/bin/pip" install -q "$PIN"
"$VENV/bin/python" -c "import llama_cpp; print('llama.cpp peer installed in $VENV:', llama_cpp.__version__)"
