"""Proves the browser-test infrastructure on a throwaway app (fixtures_app/demo_app.py):
pixel-identical shots across server restarts, the click wait, direct page URLs on a fresh
server, the exception check, and that a one-unit colour change is caught."""

import io
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.browser.shot import (
    assert_no_exception,
    assert_screenshot,
    choose_option,
    click_and_wait,
    diff_pixels,
    main_text,
    new_context,
    open_page,
    page_has_no_exception,
    rerun_after,
    take_screenshot,
)

DEMO = Path(__file__).parent / "fixtures_app" / "demo_app.py"


def test_diff_pixels_counts_one_unit_changes():
    a = Image.new("RGB", (4, 3), (10, 20, 30))
    b = a.copy()
    assert diff_pixels(a, b)[0] == 0
    b.putpixel((1, 1), (10, 20, 31))
    b.putpixel((3, 2), (11, 20, 30))
    count, diff = diff_pixels(a, b)
    assert count == 2 and diff.getpixel((1, 1)) == (255, 0, 255)
    assert diff_pixels(a, Image.new("RGB", (4, 4)))[0] == -1


@settings(max_examples=300, deadline=None)
@given(
    colour=st.tuples(*[st.integers(0, 255)] * 3),
    x=st.integers(0, 4),
    y=st.integers(0, 3),
    channel=st.integers(0, 2),
    up=st.booleans(),
)
def test_diff_pixels_catches_any_one_unit_change_anywhere(colour, x, y, channel, up):
    a = Image.new("RGB", (5, 4), colour)
    changed = list(colour)
    changed[channel] += 1 if (up and colour[channel] < 255) or colour[channel] == 0 else -1
    b = a.copy()
    b.putpixel((x, y), tuple(changed))
    count, diff = diff_pixels(a, b)
    assert count == 1 and diff.getpixel((x, y)) == (255, 0, 255)
    assert diff_pixels(b, a)[0] == 1


@pytest.mark.browser
def test_shots_identical_across_fresh_servers(fresh_server, browser):
    shots = []
    for _ in range(2):
        server = fresh_server(DEMO)
        ctx = new_context(browser)
        try:
            page = ctx.new_page()
            open_page(page, server.url, "/")
            assert page.locator(".js-plotly-plot .main-svg").count() >= 1
            assert "Not clicked yet" in main_text(page)
            assert_screenshot(page, "infra_demo")
            shots.append(Image.open(io.BytesIO(take_screenshot(page))))
        finally:
            ctx.close()
        server.stop()
    count, _ = diff_pixels(shots[0], shots[1])
    assert count == 0, f"{count} pixels differ between two fresh server starts"


@pytest.mark.browser
def test_click_and_wait_sees_the_rerun(streamlit_server, page):
    server = streamlit_server(DEMO)
    open_page(page, server.url, "/")
    main = page.locator('[data-testid="stMain"]')
    button = page.get_by_role("button", name="Click me")
    for n in (1, 2):
        click_and_wait(page, button)
        # read immediately, no auto-waiting assertion: the wait itself must be enough
        assert f"Clicked {n} times" in main.inner_text()
    assert_screenshot(page, "infra_demo_clicked_twice")


@pytest.mark.browser
def test_choose_option_and_typing_wait_for_the_rerun(streamlit_server, page):
    server = streamlit_server(DEMO)
    open_page(page, server.url, "/")
    main = page.locator('[data-testid="stMain"]')
    choose_option(page, "Colour", "blue")
    assert "Colour: blue; name: (none)" in main.inner_text()
    box = page.get_by_label("Name")
    box.fill("Ada <b>")
    rerun_after(page, lambda: box.press("Enter"), what="pressing Enter in Name")
    assert "Colour: blue; name: Ada <b>" in main.inner_text()


@pytest.mark.browser
def test_direct_page_url_on_fresh_server(fresh_server, page):
    server = fresh_server(DEMO)
    open_page(page, server.url, "second")  # the first request this server sees
    assert page.locator("h1").first.inner_text() == "Second page"


@pytest.mark.browser
def test_unknown_page_url_fails(streamlit_server, page):
    server = streamlit_server(DEMO)
    with pytest.raises(AssertionError, match="Page not found"):
        open_page(page, server.url, "no-such-page")


@pytest.mark.browser
def test_exception_is_detected(streamlit_server, page):
    server = streamlit_server(DEMO)
    open_page(page, server.url, "second")
    assert page_has_no_exception(page)
    with pytest.raises(AssertionError, match="demo failure"):
        open_page(page, server.url, "boom")
    assert not page_has_no_exception(page)
    with pytest.raises(AssertionError):
        assert_no_exception(page)


@pytest.mark.browser
def test_one_unit_colour_change_is_caught(streamlit_server, page, tmp_path, monkeypatch):
    monkeypatch.delenv("KVSCOPE_UPDATE_SCREENSHOTS", raising=False)  # compare even when updating
    baseline = Path(__file__).parents[1] / "screenshots" / "infra_demo.png"
    if not baseline.exists():
        pytest.skip("baseline infra_demo.png not written yet (test_shots_identical... writes it)")
    img = Image.open(baseline).convert("RGB")
    r, g, b = img.getpixel((5, 5))
    img.putpixel((5, 5), (r, g, b - 1 if b else 1))
    img.save(tmp_path / "infra_demo.png")
    server = streamlit_server(DEMO)
    open_page(page, server.url, "/")
    with pytest.raises(AssertionError, match=r"infra_demo'?: 1 pixels differ"):
        assert_screenshot(page, "infra_demo", baseline_dir=tmp_path)
    assert (Path(__file__).parents[1] / "screenshots" / "_out" / "infra_demo.diff.png").exists()
