"""Run from a clone's root, ``import pycoll`` finds the source folder before any installed
copy, and pyproject.toml maps the clone's kernels/ and bindings/ into the package beside it:
this maps those two likewise, so that the source folder imports as an install does."""

import importlib.util
import os
import sys

_package = sys.modules["pycoll"]
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _map(name: str) -> None:
    """The clone's ``name``/ as ``pycoll.name`` (its modules found in that folder)."""
    folder = os.path.join(_root, name)
    spec = importlib.util.spec_from_file_location(
        f"pycoll.{name}", os.path.join(folder, "__init__.py"),
        submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    setattr(_package, name, module)


if not os.path.isdir(os.path.join(_package.__path__[0], "bindings")) and all(
        os.path.isfile(os.path.join(_root, name, "__init__.py")) for name in ("bindings", "kernels")
) and "pycoll.bindings" not in sys.modules:
    for _name in ("bindings", "kernels"):
        _map(_name)
