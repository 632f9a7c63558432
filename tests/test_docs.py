"""The docs that mirror the code fail here when the code moves: README's layout table and
``docs/architecture.md``'s module table name every folder and module of ``torch_tp/`` and nothing
that is not on disk, and a ``file.py:name`` the docs cite is defined in that file.

(``docs/architecture.md``'s import map is checked against the imports in ``test_import_graph.py``.)

A table's first column names paths (``torch_tp/parallel/`` in README, ``parallel/api.py`` in
architecture.md, relative to ``torch_tp/``); a bare name after a path is in that path's folder
(``parallel/fsdp.py``, ``predict.py``). A folder's row names its files in its second column, by
bare name (``_ops_*.py`` globs). A subpackage's ``__init__.py`` is covered by its folder.
"""

import ast
import functools
import re

import pytest

from torch_tp.testing import ROOT

PACKAGE = ROOT / "torch_tp"
DOCS = [ROOT / "README.md", ROOT / "DEVELOPERS.md", *sorted((ROOT / "docs").glob("*.md"))]
_CITED = re.compile(r"([\w/]*?)(\w+\.py):([A-Za-z_]\w*(?:\.\w+)*)")  # parallel/style.py:_LinearStyle.apply_to
_CITED_LINE = re.compile(r"(\w+\.py):\d+")                # style.py:213: goes stale silently


def _table_rows(markdown: str, heading: str) -> list[tuple[str, str]]:
    """``(first column, the rest)`` of each body row of the first table under ``heading``."""
    section = markdown.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line[2:].partition(" | ")[::2] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| ---")]
    return rows[1:]  # the header


def _named_paths(rows: list[tuple[str, str]], base: str) -> set[str]:
    """The repository paths a table names (folders end with ``/``; globs kept as written)."""
    named = set()
    for first, rest in rows:
        folder = base
        for name in re.findall(r"`([^`]+)`", first):
            path = base + name if "/" in name else folder + name
            folder = path if path.endswith("/") else path.rpartition("/")[0] + "/"
            named.add(path)
            if path.endswith("/"):
                named |= {path + file for file in re.findall(r"`([\w*]+\.py)`", rest)}
    return named


def _missing_on_disk(named: set[str]) -> list[str]:
    return sorted(p for p in named if not (any(ROOT.glob(p)) if "*" in p else (ROOT / p).exists()))


def _modules_left_out(named: set[str]) -> list[str]:
    """The modules of ``torch_tp/`` that ``named`` covers neither by name nor by a glob."""
    files = {p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py")}
    covered = {f for f in files for p in named if f == p or ("*" in p and ROOT.joinpath(f).match(p))}
    folders = {f.rpartition("/")[0] + "/" for f in covered} | {p for p in named if p.endswith("/")}
    covered |= {f for f in files if f.endswith("/__init__.py") and f[: -len("__init__.py")] in folders
                and f != "torch_tp/__init__.py"}
    return sorted(files - covered)


def _readme_layout() -> list[tuple[str, str]]:
    return _table_rows((ROOT / "README.md").read_text(), "## Layout")


def _architecture_modules() -> list[tuple[str, str]]:
    return _table_rows((ROOT / "docs" / "architecture.md").read_text(), "## Package map")


def test_readme_layout_has_a_row_per_folder_of_torch_tp():
    rows = {name for first, _ in _readme_layout() for name in re.findall(r"`([^`]+)`", first)}
    folders = {p.relative_to(ROOT).as_posix() + "/" for p in PACKAGE.rglob("*")
               if p.is_dir() and p.name != "__pycache__"}
    assert sorted(folders - rows) == []


@pytest.mark.parametrize("table", ["readme", "architecture"])
def test_the_table_names_every_module_of_torch_tp(table):
    rows, base = (_readme_layout(), "") if table == "readme" else (_architecture_modules(), "torch_tp/")
    assert _modules_left_out(_named_paths(rows, base)) == []


@pytest.mark.parametrize("table", ["readme", "architecture"])
def test_everything_the_table_names_is_on_disk(table):
    rows, base = (_readme_layout(), "") if table == "readme" else (_architecture_modules(), "torch_tp/")
    assert _missing_on_disk(_named_paths(rows, base)) == []


def test_the_table_check_sees_a_left_out_module_and_a_stale_name():
    rows = [("`torch_tp/__init__.py`", "the names"),
            ("`torch_tp/quant/`", "`int8_tensor.py` (the class), `_ops_*.py` (the op tables), `gone.py`")]
    named = _named_paths(rows, "")
    assert "torch_tp/quant/config.py" in _modules_left_out(named)
    assert "torch_tp/quant/_ops_shape.py" not in _modules_left_out(named)
    assert _missing_on_disk(named) == ["torch_tp/quant/gone.py"]


@functools.cache
def _defined(path) -> frozenset[str]:
    """Every function, class and assigned name in one file, at any depth (not what it imports)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return frozenset(names)


def _citation_errors(text: str, where: str, files: list) -> list[str]:
    by_name = {}
    for path in files:
        by_name.setdefault(path.name, []).append(path)
    errors = []
    for match in _CITED.finditer(text):
        folder, name, dotted = match.groups()
        candidates = [p for p in by_name.get(name, []) if p.as_posix().endswith("/" + folder + name)]
        if candidates and not any(set(dotted.split(".")) <= _defined(p) for p in candidates):
            errors.append(f"{where}: {match.group(0)} names nothing defined in {name}")
    errors += [f"{where}: {m.group(0)} cites a line number; cite the function instead"
               for m in _CITED_LINE.finditer(text) if m.group(1) in by_name]
    return errors


def _repository_files() -> list:
    return [p for top in ("torch_tp", "benchmarks", "tutorials") for p in (ROOT / top).rglob("*.py")]


def test_every_function_the_docs_cite_is_defined_where_they_say():
    files = _repository_files()
    errors = [e for doc in DOCS for e in _citation_errors(doc.read_text(), doc.name, files)]
    assert errors == []


def test_the_citation_check_sees_a_moved_function_and_a_line_number():
    text = "`style.py:_LinearStyle.apply_to` then `style.py:_sharded_input`, `launch.py:213`, `other.py:12`"
    assert _citation_errors(text, "doc", _repository_files()) == [
        "doc: style.py:_sharded_input names nothing defined in style.py",
        "doc: launch.py:213 cites a line number; cite the function instead",
    ]
