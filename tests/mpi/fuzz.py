"""Run under mpiexec: hypothesis draws collectives against the oracle, every rank the same
draws (derandomized, no example database), each example's verdict agreed by all ranks so that
they stay in step; no shrinking (ranks would shrink apart). Rank 0 prints a summary line."""

from __future__ import annotations

import sys

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

import pycoll
from pycoll import oracle
from pycoll.algorithms import families_for
from pycoll.schedule import Collective

comm = pycoll.world()
P, RANK = comm.size, comm.rank
DTYPES = [np.int8, np.int32, np.int64, np.uint16, np.float32, np.float64]
COLLECTIVES = [Collective.ALLREDUCE, Collective.REDUCE_SCATTER, Collective.ALLGATHER,
               Collective.BROADCAST, Collective.REDUCE]
examples = failures = 0


@st.composite
def calls(draw):
    collective = draw(st.sampled_from(COLLECTIVES))
    algorithm = draw(st.sampled_from([*families_for(collective), "auto"]))
    dtype = draw(st.sampled_from(DTYPES))
    op = draw(st.sampled_from(["sum", "prod", "min", "max", "avg"]))
    counts = draw(st.lists(st.integers(0, 300), min_size=P, max_size=P))
    root = draw(st.integers(0, P - 1))
    seed = draw(st.integers(0, 2**16))
    return collective, algorithm, dtype, op, counts, root, seed


def inputs(count_of, dtype, op, seed):
    rng = np.random.default_rng(seed)
    values = [1, 2] if op == "prod" else [0, 1, 2, 3]
    return [rng.choice(values, size=count_of(r)).astype(dtype) for r in range(P)]


def check(call) -> bool:
    collective, algorithm, dtype, op, counts, root, seed = call
    total = sum(counts)
    if collective is Collective.ALLGATHER:
        xs = inputs(lambda r: counts[r], dtype, op, seed)
        got = pycoll.allgather(xs[RANK], counts=counts, algorithm=algorithm)
        return np.array_equal(got, oracle.allgather(xs))
    xs = inputs(lambda r: total, dtype, op, seed)
    if collective is Collective.ALLREDUCE:
        return np.array_equal(pycoll.allreduce(xs[RANK], op, algorithm=algorithm),
                              oracle.allreduce(xs, op))
    if collective is Collective.REDUCE_SCATTER:
        got = pycoll.reduce_scatter(xs[RANK], op, counts=counts, algorithm=algorithm)
        return np.array_equal(got, oracle.reduce_scatter(xs, op, counts)[RANK])
    if collective is Collective.BROADCAST:
        got = pycoll.broadcast(xs[RANK].copy(), root, algorithm=algorithm)
        return np.array_equal(got, xs[root])
    got = pycoll.reduce(xs[RANK], op, root, algorithm=algorithm)
    return got is None if RANK != root else np.array_equal(got, oracle.reduce(xs, op, root))


@settings(max_examples=int(sys.argv[1]) if len(sys.argv) > 1 else 100, deadline=None,
          derandomize=True, database=None, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(calls())
def fuzz(call):
    global examples, failures
    ok = check(call)
    agreed = MPI.COMM_WORLD.allreduce(int(ok), op=MPI.MIN)  # one verdict for every rank
    examples += 1
    if not agreed:
        failures += 1
        if RANK == 0:
            print(f"FAILED: {call}", flush=True)


fuzz()
if RANK == 0:
    print(f"fuzz on {P} ranks: {examples} examples, {failures} failed", flush=True)
sys.exit(1 if failures else 0)
