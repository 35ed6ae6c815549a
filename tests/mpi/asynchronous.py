"""Run under mpiexec: async collectives on two communicators overlap; both results right."""

from __future__ import annotations

import numpy as np

import pycoll

comm = pycoll.world()
other = comm.split(0)
P, RANK = comm.size, comm.rank
big = np.arange(300_000, dtype=np.int64) + RANK
small = np.full(7, RANK, np.int32)
first = pycoll.allreduce(big, algorithm="ring", async_op=True)
second = pycoll.allreduce(small, "max", comm=other, async_op=True)
third = pycoll.allgather(small, comm=other, async_op=True)
ok = int(np.array_equal(second.wait(), np.full(7, P - 1)))
ok += int(np.array_equal(first.wait(), P * np.arange(300_000) + P * (P - 1) // 2))
ok += int(np.array_equal(third.wait(), np.repeat(np.arange(P, dtype=np.int32), 7)))
total = int(pycoll.allreduce(np.array([ok]))[0])
if RANK == 0:
    print(f"async on {P} ranks: {total} of {3 * P} right", flush=True)
