"""AppTest runs share these fixtures. Reading helpers (html, metrics, specs, wait) live in
tests/app/helpers.py.

tiny_test_mode (module): test mode on the tiny model for one module. A module that needs more
environment hands it in by indirect parametrization:

    pytestmark = pytest.mark.parametrize("tiny_test_mode", [{"KVSCOPE_RESULTS_DIR": "..."}],
                                         indirect=True, ids=["bench-fixture"])

The shared engine (st.cache_resource lives in the test process, as a server's does) is shut down
and forgotten before the module and after it, so every module builds its own from its own
settings; within a module the tests share it, as browser sessions do.

app_test (function): factory app_test(script="app.py", *, page=None, state=None) -> AppTest, not
yet run, in tiny_test_mode. `script` is a path from the repo root (a page file runs through
app.py, ui/widgets/shell.py); `page` is switched to, `state` is put in session_state first.
"""

from __future__ import annotations

import os

import pytest

from tests.app.helpers import TIMEOUT
from tests.conftest import REPO_ROOT

# AppTests run the pages in this process and read the engine's internals: the in-thread engine
# (tests/app/test_engine_process_app.py runs the app's default, the core in its own process)
TEST_MODE_ENV = {"KVSCOPE_TEST_MODE": "1", "KVSCOPE_MODEL": "tiny", "KVSCOPE_ENGINE_PROCESS": "0"}


def _forget_shared_engine() -> None:
    from ui.widgets import engine_access as ea

    holder = ea.shared_engine()
    if holder.thread is not None:
        holder.thread.shutdown()
    ea.shared_engine.clear()


@pytest.fixture(scope="module")
def tiny_test_mode(request):
    env = {**TEST_MODE_ENV, **getattr(request, "param", {})}
    old = {k: os.environ.get(k) for k in env}
    _forget_shared_engine()  # one a module outside this fixture left behind
    os.environ.update(env)
    yield env
    _forget_shared_engine()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def app_test(tiny_test_mode):
    from streamlit.testing.v1 import AppTest

    def make(script: str = "app.py", *, page: str | None = None, state: dict | None = None) -> AppTest:
        at = AppTest.from_file(str(REPO_ROOT / script), default_timeout=TIMEOUT)
        if page is not None:
            at.switch_page(page)
        for k, v in (state or {}).items():
            at.session_state[k] = v
        return at

    return make
