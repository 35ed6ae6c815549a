"""Run under mpiexec with PYCOLL_TIMEOUT: rank 1 never comes to the second collective; the
others must raise CollectiveTimeout naming a peer, within the timeout."""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI

import pycoll

comm = pycoll.world()
pycoll.allreduce(np.ones(3))
named = 1
if comm.rank != 1:
    started = time.monotonic()
    try:
        pycoll.allreduce(np.ones(int(sys.argv[1])), algorithm="ring")
        named = 0
    except pycoll.CollectiveTimeout as error:
        named = int("for rank(s) " in str(error) and time.monotonic() - started < 10)
        print(f"rank {comm.rank}: {error}", flush=True)
named = MPI.COMM_WORLD.allreduce(named)
if comm.rank == 0:
    print(f"timeouts on {comm.size} ranks: {named} of {comm.size} named a peer", flush=True)
