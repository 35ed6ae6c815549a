"""Run under mpiexec with PYCOLL_CHECK=1: rank 1 passes another dtype; every rank must raise
CollectiveMismatch naming it (no rank hangs), then the ranks carry on in step."""

from __future__ import annotations

import numpy as np

import pycoll

comm = pycoll.world()
named = 0
try:
    pycoll.allreduce(np.ones(5, np.float64 if comm.rank == 1 else np.float32))
except pycoll.CollectiveMismatch as error:
    named = int('"float64" on rank 1' in str(error))
total = pycoll.allreduce(np.array([named]))  # still in step after the error
if comm.rank == 0:
    print(f"agreement on {comm.size} ranks: {int(total[0])} of {comm.size} named the mismatch",
          flush=True)
