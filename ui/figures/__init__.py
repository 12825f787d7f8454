"""Figure builders and data shaping: pure functions of an engine Snapshot, its Events or the
records engine/observe/recording.py makes, returning Plotly figures, HTML strings or plain rows.
Nothing here imports Streamlit, directly or through another module (tests/ui/test_import_rules.py)."""
