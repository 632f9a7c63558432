"""The import graph of ``torch_tp``: no cycle anywhere, floors that import downward only, private
modules kept inside their package, and ``conv/``'s handler modules built on its core only.

Every ``import`` counts, function-level ones included (a cycle closed by an import inside a
function is still a cycle).
"""

import ast
import pathlib
import sys

from torch_tp.testing import ROOT

PACKAGE = ROOT / "torch_tp"
# what a torch_tp.conv handler module may import from torch_tp.conv
CONV_FOUNDATIONS = {"torch_tp.conv._core", "torch_tp.conv._registry", "torch_tp.conv.halo",
                    "torch_tp.conv._geometry", "torch_tp.conv._ranges"}


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph(package: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    """``{module: the torch_tp modules it imports}`` (``from a import b``: ``a.b`` when that is a module)."""
    modules = {_module_name(p, package.parent): p for p in package.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module in modules:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.add(full if full in modules else node.module)
        graph[name] = targets - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_torch_tp_has_no_import_cycle():
    assert _cycles(_graph()) == []


def test_the_cycle_check_sees_a_cycle_closed_inside_a_function(tmp_path):
    package = tmp_path / "torch_tp"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from torch_tp import b\n")
    (package / "b.py").write_text("def f():\n    from torch_tp.a import x\n")
    assert _cycles(_graph(package)) == [["torch_tp.a", "torch_tp.b"]]


def test_conv_handler_modules_import_only_the_core():
    from torch_tp.conv import _registry

    graph = _graph()
    for handler_set in _registry.handler_sets():
        conv_imports = {m for m in graph[handler_set.owner] if m.startswith("torch_tp.conv")}
        assert conv_imports <= CONV_FOUNDATIONS, f"{handler_set.owner} imports {conv_imports - CONV_FOUNDATIONS}"


def _private_imports_across_packages(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """``(importer, private module)`` pairs where the importer lies outside the private module's package."""
    crossings = []
    for importer, targets in graph.items():
        for target in targets:
            if target.rpartition(".")[2].startswith("_"):
                owner = target.rpartition(".")[0]
                if not (importer == owner or importer.startswith(owner + ".")):
                    crossings.append((importer, target))
    return sorted(crossings)


def test_the_tp_core_imports_no_model_level_tool():
    graph = _graph()
    upward = {(m, t) for m, ts in graph.items() if m.startswith("torch_tp.parallel")
              for t in ts if t.startswith("torch_tp.tools")}
    assert upward == set()


def test_no_module_imports_another_packages_private_module():
    assert _private_imports_across_packages(_graph()) == []


def test_the_private_module_check_sees_a_crossing(tmp_path):
    package = tmp_path / "torch_tp"
    (package / "conv").mkdir(parents=True)
    (package / "quant").mkdir()
    for init in ("__init__.py", "conv/__init__.py", "quant/__init__.py"):
        (package / init).write_text("")
    (package / "conv" / "_core.py").write_text("")
    (package / "conv" / "halo.py").write_text("from torch_tp.conv import _core\n")
    (package / "quant" / "matmul.py").write_text("from torch_tp.conv._core import x\n")
    assert _private_imports_across_packages(_graph(package)) == [("torch_tp.quant.matmul", "torch_tp.conv._core")]
