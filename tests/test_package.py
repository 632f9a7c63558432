"""Package hygiene: the README's commands, a quiet import, and documented public names."""

import ast
import importlib
import inspect
import pathlib
import re
import sys

import pytest

from torch_tp.testing import ROOT, run_script

# The modules users import; everything else is reached through them (torch_tp.parallel
# re-exports its submodules' names, torch_tp.functional is the one spelling of the functions).
PUBLIC_MODULES = [
    "torch_tp",
    "torch_tp.functional",
    "torch_tp.parallel",
    "torch_tp.tools.fsdp",
    "torch_tp.tools.predict",
    "torch_tp.tools.activation_checkpoint",
    "torch_tp.quant",
    "torch_tp.conv",
    "torch_tp.overlap",
    "torch_tp.models",
    "torch_tp.models.llama",
    "torch_tp.models.moe",
    "torch_tp.models.cnn",
    "torch_tp.models.mixer",
    "torch_tp.testing",
    "torch_tp.launch",
    "torch_tp.run",
    "torch_tp.loss",
    "torch_tp.checkpoint",
    "torch_tp.integrations.transformers",
    "torch_tp.demo",
]
PACKAGE = ROOT / "torch_tp"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(path: pathlib.Path):
    """Every dotted name a file imports: modules, and ``module.name`` for ``from module import name``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: use absolute imports"
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def _private_owner(dotted: str) -> str | None:
    """The package a private name belongs to: ``torch_tp.overlap`` for the private module
    ``torch_tp.overlap._ring`` and for ``torch_tp.conv.halo._exchange_forward``, a private
    name of a module of that package. ``None`` for a public name."""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            holder = parts[:i]
            is_package = (ROOT.joinpath(*holder) / "__init__.py").exists()
            return ".".join(holder if is_package else holder[:-1])
    return None


def _foreign_private_imports() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = _module_name(path)
        for dotted in _imported_names(path):
            owner = _private_owner(dotted) if dotted.startswith("torch_tp") else None
            if owner is not None and not (importer == owner or importer.startswith(owner + ".")):
                found.append(f"{importer} imports {dotted}")
    return found


def test_no_module_imports_another_packages_private_module_or_name():
    # shared internals live in private modules of the root package (torch_tp._layouts),
    # which every package may import; a package's own private modules stay its own
    assert _foreign_private_imports() == []


def test_the_import_walk_sees_a_foreign_private_import(tmp_path, monkeypatch):
    assert _private_owner("torch_tp.overlap._custom_ops.run") == "torch_tp.overlap"
    assert _private_owner("torch_tp.conv.halo._exchange_forward") == "torch_tp.conv"
    assert _private_owner("torch_tp._layouts") == "torch_tp"
    assert _private_owner("torch_tp.parallel.style.ParallelStyle") is None
    fake = tmp_path / "torch_tp" / "quant"
    fake.mkdir(parents=True)
    (tmp_path / "torch_tp" / "overlap").mkdir()
    (tmp_path / "torch_tp" / "overlap" / "__init__.py").write_text("")
    (fake / "bad.py").write_text("from torch_tp.overlap import _custom_ops\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "torch_tp")
    assert _foreign_private_imports() == ["torch_tp.quant.bad imports torch_tp.overlap._custom_ops"]


def _readme_commands():
    return re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    main_job, tests = commands
    assert "torch==2.13.0" in main_job and "torch_tp.demo" in main_job
    assert "torch==2.13.0" in tests and "pytest" in tests
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines, "'.ci/run' must run the README's test command verbatim"


def test_importing_torch_tp_is_quiet_and_does_not_import_torchao():
    code = "import sys, torch_tp; print('torchao' in sys.modules)"
    done = run_script("-c", code, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
    assert done.stderr == ""


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_public_module_declares_all_and_documents_each_name_with_an_example(name):
    module = importlib.import_module(name)
    assert isinstance(module.__all__, list) and module.__all__, f"{name} needs __all__"
    undocumented = []
    for attr in module.__all__:
        obj = getattr(module, attr)
        if inspect.ismodule(obj) or not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if "Example" not in (inspect.getdoc(obj) or ""):
            undocumented.append(attr)
    assert not undocumented, f"{name}: public names without an Example in their docstring: {undocumented}"
