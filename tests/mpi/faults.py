"""Run under mpiexec: one rank raises while the others wait in a collective.

Run as ``python tests/mpi/faults.py MODE`` with MODE ``raise`` (an uncaught exception, which
pycoll's MPI world turns into an abort of the whole job; ``raise-own``: the same in a program
that makes its own ``pycoll.Communicator`` and never uses the world; ``raise-thread``: the
collectives run on a thread of the program's own, which raises) or ``bad-input`` (a
validation error on one rank only) or ``kill`` (rank 1 is killed by SIGKILL after the
shared-memory transport was made, while the others wait for it in a collective) or
``kill-device`` (the same with device arrays: a stand-in device per process, the staged MPI
transport) or ``kill-cuda`` (CuPy arrays on a real GPU, over CUDA IPC: a peer dies with its
inbox mapped).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent))
from fake_device import FakeDevice, device_array  # noqa: E402

import pycoll  # noqa: E402
from pycoll import spaces  # noqa: E402

mode = sys.argv[1]
# raise-own: the program makes its own communicator and never touches pycoll.world()
comm = pycoll.Communicator() if mode == "raise-own" else pycoll.world()
x = np.arange(8, dtype=np.float32)
if mode == "kill-device":
    spaces.register(FakeDevice(seed=comm.rank))
    x = device_array(x)
elif mode == "kill-cuda":
    import cupy

    x = cupy.asarray(x)
if mode.startswith("kill"):
    pycoll.allreduce(x, comm=comm)  # the first collective makes the shared-memory transport
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)


def work() -> None:
    if comm.rank == 1 and not mode.startswith("kill"):
        if mode.startswith("raise"):
            raise RuntimeError("rank 1 fails on purpose")
        # wrong out dtype: raises on rank 1 only
        pycoll.allreduce(x, out=np.empty(8, np.float64), comm=comm)
    pycoll.allreduce(x, algorithm="ring", comm=comm)
    print(f"rank {comm.rank} finished, which it must not", flush=True)


if mode == "raise-thread":
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
else:
    work()
