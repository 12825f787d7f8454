"""What AppTests read off a run, in one place: the page's HTML, metrics, Plotly specs, buttons,
and the shared engine. The fixtures are in tests/app/conftest.py."""

from __future__ import annotations

import json

TIMEOUT = 600  # an AppTest run's hang guard on 2 busy cores, not a speed assertion


def no_exception(at) -> None:
    assert not at.exception, [e.value for e in at.exception]


def run_ok(at):
    """Run `at` and check that the run raised nothing; returns `at`."""
    at.run()
    no_exception(at)
    return at


def html(at) -> str:
    """Every st.html / markdown-HTML body of the run, one per line."""
    return "\n".join(h.proto.body for h in at.get("html"))


def metrics(at) -> dict[str, list[str]]:
    """Metric values by label, in page order (a label can repeat: one per column)."""
    out: dict[str, list[str]] = {}
    for m in at.metric:
        out.setdefault(m.label, []).append(m.value)
    return out


def metric(at, label: str) -> str:
    """The value of the first metric labelled `label`."""
    for m in at.metric:
        if m.label == label:
            return m.value
    raise AssertionError(f"no metric {label!r}: {[m.label for m in at.metric]}")


def plotly_specs(at) -> list[dict]:
    """The Plotly figures the run drew in the main area, as JSON specs, in page order."""
    return [json.loads(el.proto.spec) for el in at.main.get("plotly_chart")]


def button(at, label: str):
    for b in at.button:
        if b.label == label:
            return b
    raise AssertionError(f"no button {label!r}: {[b.label for b in at.button]}")


def submit_form(at, form: str, label: str):
    """Click form `form`'s submit button `label` and run; checks the run raised nothing."""
    at.button(key=f"FormSubmitter:{form}-{label}").click()
    return run_ok(at)


def engine():
    """The shared EngineThread the app's pages draw."""
    from ui.widgets import engine_access as ea

    return ea.get_engine()


def crash_next_step(th, message: str) -> None:
    """Make the shared engine's next step raise `message`, in-thread or in a core process."""
    if hasattr(th, "call"):  # EngineClient: the core process's own test hook
        th.call("crash_next_step", message=message)
        return

    def boom():
        raise RuntimeError(message)

    th.engine.step = boom
