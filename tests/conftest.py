"""Root conftest: fixtures every test may use. Keep it small; area-specific fixtures belong in
that area's conftest (browser ones: tests/browser/conftest.py).

Layout: one comment block per fixture saying what it gives and its scope; add new ones below
the last block, in the same form.
"""

import os
from pathlib import Path

import pytest

# Tests never touch the network, whether run via scripts/test.sh or plain `pytest`.
for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_k, _v)

REPO_ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# repo_root (session): absolute Path of the repository checkout, for reading assets/, traces,
# app.py, etc. independent of the working directory pytest was started from.
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT
