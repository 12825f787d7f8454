"""No import cycle among engine/ modules: every `import` / `from ... import` in engine/**/*.py,
including those inside function bodies (a lazy import is still a dependency), forms a graph of
engine modules that must be acyclic."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "engine"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Engine modules that `path` imports (resolving relative imports; `from pkg import name`
    counts pkg.name when that is a module, else pkg)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # engine.x.y where y is a name: the module engine.x
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def engine_graph() -> dict[str, set[str]]:
    files = [p for p in ENGINE.rglob("*.py") if "csrc" not in p.parts]
    modules = {module_name(p) for p in files}
    graph = {module_name(p): imports_of(p, modules) for p in files}
    # importing a submodule runs its package's __init__ first: that is not an edge we draw, so
    # a package __init__ re-exporting its submodules is not a cycle with them
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_graph_sees_lazy_imports():
    g = engine_graph()
    assert "engine.core.engine" in g["engine.lab.experiments"]  # module level
    assert "engine.model.models" in g["engine.speculative.decoder"]  # inside a method body
    assert "engine.core.outputs" in g["engine"]  # inside __getattr__
    assert {"engine.speculative.decoder", "engine.core.scheduler", "engine.core.block_manager"} <= g[
        "engine.core.engine"
    ]


def test_no_import_cycle_among_engine_modules():
    cycle = find_cycle(engine_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_speculative_never_imports_back_up_into_the_engine():
    """engine/speculative is used by the engine (SpecDecoder's hooks): it must not import the
    engine or the experiments built on it (the spec-vs-plain speedup lives in experiments.py)."""
    g = engine_graph()
    spec = {m: deps for m, deps in g.items() if m == "engine.speculative" or m.startswith("engine.speculative.")}
    assert "engine.speculative.decoder" in spec
    for m, deps in spec.items():
        assert not deps & {"engine.core.engine", "engine.lab.experiments"}, (
            f"{m} imports {deps & {'engine.core.engine', 'engine.lab.experiments'}}"
        )


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
