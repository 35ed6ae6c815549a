"""Run under mpiexec: collectives on device arrays between processes, every algorithm,
against the oracle.

``device.py`` (no argument): a stand-in device per process, so nothing is shared but MPI
messages, as between nodes: the staged MPI transport. ``device.py cuda``: CuPy arrays, each
rank on GPU (node-local rank mod GPU count), over CUDA IPC within the node (or staged MPI
with PYCOLL_DEVICE_TRANSPORT=staged).

Rank 0 prints 'device collectives on P ranks: N passed, M failed'; non-zero exit on failure.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent))
from fake_device import FakeDevice, device_array, host_array  # noqa: E402

import pycoll  # noqa: E402
from pycoll import oracle, spaces  # noqa: E402
from pycoll.algorithms import families_for  # noqa: E402
from pycoll.bindings import staged  # noqa: E402
from pycoll.schedule import Collective  # noqa: E402

comm = pycoll.world()
P, RANK = comm.size, comm.rank
CUDA = sys.argv[1:] == ["cuda"]
if CUDA:
    import cupy
    from mpi4py import MPI

    node = comm.mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
    cupy.cuda.Device(node.Get_rank() % cupy.cuda.runtime.getDeviceCount()).use()
    stream = cupy.cuda.Stream(non_blocking=True)
    stream.use()
    device = spaces.CUDA

    def device_array(x: np.ndarray):  # noqa: F811 - this run's arrays are CuPy's
        return cupy.asarray(x)

    def host_array(x) -> np.ndarray:  # noqa: F811
        return x.get()

    expected_transport = "PeerMemoryTransport"
else:
    device = FakeDevice(seed=RANK)
    spaces.register(device)
    expected_transport = "StagedTransport"
if os.environ.get("PYCOLL_DEVICE_TRANSPORT") == "staged":
    expected_transport = "StagedTransport"
passed = failed = 0
staged.PIECE_BYTES = 1000  # several pieces per message, in order, on one tag


def check(name: str, got, want) -> None:
    global passed, failed
    if np.array_equal(got, want):
        passed += 1
    else:
        failed += 1
        print(f"rank {RANK}: FAILED {name}: got {got!r}, want {want!r}", flush=True)


for count in (0, 1, P + 1, 1000):
    rng = np.random.default_rng(count)
    inputs = [rng.integers(-3, 4, count).astype(np.int32) for _ in range(P)]
    for algorithm in families_for(Collective.ALLREDUCE):
        got = pycoll.allreduce(device_array(inputs[RANK]), algorithm=algorithm)
        device.synchronize()
        check(f"allreduce {algorithm} {count}", host_array(got), oracle.allreduce(inputs, "sum"))
    counts = [count // P + (r < count % P) for r in range(P)]
    for algorithm in families_for(Collective.REDUCE_SCATTER):
        got = pycoll.reduce_scatter(
            device_array(inputs[RANK]), "max", counts=counts, algorithm=algorithm
        )
        device.synchronize()
        want = oracle.reduce_scatter(inputs, "max", counts)[RANK]
        check(f"reduce_scatter {algorithm} {count}", host_array(got), want)
    for algorithm in families_for(Collective.ALLGATHER):
        got = pycoll.allgather(device_array(inputs[RANK]), algorithm=algorithm)
        device.synchronize()
        check(f"allgather {algorithm} {count}", host_array(got), oracle.allgather(inputs))
    got = pycoll.broadcast(device_array(inputs[RANK]), P - 1)
    device.synchronize()
    check(f"broadcast {count}", host_array(got), inputs[P - 1])

kind = type(comm.device_transport(device)).__name__
check("transport", kind, expected_transport if P > 1 else kind)
totals = comm.mpi_comm.allreduce(np.array([passed, failed]))
if RANK == 0:
    print(f"device collectives on {P} ranks: {totals[0]} passed, {totals[1]} failed", flush=True)
sys.exit(1 if totals[1] else 0)
