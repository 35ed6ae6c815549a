"""Collectives under a real MPI launcher (mpiexec from the mpich wheel the test extra installs)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent / "mpi"


def mpiexec() -> str:
    beside_python = Path(sys.executable).parent / "mpiexec"
    found = str(beside_python) if beside_python.exists() else shutil.which("mpiexec")
    if found is None:
        pytest.fail("mpiexec not found: install the test extra (pip install -e '.[test]')")
    return found


def launch(nranks: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [mpiexec(), "-n", str(nranks), sys.executable, *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )


@pytest.mark.parametrize("script,summary,nranks", [
    *[("collectives.py", "mpi collectives", n) for n in (1, 2, 3, 4, 5)],
    # device arrays between processes: the staged MPI transport, a stand-in device each
    *[("device.py", "device collectives", n) for n in (1, 2, 3, 5)],
])
def test_every_collective_under_mpiexec(script, summary, nranks):
    done = launch(nranks, "-m", "mpi4py", str(HERE / script))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert f"{summary} on {nranks} ranks:" in output
    assert ", 0 failed" in output


@pytest.mark.parametrize("mode", ["raise", "bad-input"])
def test_a_failing_rank_ends_the_job_quickly(mode):
    started = time.monotonic()
    done = launch(3, str(HERE / "faults.py"), mode, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "finished, which it must not" not in output
    expected = (
        "pycoll: rank 1 raised RuntimeError: rank 1 fails on purpose; aborting the job"
        if mode == "raise"
        else "out.dtype=float64"
    )
    assert expected in output
    assert time.monotonic() - started < 60
