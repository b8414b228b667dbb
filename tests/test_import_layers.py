"""The package's import graph, read from the source with ``ast``: no circles, no upward imports.

Edges: every ``import``/``from … import`` of a mergelab module (and ``import_module("…")`` of a
constant name), at module level AND inside functions (a function-level import is still a dependency; it only hides a circle from Python's
import machinery). Imports under ``if TYPE_CHECKING:`` are left out (they never run). A
``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``;
importing a submodule is not counted as an edge to its parent package's ``__init__``.

Layers, lowest first; a module may import its own layer and the ones below:

0. foundations: errors, outputs, results, plugins, candidate, lora, tiny
1. producers of candidates: merge/, compose/, model_candidate, the package ``__init__``
2. evaluation: eval/
3. study data: synthetic/, toy/, testbed/ (may use eval; eval never uses them)
4. comparison: compare/
5. front door: cli, demo

Nothing in mergelab imports ``studies`` (the recipes sit above the whole package).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mergelab"

LAYERS = {
    "mergelab.errors": 0,
    "mergelab.outputs": 0,
    "mergelab.results": 0,
    "mergelab.plugins": 0,
    "mergelab.candidate": 0,
    "mergelab.lora": 0,
    "mergelab.tiny": 0,
    "mergelab": 1,
    "mergelab.merge": 1,
    "mergelab.compose": 1,
    "mergelab.model_candidate": 1,
    "mergelab.eval": 2,
    "mergelab.synthetic": 3,
    "mergelab.toy": 3,
    "mergelab.testbed": 3,
    "mergelab.compare": 4,
    "mergelab.__main__": 5,
    "mergelab.cli": 5,
    "mergelab.demo": 5,
}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
    )


def import_graph() -> dict[str, set[str]]:
    """module → the mergelab modules it imports (module and function level); a fresh copy."""
    return {name: set(edges) for name, edges in _import_graph().items()}


@functools.cache
def _import_graph() -> dict[str, set[str]]:
    mods = modules()

    def target(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        stack = [ast.parse(path.read_text(encoding="utf-8"))]
        while stack:
            node = stack.pop()
            for child in ast.iter_child_nodes(node):
                if _is_type_checking(child):
                    continue
                if isinstance(child, ast.Import):
                    edges.update(t for a in child.names if (t := target(a.name)))
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        anchor = package.split(".")
                        anchor = anchor[: len(anchor) - (child.level - 1)]
                        base = ".".join([*anchor, *([base] if base else [])])
                    for alias in child.names:
                        full = f"{base}.{alias.name}"
                        if full in mods:
                            edges.add(full)
                        elif (
                            base in mods
                            and mods[base].name == "__init__.py"
                            and any(mods[base].parent.glob(f"{alias.name}.*"))
                        ):  # a compiled submodule (the merge loops): not Python source
                            continue
                        elif t := target(base):
                            edges.add(t)
                elif (
                    isinstance(child, ast.Call)
                    and getattr(child.func, "attr", None) == "import_module"
                    and child.args
                    and isinstance(child.args[0], ast.Constant)
                    and (t := target(str(child.args[0].value)))
                ):  # importlib.import_module("mergelab.x") is an import too
                    edges.add(t)
                    stack.append(child)
                else:
                    stack.append(child)
        edges.discard(name)
        graph[name] = edges
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative: the components of more than one module (the circles)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(component)
    return out


def layer(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        found = LAYERS.get(".".join(parts[:n]))
        if found is not None:
            return found
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def test_the_graph_is_read_from_the_source():
    graph = import_graph()
    assert len(graph) > 60
    # a module-level edge, a function-level one, one under TYPE_CHECKING that is not counted
    assert "mergelab.eval.tasks" in graph["mergelab.eval.standard_tasks"]
    assert "mergelab.eval.tasks" in graph["mergelab.eval.benchmarks"]  # inside __post_init__
    assert "mergelab.eval.benchmarks" not in graph["mergelab.eval.tasks"]
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_no_import_circles():
    graph = import_graph()
    circles = strongly_connected(graph)
    assert not circles, f"import circles: {[sorted(c) for c in circles]}"


def test_no_upward_imports():
    graph = import_graph()
    upward = sorted(
        f"{a} ({layer(a)}) imports {b} ({layer(b)})"
        for a, targets in graph.items()
        for b in targets
        if layer(b) > layer(a)
    )
    assert not upward, "\n".join(upward)


def test_nothing_in_the_package_imports_the_studies():
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            found += [f"{name} imports {n}" for n in names if n.split(".")[0] == "studies"]
    assert not found, found


def test_evaluation_imports_no_study_data():
    graph = import_graph()
    bad = [
        f"{a} imports {b}"
        for a, targets in graph.items()
        if a.startswith("mergelab.eval")
        for b in targets
        if layer(b) == 3
    ]
    assert not bad, bad
