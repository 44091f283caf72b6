"""The house limits that keep `trainer/` readable (docs/extending.md): no module over 500 lines, no
function over 80, no class over 150; and no import cycle between trainer's modules."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT

LIMITS = {"module": 500, "function": 80, "class": 150}


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


def imports(root: Path) -> dict[str, set[str]]:
    """trainer's modules -> the trainer modules they import at module level (imports inside functions
    are deferred on purpose and cannot cycle at import time)."""
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        deps = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainer"):
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("trainer")}
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of module-level imports, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(mod: str) -> list[str] | None:
        state[mod] = 1
        stack.append(mod)
        for dep in sorted(graph.get(mod, ())):
            # a package's __init__ importing its own submodules is not a cycle through them
            if dep not in graph or dep.startswith(mod + "."):
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
