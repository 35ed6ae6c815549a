#!/usr/bin/env bash
# Here, with network: the wheels bench/gpu_check.sh needs on a GPU machine that has none
# (mpi4py and an MPI library; CuPy, numpy and numba-cuda are there already), into .whl/,
# which git ignores and the device tool carries (name it in carry). Also numpy 2.4, which
# gpu_check.sh puts first only where numba-cuda cannot compile under the machine's numpy
# (numba-cuda 0.30 under numpy 2.5: NVIDIA/numba-cuda#907).
set -euo pipefail
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  mpi4py==4.1.2 mpich==5.0.2 numpy==2.4.6
ls -l .whl
