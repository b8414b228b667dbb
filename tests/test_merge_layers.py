"""The layers of mergelab.merge, read from the imports: no import circle among its modules, and
the methods (the specification) import neither the engines nor the accelerator."""

from __future__ import annotations

import ast
from pathlib import Path

import mergelab.merge

ROOT = Path(mergelab.merge.__file__).parent
PACKAGE = "mergelab.merge"
ENGINES = {"checkpoint", "state_dict", "lora", "mergekit_dialect", "cli", "config", "tokenizer"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def merge_imports() -> dict[str, set[str]]:
    """Every module of mergelab.merge -> the modules of mergelab.merge it imports (anywhere in
    the file, functions included)."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rsplit(".", 1)[0]
                target = node.module or ""
                if node.level:
                    target = f"{base}.{target}" if target else base
                candidates = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            found |= {c for c in candidates if c in modules and c != name}
        graph[name] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def is_package_init(name: str, graph: dict[str, set[str]]) -> bool:
    return (ROOT / Path(*name.split(".")[2:]) / "__init__.py").is_file()


def test_no_import_circle_in_merge():
    graph = merge_imports()
    # a package's __init__ importing its own submodules (to register them) is not a layer
    # crossing; a submodule importing a sibling through its package is
    without_inits = {
        name: {t for t in targets if not is_package_init(t, graph)}
        for name, targets in graph.items()
    }
    assert cycles(without_inits) == []


def test_methods_import_neither_engines_nor_accelerator():
    graph = merge_imports()
    for name, targets in graph.items():
        if not name.startswith(f"{PACKAGE}.methods"):
            continue
        for target in targets:
            layer = target.removeprefix(f"{PACKAGE}.").split(".")[0]
            assert layer not in ENGINES | {"accelerator"}, f"{name} imports {target}"


def test_the_graph_sees_the_imports():
    """The test above can fail: the accelerator is seen importing the methods and the registry."""
    graph = merge_imports()
    assert f"{PACKAGE}.methods.steps" in graph[f"{PACKAGE}.accelerator.kernels"]
    assert f"{PACKAGE}.registry" in graph[f"{PACKAGE}.methods.standard"]


def test_direct_io_and_huge_pages_live_in_the_accelerator():
    """O_DIRECT and MADV_HUGEPAGE (speed, not meaning) are named only under accelerator/: the
    engines' plain I/O is ordinary writes and torch.empty buffers."""
    speed_names = {"O_DIRECT", "MADV_HUGEPAGE"}
    found = {}
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "value", None)
            if name in speed_names:
                found.setdefault(module_name(path), set()).add(name)
    assert found, "the check sees no use of O_DIRECT or MADV_HUGEPAGE at all"
    assert set(found) == {f"{PACKAGE}.accelerator.io"}, found
