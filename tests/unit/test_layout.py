"""The house limits that keep `trainer/` readable (docs/design.md): no module over 450 lines, no
function over 80, no class over 150, no module at trainer's root but `__init__.py` and `engine.py`; and
no import cycle between trainer's modules nor between its rooms (a package of trainer/, or a root
module, counted as one), however the import is written (at module level or inside a function,
`import a.b`, `from a import b`, relative)."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT

LIMITS = {"module": 450, "function": 80, "class": 150}
ROOT_MODULES = {"__init__.py", "engine.py"}  # the rest of trainer/ lives in rooms (docs/design.md)


def sizes(root: Path) -> list[tuple[str, int, str]]:
    """(kind, lines, where) of every module, function and class under `root`."""
    out = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(ROOT).as_posix()
        out.append(("module", len(text.splitlines()), where))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                out.append((kind, node.end_lineno - node.lineno + 1, f"{where}:{node.lineno} {node.name}"))
    return out


def test_modules_functions_and_classes_stay_within_the_house_limits():
    over = [f"{kind} {where}: {n} lines (limit {LIMITS[kind]})" for kind, n, where in sizes(ROOT / "trainer")
            if n > LIMITS[kind]]  # fmt: skip
    assert not over, "\n".join(over)


def test_the_root_keeps_only_the_engine():
    loose = sorted(p.name for p in (ROOT / "trainer").glob("*.py") if p.name not in ROOT_MODULES)
    assert not loose, f"modules at trainer/'s root (a room of trainer/ takes each): {loose}"


def _module(path: Path, top: Path) -> str:
    return ".".join(path.relative_to(top.parent).with_suffix("").parts).removesuffix(".__init__")


def _ancestors(mod: str) -> list[str]:
    """The packages above `mod`: a.b.c -> [a, a.b]."""
    parts = mod.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _targets(node: ast.Import | ast.ImportFrom, mod: str, is_package: bool, known: set[str]) -> list[str]:
    """The modules an import statement names: `import a.b` -> a.b; `from a import b` -> a.b where that
    is a module, else a (b is a name a's module defines); relative forms resolved against `mod`."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        package = (mod if is_package else mod.rpartition(".")[0]).split(".")
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def imports(top: Path) -> dict[str, set[str]]:
    """The package at `top`'s modules -> the modules of it they import. Every import statement counts,
    wherever it is (a function-level import runs later, but a circle is a circle however it is written),
    with the packages each import runs on the way: importing a.b.c runs a/__init__.py and
    a/b/__init__.py first, except the importer's own packages, which run before it does. A package's
    __init__ importing its own submodules counts like any import, so a submodule that imports names
    from its own package's __init__ (`from trainer.config import X` inside trainer/config/) closes a
    circle: it imports them from the sibling module that defines them."""
    paths = {_module(p, top): p for p in top.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in paths.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in _targets(node, mod, path.name == "__init__.py", set(paths)):
                if target.split(".")[0] == top.name:
                    deps |= {target, *(set(_ancestors(target)) - set(_ancestors(mod)) - {top.name})}
        graph[mod] = deps - {mod}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of imports, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(mod: str) -> list[str] | None:
        state[mod] = 1
        stack.append(mod)
        for dep in sorted(graph.get(mod, ())):
            if dep not in graph:
                continue
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[mod] = 2
        return None

    for mod in sorted(graph):
        if mod not in state and (cycle := visit(mod)):
            return cycle
    return None


def test_no_import_cycles():
    cycle = find_cycle(imports(ROOT / "trainer"))
    assert cycle is None, " -> ".join(cycle)
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check can fail


def rooms(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph with each room as one node: trainer.X.Y... -> trainer.X (a package of trainer/ or
    a root module); the imports inside a room are left out."""

    def room(mod: str) -> str:
        return ".".join(mod.split(".")[:2])

    out: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        out.setdefault(room(mod), set()).update(room(d) for d in deps if room(d) != room(mod))
    return out


def test_rooms_import_downward_only():
    cycle = find_cycle(rooms(imports(ROOT / "trainer")))
    assert cycle is None, "rooms in a circle: " + " -> ".join(cycle)


def test_a_circle_between_rooms_is_found_where_the_modules_have_none(tmp_path):
    """run/a imports low/b, low/c imports run/d: no circle of modules, a circle of rooms."""
    top = tmp_path / "pkg"
    files = {"run/a.py": "from pkg.low import b\n", "low/b.py": "", "low/c.py": "from pkg.run import d\n",
             "run/d.py": "", "run/__init__.py": "", "low/__init__.py": "", "__init__.py": ""}  # fmt: skip
    for rel, text in files.items():
        (top / rel).parent.mkdir(parents=True, exist_ok=True)
        (top / rel).write_text(text)
    graph = imports(top)
    assert find_cycle(graph) is None
    assert find_cycle(rooms(graph)) in (["pkg.low", "pkg.run", "pkg.low"], ["pkg.run", "pkg.low", "pkg.run"])


HIDDEN = {  # circles the old module-level count missed, one per way of writing them
    "function-level": {"a.py": "def f():\n    from pkg.b import g\n", "b.py": "from pkg.a import f\n"},
    "import a.b": {"a.py": "import pkg.b\n", "b.py": "def g():\n    import pkg.a\n"},
    "relative": {"a.py": "from . import b\n", "b.py": "def g():\n    from .a import f\n"},
    "own package": {"sub/__init__.py": "from pkg.sub.a import f\n", "sub/a.py": "from pkg.sub import g\n"},
    "through a package": {"sub/__init__.py": "from pkg.sub.c import h\n", "sub/c.py": "from pkg.a import f\n",
                          "a.py": "def f():\n    from pkg.sub.d import k\n", "sub/d.py": ""},
}  # fmt: skip


def test_every_way_of_writing_an_import_circle_is_found(tmp_path):
    for name, files in HIDDEN.items():
        top = tmp_path / name.replace(" ", "_") / "pkg"
        for rel, text in {"__init__.py": "", **files}.items():
            (top / rel).parent.mkdir(parents=True, exist_ok=True)
            (top / rel).write_text(text)
        assert find_cycle(imports(top)) is not None, name
    assert find_cycle(imports(tmp_path / "function-level" / "pkg")) == ["pkg.a", "pkg.b", "pkg.a"]
