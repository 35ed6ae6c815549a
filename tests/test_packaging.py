"""pycoll as installed, and as its source folder imports where no install is in the way."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy

ROOT = Path(__file__).resolve().parent.parent


def test_the_source_folder_imports_as_an_install_does():
    """Run from a clone's root, ``import pycoll`` finds the source folder before an installed
    copy (a plain `pip install .`), and failed on `pycoll.bindings`, which pyproject.toml
    maps from the clone's bindings/ (so did `mpiexec -n 2 python allreduce_mpi.py` with the
    README's example saved there). Here Python starts without site (-S): nothing but the
    source folder can provide pycoll, and numpy and mpi4py come by PYTHONPATH."""
    numpy_site = str(Path(numpy.__file__).parent.parent)
    done = subprocess.run(
        [sys.executable, "-S", "-c", "import sys, numpy, pycoll; "
         "from pycoll.bindings import shm; from pycoll.kernels import ReduceOp; "
         "print(pycoll.__file__); print(shm.__file__); "
         "print(pycoll.run_local(3, lambda: pycoll.allreduce(numpy.arange(4))[1].item())[0])"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": f"{numpy_site}:{sysconfig.get_path('purelib')}", "PATH": ""},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    init, shm, total = done.stdout.split()
    assert Path(init) == ROOT / "pycoll" / "__init__.py"
    assert Path(shm) == ROOT / "bindings" / "shm.py"
    assert total == "3"
