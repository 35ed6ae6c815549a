"""A small AllReduce called back to back (no barrier between calls, as nccl-tests and most
training loops call it), against native MPI and against its floor in Python: one mpi4py
Sendrecv and one numpy add, which is all a 2-rank 8-byte AllReduce moves and computes.

    PYCOLL_HOST_TRANSPORT=mpi mpiexec -n 2 python bench/back_to_back.py [ROUNDS] [COUNT]

Each figure is the median over ROUNDS of the mean time of 20000 calls (µs); the three
alternate within each round, so that all meet the same machine. ``pycoll bench`` times each
call between barriers instead, which adds the barrier's exit skew to both sides.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

import pycoll

CALLS = 20000


def main(rounds: int = 5, count: int = 2) -> None:
    world = MPI.COMM_WORLD
    if world.size != 2:
        sys.exit("run with mpiexec -n 2")
    comm = pycoll.world()
    x = np.ones(count, np.float32)
    out, incoming = np.empty_like(x), np.empty_like(x)
    peer, duplicate, byte = 1 - world.rank, world.Dup(), MPI.BYTE

    def floor() -> None:
        duplicate.Sendrecv((x, x.nbytes, byte), peer, 0, (incoming, x.nbytes, byte), peer, 0)
        np.add(x, incoming, out=out)

    calls = {
        "native": lambda: world.Allreduce(x, out),
        "pycoll": lambda: pycoll.allreduce(x, out=out, comm=comm),
        "Sendrecv + add": floor,
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            world.Barrier()
            start = time.perf_counter()
            for _ in range(CALLS):
                call()
            times[name].append((time.perf_counter() - start) / CALLS * 1e6)
    if world.rank == 0:
        native = statistics.median(times["native"])
        print(f"AllReduce of {x.nbytes} B on 2 ranks, back to back, median of {rounds} rounds:")
        for name, seconds in times.items():
            median = statistics.median(seconds)
            print(f"{name:>15}: {median:6.2f} us  ({median / native:.2f} x native)")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
