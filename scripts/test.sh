#!/usr/bin/env bash
# Runs kvscope's whole test suite from a fresh clone: sets up .venv (scripts/setup.sh), lints
# (ruff check and ruff format --check over the whole tree, configured in pyproject.toml; either
# failing fails the run before any test starts), installs Debian's chromium for the browser
# screenshot tests when it is missing, pins the environment (offline, tiny model for test
# servers) and runs pytest. Extra arguments go to pytest, e.g.
#   bash scripts/test.sh -m "not browser"      bash scripts/test.sh tests/browser -x
# Exit status is 1 when lint fails, else pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh

lint_ok=1
.venv/bin/ruff check . || lint_ok=0
.venv/bin/ruff format --check . || lint_ok=0
if [ "$lint_ok" = 0 ]; then
  echo "test.sh: lint failed (fix, or '.venv/bin/ruff check --fix .' / '.venv/bin/ruff format .')" >&2
  exit 1
fi

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
