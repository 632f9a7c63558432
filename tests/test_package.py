"""Package hygiene: the README's commands, a quiet import, and documented public names."""

import importlib
import inspect
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PUBLIC_MODULES = [
    "torch_tp",
    "torch_tp.parallel",
    "torch_tp.parallel.api",
    "torch_tp.parallel.plan",
    "torch_tp.parallel.style",
    "torch_tp.parallel.functional",
    "torch_tp.models",
    "torch_tp.models.llama",
    "torch_tp.testing",
    "torch_tp.launch",
    "torch_tp.functional",
    "torch_tp.parallel.explain",
    "torch_tp.parallel.init",
    "torch_tp.parallel.rules",
    "torch_tp.quant",
    "torch_tp.quant.int8_tensor",
    "torch_tp.quant.config",
    "torch_tp.demo",
    "torch_tp.conv",
    "torch_tp.conv.halo",
    "torch_tp.overlap",
]


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
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
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
