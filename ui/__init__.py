"""Plotly figure builders and Streamlit widgets: pure functions of engine Snapshots/Events."""
