"""Run under mpiexec with PYCOLL_TIMEOUT: rank 1 never comes to the second collective; the
others must raise CollectiveTimeout naming a peer, within the timeout. With ``device-send``
also: rank 0's first device Send to rank 2, which never receives, times out while connecting
the pair (instead of blocking in MPI_Comm_create_group)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

import pycoll
from pycoll import spaces

comm = pycoll.world()
DEVICE_SEND = sys.argv[2:] == ["device-send"]
if DEVICE_SEND:  # a communicator of its own: the world is broken by its timeout below
    sys.path.insert(0, str(Path(__file__).parent.parent))
    from fake_device import FakeDevice, device_array

    spaces.register(FakeDevice())
    fresh = pycoll.Communicator()
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
if DEVICE_SEND and comm.rank == 0:
    # a first device message to a rank that never receives: connecting the pair times out
    started = time.monotonic()
    try:
        pycoll.send(device_array(np.ones(4)), 2, tag=5, comm=fresh)
        named = 0
    except pycoll.CollectiveTimeout as error:
        named = int("(connecting)" in str(error) and "for rank(s) 2" in str(error)
                    and time.monotonic() - started < 10)
        print(f"rank 0: {error}", flush=True)
named = MPI.COMM_WORLD.allreduce(named)
if comm.rank == 0:
    print(f"timeouts on {comm.size} ranks: {named} of {comm.size} named a peer", flush=True)
