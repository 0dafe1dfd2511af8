"""The package's imports run one way (DESIGN.md, "Layout"): no import circle, no import against
the layers' direction. Every import counts, those inside functions too: a lazy import hides a
circle from Python, not from a reader."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ktransformers"

# A module may import modules of its own rank or below, never above. Entry points sit on top.
RANKS = {
    "environment": 0,
    "weights": 1, "cache": 1, "kernels": 1,
    "operators": 2,
    "optimize": 3,
    "loader": 4, "engine": 4, "upstream": 4,
    "server": 5, "local_chat": 5, "calibrate": 5, "cli": 5, "demo": 5, "bench": 5, "train": 5, "sft": 5,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports (a `from X import y` of a submodule y counts as X.y)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = resolve(name, path.name == "__init__.py", node)
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # (a name inside a module: the module)
                t = t.rpartition(".")[0]
            if t.startswith("ktransformers.") and t != name:
                found.add(t)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def layer_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_every_layer_has_a_rank():
    layers = {layer_of(m) for m in package_modules()} - {""}
    assert layers <= set(RANKS), f"top-level modules without a rank in RANKS: {sorted(layers - set(RANKS))}"


def test_no_import_circle():
    graph = import_graph()
    assert graph, "no modules found"
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_imports_follow_the_layers():
    bad = []
    for module, targets in import_graph().items():
        if module == "ktransformers":  # the package root re-exports the public API
            continue
        here = RANKS.get(layer_of(module))
        for t in sorted(targets):
            there = RANKS.get(layer_of(t))
            if here is not None and there is not None and there > here:
                bad.append(f"{module} -> {t}")
    assert not bad, "imports against the layers' direction:\n" + "\n".join(bad)


@pytest.mark.parametrize("cycle_free", [False, True])
def test_the_cycle_finder_finds_cycles(cycle_free):
    graph = {"a": {"b"}, "b": {"c"}, "c": set() if cycle_free else {"a"}}
    assert (find_cycle(graph) is None) == cycle_free
