"""Hypothesis: random collectives, algorithms, sizes, ops and dtypes against the oracle."""

from __future__ import annotations

import numpy as np
from conftest import ALL_DTYPES, exact_input, ops_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pycoll
from pycoll import oracle, select
from pycoll.algorithms import families_for
from pycoll.schedule import Collective

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def calls(draw):
    collective = draw(
        st.sampled_from(
            [
                Collective.ALLREDUCE,
                Collective.REDUCE_SCATTER,
                Collective.ALLGATHER,
                Collective.BROADCAST,
                Collective.REDUCE,
            ]
        )
    )
    algorithm = draw(st.sampled_from(families_for(collective)))
    nranks = draw(st.integers(1, 9))
    dtype = draw(st.sampled_from(ALL_DTYPES))
    op = draw(st.sampled_from(ops_for(dtype)))
    counts = draw(st.lists(st.integers(0, 20), min_size=nranks, max_size=nranks))
    root = draw(st.integers(0, nranks - 1))
    nsegments = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**16))
    return collective, algorithm, nranks, dtype, op, counts, root, nsegments, seed


@FAST
@given(calls())
def test_any_call_matches_the_oracle(call):
    collective, algorithm, nranks, dtype, op, counts, root, nsegments, seed = call
    total = sum(counts)
    if collective is Collective.ALLGATHER:
        inputs = [exact_input(r, counts[r], dtype, op, seed) for r in range(nranks)]
    else:
        inputs = [exact_input(r, total, dtype, op, seed) for r in range(nranks)]
    run = {
        Collective.ALLREDUCE: lambda x: pycoll.allreduce(x, op, algorithm=algorithm),
        Collective.REDUCE_SCATTER: lambda x: pycoll.reduce_scatter(
            x, op, counts=counts, algorithm=algorithm
        ),
        Collective.ALLGATHER: lambda x: pycoll.allgather(x, counts=counts, algorithm=algorithm),
        Collective.BROADCAST: lambda x: pycoll.broadcast(x.copy(), root, algorithm=algorithm),
        Collective.REDUCE: lambda x: pycoll.reduce(x, op, root, algorithm=algorithm),
    }[collective]
    saved = select.FORCED_SEGMENTS
    select.FORCED_SEGMENTS = nsegments
    try:
        results = pycoll.run_local(nranks, lambda: run(inputs[pycoll.world().rank]))
    finally:
        select.FORCED_SEGMENTS = saved
    for rank, result in enumerate(results):
        if collective is Collective.ALLREDUCE:
            want = oracle.allreduce(inputs, op)
        elif collective is Collective.REDUCE_SCATTER:
            want = oracle.reduce_scatter(inputs, op, counts)[rank]
        elif collective is Collective.ALLGATHER:
            want = oracle.allgather(inputs)
        elif collective is Collective.BROADCAST:
            want = oracle.broadcast(inputs, root)
        else:
            want = oracle.reduce(inputs, op, root) if rank == root else None
        if want is None:
            assert result is None
        else:
            np.testing.assert_array_equal(result, want)


@FAST
@given(st.integers(1, 8), st.data())
def test_any_alltoallv_matches_the_oracle(nranks, data):
    send_counts = data.draw(
        st.lists(
            st.lists(st.integers(0, 5), min_size=nranks, max_size=nranks),
            min_size=nranks,
            max_size=nranks,
        )
    )
    inputs = [np.arange(sum(send_counts[r]), dtype=np.int16) + 50 * r for r in range(nranks)]
    results = pycoll.run_local(
        nranks,
        lambda: pycoll.alltoallv(inputs[pycoll.world().rank], send_counts[pycoll.world().rank]),
    )
    for result, want in zip(results, oracle.alltoallv(inputs, send_counts)):
        np.testing.assert_array_equal(result, want)
