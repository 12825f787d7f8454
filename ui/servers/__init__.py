"""The app's links to HTTP servers: attach.py reads another kvscope or vLLM server, api_door.py
serves this app's engine as the OpenAI API. No Streamlit (tests/ui/test_import_rules.py)."""
