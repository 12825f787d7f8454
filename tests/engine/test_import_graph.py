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


# ---------------------------------------------------------------- the direction of imports

DOCSTRING_RULE = "May import:"


def allowed_imports(pkg_file: Path) -> set[str]:
    """The names after "May import:" in a package's (or config.py's) docstring, up to the first
    full stop; "nothing from engine" is the empty set."""
    doc = ast.get_docstring(ast.parse(pkg_file.read_text())) or ""
    assert DOCSTRING_RULE in doc, f"{pkg_file} does not say what it may import ({DOCSTRING_RULE!r})"
    rule = doc.split(DOCSTRING_RULE, 1)[1].split(".\n", 1)[0].split(". ", 1)[0]
    if "nothing" in rule:
        return set()
    return {x.strip().rstrip(".") for x in rule.replace("\n", " ").split(",") if x.strip()}


def layer_of(module: str) -> str | None:
    """engine.core.scheduler -> engine.core; engine.config -> engine.config; engine, engine.__main__
    (the entry points on top of everything) -> None."""
    parts = module.split(".")
    if module in ("engine", "engine.__main__"):
        return None
    return ".".join(parts[:2])


def rule_files() -> dict[str, Path]:
    out = {"engine.config": ENGINE / "config.py"}
    for init in sorted(ENGINE.glob("*/__init__.py")):
        out[f"engine.{init.parent.name}"] = init
    return out


def test_every_layer_says_what_it_may_import():
    rules = rule_files()
    assert set(rules) >= {
        "engine.config",
        "engine.core",
        "engine.model",
        "engine.observe",
        "engine.speculative",
        "engine.serve",
        "engine.lab",
        "engine.bench",
        "engine.fleet",
    }
    for layer, f in rules.items():
        allowed_imports(f)  # asserts the line is there


def test_imports_follow_each_package_docstring():
    """Every edge between two packages is one the importer's docstring allows (a package entry
    allows its modules; a module entry allows that module only)."""
    rules = {layer: allowed_imports(f) for layer, f in rule_files().items()}
    bad = []
    for m, deps in engine_graph().items():
        src = layer_of(m)
        if src is None:
            continue
        for d in deps:
            dst = layer_of(d)
            if dst == src or d == "engine.config" and src == "engine.config":
                continue
            if not any(d == a or d.startswith(a + ".") for a in rules[src]):
                bad.append(f"{m} -> {d}")
    assert not bad, "imports against the package docstrings:\n" + "\n".join(sorted(bad))


def test_the_direction_check_sees_a_wrong_edge():
    assert "engine.core" not in allowed_imports(ENGINE / "model" / "__init__.py")
    assert allowed_imports(ENGINE / "config.py") == set()
    assert layer_of("engine.core.scheduler") == "engine.core" and layer_of("engine") is None


# ---------------------------------------------------------------- no private name across modules

SOURCE_DIRS = ("engine", "ui", "pages", "tests", "scripts")


def private_imports(path: Path) -> list[str]:
    """`from x import _name` (x one of the project's modules, or relative) and `mod._name` where mod
    was bound by `import x as mod` / `from pkg import mod` of a project module."""
    tree = ast.parse(path.read_text(), str(path))
    ours = ("engine", "ui", "pages", "tests", "scripts", "app")
    module_aliases: set[str] = set()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if not (node.level or mod.split(".")[0] in ours):
                continue
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    out.append(f"{path}:{node.lineno} from {mod} import {a.name}")
                elif (ROOT / Path(*mod.split("."), a.name + ".py")).exists():
                    module_aliases.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in ours and a.asname:
                    module_aliases.add(a.asname)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in module_aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            out.append(f"{path}:{node.lineno} {node.value.id}.{node.attr}")
    return out


def test_no_private_name_is_imported_across_modules():
    bad = []
    for d in SOURCE_DIRS:
        for p in sorted((ROOT / d).rglob("*.py")):
            if "csrc" not in p.parts:
                bad += private_imports(p)
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


def test_the_private_name_check_sees_one(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("from engine.model import kv_layout as kl\nfrom engine.config import _check\nkl._secret\n")
    found = private_imports(f)
    assert len(found) == 2 and "import _check" in found[0] and "kl._secret" in found[1]


# ---------------------------------------------------------------- no private member of another object

# private names of other libraries' objects that the engine must touch (transformers' attention
# switch, torch's oneDNN ops, os._exit in a child process)
FOREIGN_PRIVATE = {"_attn_implementation", "_exit", "_reorder_linear_weight", "_linear_pointwise"}


def private_member_uses(path: Path) -> list[str]:
    """`obj._name` where obj is not self / cls: a call into (or a read of) another object's
    private member. Names in FOREIGN_PRIVATE are other libraries' and allowed."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and node.attr not in FOREIGN_PRIVATE
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            out.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{node.lineno} .{node.attr}")
    return out


def test_no_object_touches_another_objects_private_members():
    files = [p for d in ("engine", "ui", "pages") for p in sorted((ROOT / d).rglob("*.py"))]
    bad = []
    for p in files + [ROOT / "app.py", ROOT / "app_api.py"]:
        if "csrc" not in p.parts:
            bad += private_member_uses(p)
    assert not bad, "private members used from outside their object:\n" + "\n".join(bad)


def test_the_private_member_check_sees_one(tmp_path):
    f = tmp_path / "x.py"
    f.write_text(
        "class A:\n    def f(self, h):\n        self._ok()\n        h._push(1)\n        cfg._attn_implementation\n"
    )
    found = private_member_uses(f)
    assert len(found) == 1 and found[0].endswith(":4 ._push")


# ---------------------------------------------------------------- every imported name exists


def top_level_names(path: Path) -> set[str] | None:
    """Names a module binds at its top level (None if it star-imports: not checkable)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(a.name == "*" for a in node.names):
                return None
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def missing_imports(path: Path) -> list[str]:
    """`from engine... / ui... import name` (lazy ones too) where the module has no such name: a
    renamed function whose lazy caller was missed fails only when that code runs."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        if node.module.split(".")[0] not in ("engine", "ui"):
            continue
        base = ROOT / Path(*node.module.split("."))
        target = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if not target.exists():
            out.append(f"{path}:{node.lineno} no module {node.module}")
            continue
        names = top_level_names(target)
        for a in node.names:
            if names is not None and a.name not in names and not (base / f"{a.name}.py").exists():
                if not (base / a.name).is_dir():
                    out.append(f"{path}:{node.lineno} {node.module} has no {a.name}")
    return out


def test_every_imported_name_exists():
    bad = []
    for d in SOURCE_DIRS:
        for p in sorted((ROOT / d).rglob("*.py")):
            if "csrc" not in p.parts:
                bad += missing_imports(p)
    assert not bad, "imports of names that do not exist:\n" + "\n".join(bad)


def test_the_missing_name_check_sees_one(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from engine.core.placement import core_cpus_from_env\n")
    assert missing_imports(f) and "has no core_cpus_from_env" in missing_imports(f)[0]
