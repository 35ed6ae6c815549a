"""Run from a clone's root, ``import pycoll`` finds the source folder before any installed
copy, and pyproject.toml maps the clone's kernels/ and bindings/ into the package beside it:
this maps them likewise, so that the source folder imports as an install does."""

import os
import sys

_package = sys.modules["pycoll"]
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.path.isdir(os.path.join(_package.__path__[0], "bindings")) and all(
        os.path.isfile(os.path.join(_root, sub, "__init__.py")) for sub in ("bindings", "kernels")):
    _package.__path__.append(_root)
