"""`streamlit run app_api.py`: the kvscope app (app.py) AND its OpenAI-compatible API on the same
engine (what scripts/run.sh starts). An st.App whose lifespan builds the shared engine and opens
the API door (ui/servers/api_door.py, port KVSCOPE_API_PORT, default 8000) before any browser connects."""

from contextlib import asynccontextmanager

import streamlit as st

from ui.servers.api_door import DOOR
from ui.widgets import engine_access as ea


@asynccontextmanager
async def lifespan(_app):
    import asyncio

    await asyncio.to_thread(DOOR.start, ea.shared_engine())  # loading the model takes a while
    try:
        yield {}
    finally:
        DOOR.stop()


app = st.App("app.py", lifespan=lifespan)
