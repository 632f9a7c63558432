"""What type checkers are told about the styles, and that it matches what runs.

``ParallelStyle.__init_subclass__`` makes every style a keyword-only dataclass at runtime, which
a type checker cannot see; ``typing.dataclass_transform(kw_only_default=True)`` on the base
class declares it (so ``ColwiseParallel(overlap=True, foo=1)`` is flagged before it runs), and
``torch_tp/py.typed`` tells checkers to read torch_tp's annotations at all (PEP 561).
"""

import dataclasses
import inspect

import pytest

import torch_tp
from torch_tp.parallel._style_base import ParallelStyle
from torch_tp.testing import ROOT

STYLES = sorted(
    (obj for obj in vars(torch_tp).values()
     if inspect.isclass(obj) and issubclass(obj, ParallelStyle) and obj is not ParallelStyle),
    key=lambda cls: cls.__name__,
)


def test_parallel_style_declares_keyword_only_dataclass_subclasses_to_type_checkers():
    marker = getattr(ParallelStyle, "__dataclass_transform__", None)
    assert marker is not None, "ParallelStyle is not decorated with typing.dataclass_transform"
    assert marker["kw_only_default"] is True, marker
    # __init_subclass__ passes eq=False: equality is ParallelStyle.__eq__, not a generated one
    assert marker["eq_default"] is False, marker


@pytest.mark.parametrize("style", STYLES, ids=lambda cls: cls.__name__)
def test_every_style_field_is_keyword_only_as_declared(style):
    fields = dataclasses.fields(style)
    assert fields, f"{style.__name__} has no dataclass fields"
    assert [f.name for f in fields if not f.kw_only] == []
    positional = [p.name for p in inspect.signature(style).parameters.values()
                  if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert positional == [], f"{style.__name__}({', '.join(positional)}, ...) takes positional arguments"
    assert style.__eq__ is ParallelStyle.__eq__


def test_the_styles_include_the_upstream_ones():
    names = {cls.__name__ for cls in STYLES}
    assert {"ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
            "PrepareModuleOutput"} <= names, names


def test_the_package_ships_py_typed():
    assert (ROOT / "torch_tp" / "py.typed").is_file(), "torch_tp/py.typed is missing (PEP 561 marker)"
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_data = config.get("tool", {}).get("setuptools", {}).get("package-data", {})
    listed = [*package_data.get("torch_tp", []), *package_data.get("*", [])]
    assert "py.typed" in listed, f"pyproject.toml's [tool.setuptools.package-data] must list py.typed: {package_data}"
