"""A soak: many mixed collectives back to back, each checked against the oracle, with the
resident set measured, under mpiexec (or in-process with --ranks).

    mpiexec -n 4 python bench/soak.py 10000          # the committed run: bench/results/soak.md
    python bench/soak.py 300 --ranks 3 --warmup 100  # in-process

Every rank draws the same sequence of calls from one seed (collective, algorithm, dtype, op,
count, root), so each rank computes the oracle's answer itself. A warm-up of ``--warmup``
calls of the same mix (checked too) fills pycoll's bounded caches first (1024 prepared call
shapes per communicator, 1024 schedules; the mix has more shapes than that, so they fill and
start over); the resident set (RSS, from /proc/self/statm) is read after it and at the end.
Rank 0 prints one line: calls, wrong results, and the largest RSS growth over the ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import pycoll
from pycoll import oracle
from pycoll.algorithms import families_for
from pycoll.schedule import Collective

DTYPES = [np.int32, np.int64, np.float32, np.float64, np.int8, np.uint16]
OPS = ["sum", "max", "min", "prod", "avg"]
COUNTS = [0, 1, 3, 17, 64, 1000, 4099, 65536]
COLLECTIVES = [Collective.ALLREDUCE, Collective.REDUCE_SCATTER, Collective.ALLGATHER,
               Collective.BROADCAST, Collective.REDUCE, Collective.ALLTOALL]


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def inputs_for(rng, nranks: int, count: int, dtype, op: str) -> list[np.ndarray]:
    values = rng.choice([1, 2] if op == "prod" else [0, 1, 2, 3], size=(nranks, count))
    return [np.ascontiguousarray(values[r].astype(dtype)) for r in range(nranks)]


def one_call(rng, comm) -> bool:
    """Draw one call (the same on every rank), run it, compare with the oracle."""
    p, rank = comm.size, comm.rank
    collective = COLLECTIVES[rng.integers(len(COLLECTIVES))]
    families = families_for(collective) + ["auto"] if collective is not Collective.ALLTOALL \
        else ["direct"]
    algorithm = families[rng.integers(len(families))]
    dtype = DTYPES[rng.integers(len(DTYPES))]
    op = OPS[rng.integers(len(OPS))]
    count = int(COUNTS[rng.integers(len(COUNTS))])
    root = int(rng.integers(p))
    if collective in (Collective.REDUCE_SCATTER, Collective.ALLTOALL, Collective.ALLGATHER):
        count -= count % p
    xs = inputs_for(rng, p, count, dtype, op)
    x = xs[rank]
    if collective is Collective.ALLREDUCE:
        return np.array_equal(pycoll.allreduce(x, op, comm=comm, algorithm=algorithm),
                              oracle.allreduce(xs, op))
    if collective is Collective.REDUCE_SCATTER:
        got = pycoll.reduce_scatter(x, op, comm=comm, algorithm=algorithm)
        return np.array_equal(got, oracle.reduce_scatter(xs, op)[rank])
    if collective is Collective.ALLGATHER:
        shards = [part[: count // p] for part in xs]
        got = pycoll.allgather(shards[rank], comm=comm, algorithm=algorithm)
        return np.array_equal(got, oracle.allgather(shards))
    if collective is Collective.BROADCAST:
        got = pycoll.broadcast(x.copy(), root, comm=comm, algorithm=algorithm)
        return np.array_equal(got, xs[root])
    if collective is Collective.REDUCE:
        got = pycoll.reduce(x, op, root, comm=comm, algorithm=algorithm)
        return got is None if rank != root else np.array_equal(got, oracle.reduce(xs, op, root))
    return np.array_equal(pycoll.alltoall(x, comm=comm), oracle.alltoall(xs)[rank])


def soak(calls: int, seed: int = 7, warmup: int = 3000) -> tuple[int, int, float, float]:
    """Run ``warmup`` then ``calls`` calls on this rank's default communicator; (calls,
    wrong results in all, growth of the resident set over the ``calls``, their seconds)."""
    comm = pycoll.world()
    rng = np.random.default_rng(seed)
    wrong = sum(not one_call(rng, comm) for _ in range(warmup))
    baseline = rss_bytes()
    started = time.perf_counter()
    for _ in range(calls):
        wrong += not one_call(rng, comm)
    growth = rss_bytes() / baseline - 1
    seconds = time.perf_counter() - started
    table = pycoll.allgather(np.array([wrong, growth * 1e6], np.float64), comm=comm)
    table = table.reshape(comm.size, 2)
    return calls, int(table[:, 0].sum()), float(table[:, 1].max() / 1e6), seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("calls", type=int, nargs="?", default=10_000)
    parser.add_argument("--ranks", type=int, help="in-process ranks (default: the MPI job)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=3000, help="calls before measuring")
    args = parser.parse_args()
    if args.ranks is not None:  # --ranks 0 is refused by run_local, not taken for MPI
        results = pycoll.run_local(args.ranks, soak, args.calls, args.seed, args.warmup)
        result, nranks = results[0], args.ranks
    else:
        result, nranks = soak(args.calls, args.seed, args.warmup), pycoll.world().size
        if pycoll.world().rank != 0:
            return 0
    calls, wrong, growth, seconds = result
    print(f"soak: {calls} collectives on {nranks} ranks in {seconds:.1f} s (after "
          f"{args.warmup} to warm up), {wrong} wrong, resident set growth {growth:+.2%} "
          "(largest over the ranks)", flush=True)
    return 1 if wrong else 0  # a wrong result fails the run (mpiexec reports rank 0's exit)


if __name__ == "__main__":
    sys.exit(main())
