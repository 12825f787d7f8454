#!/usr/bin/env bash
# Runs kvscope's whole test suite from a fresh clone: sets up .venv (scripts/setup.sh), installs
# Debian's chromium for the browser screenshot tests when it is missing, pins the environment
# (offline, tiny model for test servers) and runs pytest. Extra arguments go to pytest, e.g.
#   bash scripts/test.sh -m "not browser"      bash scripts/test.sh tests/browser -x
# Exit status is pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh

export KVSCOPE_CHROMIUM=${KVSCOPE_CHROMIUM:-/usr/bin/chromium}
if [ ! -x "$KVSCOPE_CHROMIUM" ]; then
  # The same command the screenshot baselines were made with: recommended packages (fonts among
  # them) change pixels, so no --no-install-recommends.
  if [ "$(id -u)" = 0 ]; then
    SUDO=()
  elif command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo)
  else
    echo "test.sh: $KVSCOPE_CHROMIUM is missing and I am neither root nor have sudo;" \
         "install it with 'apt-get install -y chromium' (or deselect: -m 'not browser')" >&2
    exit 1
  fi
  echo "test.sh: installing chromium (about a minute)" >&2
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONDONTWRITEBYTECODE=1 PYTHONHASHSEED=0

exec .venv/bin/python -m pytest "$@"
