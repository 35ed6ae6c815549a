"""Run under mpiexec: collectives on device arrays between processes, every algorithm,
against the oracle.

``device.py`` (no argument): a stand-in device per process, so nothing is shared but MPI
messages, as between nodes: the staged MPI transport. ``device.py shared``: a stand-in whose
exchange memory is a file the processes map (tests/fake_device.py SharedFileDevice), so the
peer-memory transport runs between processes as over CUDA IPC. ``device.py cuda``: CuPy arrays, each
rank on GPU (node-local rank mod GPU count), over CUDA IPC within the node (or staged MPI
with PYCOLL_DEVICE_TRANSPORT=staged).

Rank 0 prints 'device collectives on P ranks: N passed, M failed'; non-zero exit on failure.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).parent.parent))
from fake_device import FakeDevice, SharedFileDevice, device_array, host_array  # noqa: E402

import pycoll  # noqa: E402
from pycoll import oracle, spaces  # noqa: E402
from pycoll.algorithms import families_for  # noqa: E402
from pycoll.bindings import staged  # noqa: E402
from pycoll.comm import _reachable  # noqa: E402
from pycoll.schedule import Collective  # noqa: E402

comm = pycoll.world()
P, RANK = comm.size, comm.rank
CUDA = sys.argv[1:] == ["cuda"]
if CUDA:
    import cupy

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
elif sys.argv[1:] == ["shared"]:
    device = SharedFileDevice(seed=RANK)
    spaces.register(device)
    expected_transport = "PeerMemoryTransport"
else:
    device = FakeDevice(seed=RANK)
    spaces.register(device)
    expected_transport = "StagedTransport"
if os.environ.get("PYCOLL_DEVICE_TRANSPORT") == "staged":
    expected_transport = "StagedTransport"
elif len(set(comm.nodes())) > 1 and expected_transport == "PeerMemoryTransport":
    # peer memory within nodes, MPI between; MPI alone for a rank alone on its node
    alone = comm.nodes().count(comm.nodes()[RANK]) == 1
    expected_transport = "StagedTransport" if alone else "RoutedTransport"
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
    start, stop = sum(counts[:RANK]), sum(counts[: RANK + 1])
    for algorithm in families_for(Collective.ALLGATHER):  # in place, as NCCL's
        gathered = device_array(np.zeros(count, np.int32))
        gathered[start:stop] = device_array(inputs[RANK][start:stop])
        pycoll.allgather(gathered[start:stop], counts=counts, out=gathered, algorithm=algorithm)
        x = device_array(inputs[RANK])
        pycoll.reduce_scatter(x, counts=counts, out=x[start:stop], algorithm=algorithm)
        device.synchronize()
        check(f"allgather {algorithm} {count} in place", host_array(gathered),
              np.concatenate([inputs[r][sum(counts[:r]):sum(counts[: r + 1])]
                              for r in range(P)]))
        check(f"reduce_scatter {algorithm} {count} in place", host_array(x[start:stop]),
              oracle.reduce_scatter(inputs, "sum", counts)[RANK])
    got = pycoll.broadcast(device_array(inputs[RANK]), P - 1)
    device.synchronize()
    check(f"broadcast {count}", host_array(got), inputs[P - 1])

# Back-to-back small AllReduces with no host wait between: every call re-records each
# rank's one IPC event while peers' waits on its earlier records may still be queued.
outs = [pycoll.allreduce(device_array(np.full(64, i + RANK, np.int64)), algorithm="ring")
        for i in range(1000 if CUDA else 50)]
device.synchronize()
want = [np.full(64, i * P + P * (P - 1) // 2, np.int64) for i in range(len(outs))]
check("back-to-back allreduces", [host_array(o) for o in outs], want)

# The ring's forwarding gives the bits of reducing or copying, then sending (PYCOLL_FORWARD=0):
# non-integer floats, where the order of additions shows.
noise = np.random.default_rng(RANK).standard_normal(1000 * P + 3).astype(np.float32)
by_setting = {}
user_forward = os.environ.get("PYCOLL_FORWARD")  # the run's own setting, put back after
for setting in ("1", "0"):
    os.environ["PYCOLL_FORWARD"] = setting
    comm.prepared.clear()  # the setting is read when a call is prepared
    got = pycoll.allreduce(device_array(noise), algorithm="ring")
    device.synchronize()
    by_setting[setting] = host_array(got)
if user_forward is None:
    del os.environ["PYCOLL_FORWARD"]
else:
    os.environ["PYCOLL_FORWARD"] = user_forward
comm.prepared.clear()
check("ring forwarding keeps the bits", by_setting["1"].tobytes() == by_setting["0"].tobytes(),
      True)

if (isinstance(device, FakeDevice) and expected_transport == "PeerMemoryTransport" and P > 1
        and user_forward != "0"):
    # the ring wrote each chunk into the next rank's inbox as it reduced or copied it
    check("ring reduce-and-forward", device.reduce_copies >= 50 * (P - 1), True)
    check("ring copy-and-forward", device.copy_pairs >= 50 * (P - 2), True)

kind = type(comm.device_transport(device)).__name__
check("transport", kind, expected_transport if P > 1 else kind)

# Send/Recv between the first and last rank while the others sit out: the pair makes its
# endpoint alone (a collective making would hang here).
if P > 1 and RANK in (0, P - 1):
    other = P - 1 - RANK
    got = device_array(np.full(5, -1, np.int32))
    if RANK == 0:
        pycoll.send(device_array(np.arange(5, dtype=np.int32)), other, tag=3)
        pycoll.recv(got, other, tag=4)
    else:
        pycoll.recv(got, other, tag=3)
        pycoll.send(got, other, tag=4)
    device.synchronize()
    check("send/recv pair", host_array(got), np.arange(5, dtype=np.int32))

# free_device_buffers frees the device endpoints' own MPI communicators, then the next call
# makes new ones.
owned = [t.comm for t in _reachable(*comm._device_transports.values()) if hasattr(t, "comm")]
comm.free_device_buffers()
check("device communicators freed", bool(owned) and all(c == MPI.COMM_NULL for c in owned), True)
got = pycoll.allreduce(device_array(np.ones(7, np.int32)))
device.synchronize()
check("allreduce after freeing", host_array(got), np.full(7, P, np.int32))
comm.free_device_buffers()  # peers' mappings closed before any memory is freed, not at exit
totals = comm.mpi_comm.allreduce(np.array([passed, failed]))
if RANK == 0:
    print(f"device collectives on {P} ranks: {totals[0]} passed, {totals[1]} failed", flush=True)
sys.exit(1 if totals[1] else 0)
