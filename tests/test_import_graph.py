"""The import graph of ``torch_tp``: no cycle anywhere, floors that import downward only, private
modules kept inside their package, ``conv/``'s handler modules built on its core only, and the
import map of ``docs/architecture.md`` true to the code.

Every ``import`` counts, function-level ones included (a cycle closed by an import inside a
function is still a cycle).
"""

import ast
import pathlib
import re
import sys

from torch_tp.testing import ROOT

PACKAGE = ROOT / "torch_tp"
# what a torch_tp.conv handler module may import from torch_tp.conv
CONV_FOUNDATIONS = {"torch_tp.conv._core", "torch_tp.conv._registry", "torch_tp.conv.halo",
                    "torch_tp.conv._halo_exchange", "torch_tp.conv._geometry", "torch_tp.conv._ranges"}


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


# ------------------------------------------------------------------- the architecture map

ARCHITECTURE = ROOT / "docs" / "architecture.md"
_ARROW = re.compile(r"(\S+) [─-]+> (.+)")  # parallel/ ──> _layouts.py, overlap/   # a note


def _unit(module: str, package: pathlib.Path = PACKAGE) -> str:
    """The map's name for a module: its folder (``parallel/``), or its file at the root (``loss.py``)."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__.py"
    return f"{parts[0]}/" if len(parts) > 1 or (package / parts[0]).is_dir() else f"{parts[0]}.py"


def _unit_imports(package: pathlib.Path = PACKAGE) -> dict[str, dict[str, list[str]]]:
    """``{unit: {unit it imports: the module-level imports that make the arrow}}``."""
    units: dict[str, dict[str, list[str]]] = {}
    for module, targets in _graph(package).items():
        arrows = units.setdefault(_unit(module, package), {})
        for target in sorted(targets):
            if _unit(target, package) != _unit(module, package):
                arrows.setdefault(_unit(target, package), []).append(f"{module} -> {target}")
    return units


def _import_map(markdown: str) -> tuple[dict[str, set[str]], list[str]]:
    """The arrows of the fenced block in the doc's "Package map" section, and its malformed lines."""
    section = markdown.split("\n## Package map\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```text\n", 1)[1].split("```", 1)[0]
    arrows, errors = {}, []
    for line in block.splitlines():
        match = _ARROW.fullmatch(line.split("#", 1)[0].strip())
        if match is None:
            errors.append(f"not an arrow ('source ──> a, b' or 'source ──> nothing'): {line!r}")
        elif match[1] in arrows:
            errors.append(f"{match[1]} has two lines in the map")
        else:
            targets = match[2].strip()
            arrows[match[1]] = set() if targets == "nothing" else {t.strip() for t in targets.split(",")}
    return arrows, errors


def _map_errors(markdown: str, package: pathlib.Path = PACKAGE) -> list[str]:
    """How the map disagrees with the code, at the map's granularity (folders and root modules)."""
    declared, errors = _import_map(markdown)
    actual = _unit_imports(package)
    errors += [f"{unit} has no line in the map" for unit in sorted(actual.keys() - declared.keys())]
    errors += [f"the map's {unit} is no folder or module of torch_tp"
               for unit in sorted(declared.keys() - actual.keys())]
    for unit in sorted(declared.keys() & actual.keys()):
        errors += [f"the map's arrow {unit} ──> {target} is no import in the code"
                   for target in sorted(declared[unit] - actual[unit].keys())]
        errors += [f"{unit} imports {target}, which the map leaves out ({actual[unit][target][0]})"
                   for target in sorted(actual[unit].keys() - declared[unit])]
    return errors


def test_the_architecture_map_is_the_import_graph():
    assert _map_errors(ARCHITECTURE.read_text()) == []


def test_the_map_check_sees_a_broken_arrow_a_left_out_import_and_a_missing_line(tmp_path):
    package = tmp_path / "torch_tp"
    (package / "sub").mkdir(parents=True)
    for init in ("__init__.py", "sub/__init__.py", "b.py"):
        (package / init).write_text("")
    (package / "a.py").write_text("def f():\n    from torch_tp.sub import m\n")
    (package / "sub" / "m.py").write_text("from torch_tp import b\n")
    doc = ("# Architecture\n\n## Package map\n\n```text\n__init__.py ──> nothing\n"
           "a.py ──────> b.py   # a note\nsub/ ──────> b.py\n```\n\n## Next\n")
    assert _map_errors(doc, package) == [
        "b.py has no line in the map",
        "the map's arrow a.py ──> b.py is no import in the code",
        "a.py imports sub/, which the map leaves out (torch_tp.a -> torch_tp.sub.m)",
    ]
