"""Throwaway Streamlit app that exercises the browser-test infrastructure (tests/browser/test_infra.py).

Two pages under st.navigation (so a direct page URL can be opened on a fresh server), a static
Plotly chart, a button whose click changes a text,
a selectbox and a text input. Nothing here is kvscope's real app.
"""

import plotly.graph_objects as go
import streamlit as st


def home():
    st.title("Infra demo")
    fig = go.Figure(go.Bar(x=["a", "b", "c", "d"], y=[3, 1, 4, 1], marker_color="#4c78a8"))
    fig.update_layout(
        height=300, width=600, margin=dict(l=40, r=20, t=30, b=30), title="Static bar chart", transition={"duration": 0}
    )
    st.plotly_chart(fig, width="content", config={"staticPlot": True, "displayModeBar": False, "responsive": False})
    clicks = st.session_state.setdefault("clicks", 0)
    if st.button("Click me", key="click_me"):
        st.session_state.clicks = clicks = clicks + 1
    st.markdown(f"Clicked **{clicks}** times" if clicks else "Not clicked yet")
    colour = st.selectbox("Colour", ["red", "green", "blue"], key="colour")
    name = st.text_input("Name", key="name")
    st.markdown(f"Colour: {colour}; name: {name or '(none)'}")


def second():
    st.title("Second page")
    st.write("Reached by its own URL.")


def boom():
    st.title("Boom page")
    raise ValueError("demo failure for the exception check")


st.navigation(
    [
        st.Page(home, title="Home", url_path="home", default=True),
        st.Page(second, title="Second", url_path="second"),
        st.Page(boom, title="Boom", url_path="boom"),
    ]
).run()
