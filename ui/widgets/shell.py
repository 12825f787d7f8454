"""The app shell every page runs inside: st.navigation in app.py, page files in pages/.

Streamlit 1.67 treats a `pages/` folder next to the main script as the classic multipage app
until the script has called st.navigation once in this process: the first run of a fresh server
(and every AppTest run) executes a requested page file alone, without app.py (no shared sidebar,
Streamlit's automatic page list). `enter_app()`, the first call of every page file, notices that
run and executes app.py in its place, which draws the sidebar and runs the page through
st.navigation; the outer run then stops. Measured in docs/DESIGN.md ("Pages and direct URLs").
"""

from __future__ import annotations

import runpy
from pathlib import Path

import streamlit as st

APP = Path(__file__).resolve().parents[2] / "app.py"


def enter_app() -> None:
    """Call first in every page file: runs app.py instead when Streamlit ran this page alone."""
    from streamlit.runtime.pages_manager import PagesManager

    if PagesManager.uses_pages_directory:  # classic mode: st.navigation has not run yet
        runpy.run_path(str(APP), run_name="__main__")  # its st.navigation leaves classic mode
        st.stop()
