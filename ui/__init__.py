"""The app's side of kvscope: `figures/` builds Plotly figures and HTML as pure functions of engine
Snapshots, Events and records (no Streamlit); `widgets/` is everything that draws with Streamlit;
`servers/` links the app to HTTP servers (attaching to one, serving the API beside the app).
tests/ui/test_import_rules.py holds the rules."""
