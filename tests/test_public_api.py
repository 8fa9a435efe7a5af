"""The package's public surface: every name ``specdraft`` exports imports, lazily, from the module it names."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import specdraft


@pytest.mark.parametrize("name", sorted(set(specdraft.__all__) - {"__version__"}))
def test_every_exported_name_imports_from_the_package(name):
    value = getattr(specdraft, name)
    module = importlib.import_module(specdraft._EXPORTS[name])
    assert value is getattr(module, name)
    assert getattr(value, "__module__", module.__name__).startswith("specdraft")


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="no_such_thing"):
        specdraft.no_such_thing  # noqa: B018


def test_importing_the_package_loads_neither_torch_nor_transformers():
    """The exports are lazy (PEP 562): ``import specdraft`` and the CLI's --help stay instant."""
    code = "import sys, specdraft; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
