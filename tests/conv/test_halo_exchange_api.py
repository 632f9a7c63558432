"""``torch_tp.conv._halo_exchange`` is a declared private API: what ``conv/`` takes from it is in
its ``__all__`` and its table, and no ``conv/`` module reaches for a private name of the halo
modules (the second, undeclared API ``halo.py`` had before).
"""

import ast
import re

from torch_tp.conv import _halo_exchange, halo
from torch_tp.testing import ROOT

CONV = ROOT / "torch_tp" / "conv"
HALO_MODULES = ("torch_tp.conv.halo", "torch_tp.conv._halo_exchange")


def _imports_from_halo_modules() -> list[tuple[str, str, str]]:
    """``(importing file, halo module, name)`` for every ``from <halo module> import name`` in conv/."""
    found = []
    for path in sorted(CONV.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in HALO_MODULES:
                found += [(path.name, node.module, alias.name) for alias in node.names]
    return found


def test_no_conv_module_imports_a_private_name_of_the_halo_modules():
    private = [f"{where} imports {module}.{name}" for where, module, name in _imports_from_halo_modules()
               if name.startswith("_")]
    assert private == []


def test_what_conv_takes_from_halo_exchange_is_declared_in_its_all():
    taken = {name for _, module, name in _imports_from_halo_modules() if module == "torch_tp.conv._halo_exchange"}
    assert taken, "no conv/ module imports torch_tp.conv._halo_exchange"
    assert taken <= set(_halo_exchange.__all__), taken - set(_halo_exchange.__all__)
    assert all(hasattr(_halo_exchange, name) for name in _halo_exchange.__all__)


def test_the_halo_exchange_table_lists_every_declared_name():
    rows = [line for line in _halo_exchange.__doc__.splitlines() if line.startswith("| :")]
    listed = {name for row in rows for name in re.findall(r":(?:func|class|data):`(\w+)`", row.split("|")[1])}
    assert listed == set(_halo_exchange.__all__), listed ^ set(_halo_exchange.__all__)


def test_halo_keeps_its_public_autograd_level_api_only():
    assert halo.__all__ == ["halo_bytes", "halo_exchange"]
    assert not set(_halo_exchange.__all__) & set(halo.__all__)
