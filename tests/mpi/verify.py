"""Run under mpiexec with PYCOLL_VERIFY=1: every collective's right result passes the check
(host arrays: the shared-memory one-shot for small calls, schedules for larger ones, over
shared memory or, with PYCOLL_HOST_TRANSPORT=mpi, MPI);
then rank 1's next result is made wrong in one element, and every rank must raise the same
VerificationError naming rank 1. Prints one summary line on rank 0."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

import pycoll
from pycoll import api

comm = pycoll.world()
rank, size = comm.rank, comm.size
assert comm.verify, "run with PYCOLL_VERIFY=1"
passed = failed = 0
for count in (0, size, 7 * size, 20000 * size):  # small: the one-shot paths; large: schedules
    x = (np.arange(count) % 7 + rank).astype(np.int32)
    try:
        pycoll.allreduce(x, "max")
        pycoll.reduce_scatter(x)
        counts = [count // size + r % 2 for r in range(size)]  # uneven
        pycoll.allgather(np.full(counts[rank], rank, np.int16), counts=counts)
        pycoll.broadcast(x.copy(), root=size - 1)
        pycoll.reduce(x.astype(np.float32), "sum", root=0)
        pycoll.alltoall(x)
        passed += 1
    except pycoll.VerificationError as error:
        print(f"rank {rank}: a right result failed the check: {error}", flush=True)
        failed += 1

real_run = api.run


def wrong_on_rank_1(program, source, target, *args, **kwargs):
    real_run(program, source, target, *args, **kwargs)
    if rank == 1 and not getattr(wrong_on_rank_1, "done", False):
        wrong_on_rank_1.done = True
        target.reshape(-1)[5] += 1


named = 0
if size > 1:  # no rank 1 to get wrong otherwise
    api.run = wrong_on_rank_1
    try:
        pycoll.allreduce(np.arange(30000, dtype=np.int64), algorithm="ring")
    except pycoll.VerificationError as error:
        named = int("rank 1: 1 of 30000 elements differ, the first at index 5" in str(error))
        if rank == 1:
            named &= int("here (rank 1): index 5: got " in str(error))
    api.run = real_run
named = MPI.COMM_WORLD.allreduce(named)
passed = MPI.COMM_WORLD.allreduce(passed)
failed = MPI.COMM_WORLD.allreduce(failed)
if rank == 0:
    print(f"verify on {size} ranks: {passed} passed, {failed} failed, "
          f"{named} ranks named rank 1", flush=True)
