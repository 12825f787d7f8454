"""The layers' import rules (docs/DESIGN.md, "Shape"):

- ui/figures and ui/servers import no Streamlit, directly or through anything they import: every
  module of theirs is imported in a fresh interpreter, which must end without `streamlit` in
  sys.modules;
- ui/figures, the bottom layer of ui/, imports neither ui.widgets nor ui.servers (any import
  statement, lazy ones inside functions too);
- engine/ imports neither ui nor streamlit, and plotly only in engine/bench/report.py (the
  benchmark's PNG charts, imported inside the functions that draw them).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLOTLY_ALLOWED = {"engine/bench/report.py"}


def modules_under(folder: str) -> list[str]:
    return sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for p in (ROOT / folder).glob("*.py")
        if p.name != "__init__.py"
    )


def imported_names(path: Path) -> set[str]:
    """Every module name an import statement in `path` names (absolute imports; lazy ones too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_there_are_figures_widgets_and_servers():
    figures, widgets = modules_under("ui/figures"), modules_under("ui/widgets")
    assert "ui.figures.pool" in figures and "ui.widgets.engine_access" in widgets
    assert modules_under("ui/servers") == ["ui.servers.api_door", "ui.servers.attach", "ui.servers.fleet_session"]
    assert not list((ROOT / "ui").glob("[!_]*.py")), "every ui module is in figures/, widgets/ or servers/"


def test_figures_and_servers_never_load_streamlit():
    mods = modules_under("ui/figures") + modules_under("ui/servers")
    code = (
        "import importlib, json, sys\n"
        f"for m in {mods!r}:\n"
        "    importlib.import_module(m)\n"
        "print(json.dumps(sorted(k for k in sys.modules if k == 'streamlit' or k.startswith('streamlit.'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == [], f"importing ui/figures and ui/servers loaded {loaded[:5]}"


def test_figures_import_no_widgets_or_servers():
    for mod in modules_under("ui/figures"):
        path = ROOT / (mod.replace(".", "/") + ".py")
        bad = {
            n
            for n in imported_names(path)
            if n.split(".")[0] == "streamlit" or n.startswith(("ui.widgets", "ui.servers"))
        }
        assert not bad, f"{mod} imports {sorted(bad)}"


def test_engine_imports_no_ui_streamlit_or_plotly():
    for path in sorted((ROOT / "engine").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tops = {n.split(".")[0] for n in imported_names(path)}
        assert not tops & {"ui", "streamlit"}, f"{rel} imports {sorted(tops & {'ui', 'streamlit'})}"
        if rel not in PLOTLY_ALLOWED:
            assert "plotly" not in tops, f"{rel} imports plotly"


def test_the_rule_checker_sees_lazy_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    import streamlit as st\n    from ui.widgets import room\n")
    assert {"streamlit", "ui.widgets", "ui.widgets.room"} <= imported_names(f)
