"""Every collective × algorithm against the numpy oracle, on in-process ranks.

Rank counts include 1 and primes; element counts include 0, 1, p−1, p+1 (never divisible by p
for p > 2), a prime and about 100 000. Op and dtype rotate through the matrix so that every
op and every dtype meets every collective somewhere, and the full op × dtype table runs on
AllReduce; integer-valued inputs make every result exact, so equality is bitwise.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import ALL_DTYPES, exact_input, ops_for

import pycoll
from pycoll import oracle
from pycoll.algorithms import families_for
from pycoll.schedule import Collective

RANKS = [1, 2, 3, 4, 5, 7, 8]
LARGE = 100_003


def sizes(nranks: int) -> list[int]:
    return sorted({0, 1, max(nranks - 1, 0), nranks + 1, 13})


def cases(collective: Collective):
    combos = []
    for algorithm in families_for(collective):
        for nranks in RANKS:
            for count in sizes(nranks):
                combos.append((algorithm, nranks, count))
        combos.append((algorithm, 4, LARGE))
        combos.append((algorithm, 7, LARGE))
    return combos


def pick(index: int, reducing: bool):
    """Rotate dtype and op through the matrix, deterministically."""
    dtype = ALL_DTYPES[index % len(ALL_DTYPES)]
    ops = ops_for(dtype)
    return dtype, (ops[(index // len(ALL_DTYPES)) % len(ops)] if reducing else None)


def _identical_everywhere(results) -> None:
    first = results[0].tobytes()
    assert all(r.tobytes() == first for r in results), "ranks hold different bits"


@pytest.mark.parametrize(
    "index,algorithm,nranks,count", [(i, *c) for i, c in enumerate(cases(Collective.ALLREDUCE))]
)
def test_allreduce(index, algorithm, nranks, count):
    dtype, op = pick(index, True)
    inputs = [exact_input(r, count, dtype, op, index) for r in range(nranks)]
    results = pycoll.run_local(
        nranks, lambda: pycoll.allreduce(inputs[pycoll.world().rank], op, algorithm=algorithm)
    )
    expected = oracle.allreduce(inputs, op)
    for result in results:
        np.testing.assert_array_equal(result, expected)
        assert result.dtype == dtype
    _identical_everywhere(results)


@pytest.mark.parametrize(
    "index,algorithm,nranks,count",
    [(i, *c) for i, c in enumerate(cases(Collective.REDUCE_SCATTER))],
)
def test_reduce_scatter(index, algorithm, nranks, count):
    dtype, op = pick(index, True)
    # Uneven shards through counts; the even form when the length divides.
    counts = [len(part) for part in np.array_split(np.arange(count), nranks)][::-1]
    inputs = [exact_input(r, count, dtype, op, index) for r in range(nranks)]
    results = pycoll.run_local(
        nranks,
        lambda: pycoll.reduce_scatter(
            inputs[pycoll.world().rank], op, counts=counts, algorithm=algorithm
        ),
    )
    expected = oracle.reduce_scatter(inputs, op, counts)
    for result, want in zip(results, expected):
        np.testing.assert_array_equal(result, want)


@pytest.mark.parametrize(
    "index,algorithm,nranks,count", [(i, *c) for i, c in enumerate(cases(Collective.ALLGATHER))]
)
def test_allgather(index, algorithm, nranks, count):
    dtype, _ = pick(index, False)
    counts = [len(part) for part in np.array_split(np.arange(count), nranks)]
    inputs = [exact_input(r, counts[r], dtype, "sum", index) for r in range(nranks)]
    results = pycoll.run_local(
        nranks,
        lambda: pycoll.allgather(inputs[pycoll.world().rank], counts=counts, algorithm=algorithm),
    )
    expected = oracle.allgather(inputs)
    for result in results:
        np.testing.assert_array_equal(result, expected)
    _identical_everywhere(results)


def in_place_cases(collective: Collective):
    return [(algorithm, nranks, count) for algorithm in ["auto", *families_for(collective)]
            for nranks in (1, 2, 3, 5, 7) for count in sizes(nranks) + [1000]]


@pytest.mark.parametrize("algorithm,nranks,count", in_place_cases(Collective.REDUCE_SCATTER))
def test_reduce_scatter_in_place(algorithm, nranks, count):
    """NCCL's in place: out is this rank's rows of x (uneven where count does not divide)."""
    dtype, op = pick(count + nranks, True)
    counts = [len(part) for part in np.array_split(np.arange(count), nranks)]
    starts = np.cumsum([0, *counts])
    inputs = [exact_input(r, count, dtype, op, nranks) for r in range(nranks)]

    def body():
        rank = pycoll.world().rank
        x = inputs[rank].copy()
        out = x[starts[rank]:starts[rank + 1]]
        given = None if count % nranks == 0 else counts
        got = pycoll.reduce_scatter(x, op, counts=given, out=out, algorithm=algorithm)
        return got is out, out.copy(), x

    expected = oracle.reduce_scatter(inputs, op, counts)
    for rank, (same, out, x) in enumerate(pycoll.run_local(nranks, body)):
        assert same
        np.testing.assert_array_equal(out, expected[rank])
        rest = np.r_[0:starts[rank], starts[rank + 1]:count]  # the rows of other ranks
        np.testing.assert_array_equal(x[rest], inputs[rank][rest])


@pytest.mark.parametrize("algorithm,nranks,count", in_place_cases(Collective.ALLGATHER))
def test_allgather_in_place(algorithm, nranks, count):
    """NCCL's in place: x is this rank's rows of out."""
    dtype, _ = pick(count + nranks, False)
    counts = [len(part) for part in np.array_split(np.arange(count), nranks)][::-1]
    starts = np.cumsum([0, *counts])
    inputs = [exact_input(r, counts[r], dtype, "sum", count) for r in range(nranks)]

    def body():
        rank = pycoll.world().rank
        out = np.full(count, 7, dtype)  # what other ranks' rows held must not show
        x = out[starts[rank]:starts[rank + 1]]
        x[...] = inputs[rank]
        given = None if count % nranks == 0 else counts  # even: the form without counts
        return pycoll.allgather(x, counts=given, out=out, algorithm=algorithm) is out, out

    for same, out in pycoll.run_local(nranks, body):
        assert same
        np.testing.assert_array_equal(out, oracle.allgather(inputs))


@pytest.mark.parametrize(
    "index,algorithm,nranks,count", [(i, *c) for i, c in enumerate(cases(Collective.BROADCAST))]
)
def test_broadcast(index, algorithm, nranks, count):
    dtype, _ = pick(index, False)
    root = index % nranks
    inputs = [exact_input(r, count, dtype, "sum", index) for r in range(nranks)]

    def body():
        rank = pycoll.world().rank
        x = inputs[rank].copy()
        x.flags.writeable = rank != root  # the root's x is only read, as MPI_Bcast's buffer
        return pycoll.broadcast(x, root, algorithm=algorithm)

    for result in pycoll.run_local(nranks, body):
        np.testing.assert_array_equal(result, oracle.broadcast(inputs, root))


@pytest.mark.parametrize("async_op", [False, True])
def test_a_read_only_x_off_the_root_of_a_broadcast_is_refused(async_op):
    def body():
        x = np.arange(4.0)
        if pycoll.world().rank == 1:  # the root: rank 0 raises before sending it anything
            return True
        x.flags.writeable = False
        with pytest.raises(ValueError, match="^broadcast: x is read-only; the result is "
                                             "written into it$"):
            pycoll.broadcast(x, root=1, async_op=async_op)
        return True

    assert pycoll.run_local(2, body) == [True, True]


@pytest.mark.parametrize(
    "index,algorithm,nranks,count", [(i, *c) for i, c in enumerate(cases(Collective.REDUCE))]
)
def test_reduce(index, algorithm, nranks, count):
    dtype, op = pick(index, True)
    root = (index * 7) % nranks
    inputs = [exact_input(r, count, dtype, op, index) for r in range(nranks)]
    results = pycoll.run_local(
        nranks, lambda: pycoll.reduce(inputs[pycoll.world().rank], op, root, algorithm=algorithm)
    )
    for rank, result in enumerate(results):
        if rank == root:
            np.testing.assert_array_equal(result, oracle.reduce(inputs, op, root))
        else:
            assert result is None


@pytest.mark.parametrize("nranks", RANKS)
@pytest.mark.parametrize("per_peer", [0, 1, 3])
def test_alltoall(nranks, per_peer):
    dtype = ALL_DTYPES[(nranks + per_peer) % len(ALL_DTYPES)]
    inputs = [exact_input(r, nranks * per_peer, dtype, "sum", r) for r in range(nranks)]
    results = pycoll.run_local(nranks, lambda: pycoll.alltoall(inputs[pycoll.world().rank]))
    for result, want in zip(results, oracle.alltoall(inputs)):
        np.testing.assert_array_equal(result, want)


@pytest.mark.parametrize("nranks", RANKS)
def test_alltoallv_uneven_and_empty(nranks):
    rng = np.random.default_rng(nranks)
    send_counts = rng.integers(0, 4, size=(nranks, nranks))
    send_counts[:, 0] = 0  # rank 0 receives nothing: an empty destination
    inputs = [np.arange(send_counts[r].sum(), dtype=np.int32) + 100 * r for r in range(nranks)]

    def body():
        rank = pycoll.world().rank
        given = [int(c) for c in send_counts[:, rank]] if rank % 2 else None
        new = pycoll.alltoallv(inputs[rank], send_counts[rank].tolist(), given)
        # into an out of the caller's (as torch's all_to_all_single), with recv_counts on
        # some ranks and without on others
        out = np.full(int(send_counts[:, rank].sum()), -1, np.int32)
        into = pycoll.alltoallv(inputs[rank], send_counts[rank].tolist(),
                                None if given else send_counts[:, rank].tolist(), out=out)
        return new, into is out and out

    results = pycoll.run_local(nranks, body)
    for (new, out), want in zip(results, oracle.alltoallv(inputs, send_counts.tolist())):
        np.testing.assert_array_equal(new, want)
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("nranks", RANKS)
@pytest.mark.parametrize("async_op", [False, True])
def test_alltoallv_in_place_where_as_many_rows_arrive_as_leave(nranks, async_op):
    """out=x, as alltoall takes it (MPI_IN_PLACE): refused as an overlap before. Circulant
    counts: every rank sends as many rows as it receives, but not to each peer as many as it
    gets from that peer."""
    rng = np.random.default_rng(nranks)
    shifts = rng.integers(0, 4, size=nranks)
    send_counts = [[int(shifts[(j - r) % nranks]) for j in range(nranks)]
                   for r in range(nranks)]
    inputs = [np.arange(sum(send_counts[r]), dtype=np.int64) + 100 * r
              for r in range(nranks)]

    def body():
        rank = pycoll.world().rank
        x = inputs[rank].copy()
        result = pycoll.alltoallv(x, send_counts[rank], out=x, async_op=async_op)
        return (result.wait() if async_op else result) is x and x

    results = pycoll.run_local(nranks, body)
    for got, want in zip(results, oracle.alltoallv(inputs, send_counts)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("nranks", [2, 3])
def test_an_alltoallv_out_of_other_rows_fails_on_every_rank(nranks):
    """Without recv_counts, out's rows are known right only after the counts' exchange:
    the ranks agree on it, so none waits in the data exchange for a rank that raised."""

    def body():
        rank = pycoll.world().rank
        try:
            pycoll.alltoallv(np.arange(nranks), [1] * nranks,
                             out=np.empty(nranks + (rank == nranks - 1), np.int64))
        except ValueError as error:
            return str(error)
        return "no error"

    assert pycoll.run_local(nranks, body) == [
        f"alltoallv: rank {nranks - 1}'s out has {nranks + 1} rows but {nranks} arrive "
        f"(send_counts[{nranks - 1}] of every rank, summed); they must be equal"] * nranks


@pytest.mark.parametrize("given", [False, True])
@pytest.mark.parametrize("nranks", [1, 2, 5, 16])
def test_alltoallv_counts_exchange_is_linear_in_ranks(nranks, given):
    """Learning the counts sends one (count, checking) pair to each peer, plus, where
    recv_counts are given, one small AllReduce: no rank moves a table of every rank's counts."""
    def body():
        comm = pycoll.world()
        comm.traffic.reset()
        pycoll.alltoallv(np.zeros(0, np.int8), [0] * nranks, [0] * nranks if given else None)
        return sum(comm.traffic.bytes.values())

    for moved in pycoll.run_local(nranks, body):
        assert moved <= 16 * (nranks - 1) + (8 * 2 * (nranks - 1) if given else 0)


@pytest.mark.parametrize("nranks", [2, 3, 5])
@pytest.mark.parametrize("count", [0, 1, 1000])
def test_send_recv(nranks, count):
    payloads = [np.arange(count, dtype=np.float32) + r for r in range(nranks)]

    def body():
        rank, size = pycoll.world().rank, pycoll.world().size
        # Each rank passes to the next; even ranks send first so no pair waits on itself.
        received = np.full(count, -1, np.float32)
        if rank % 2 == 0:
            pycoll.send(payloads[rank], (rank + 1) % size, tag=7)
            pycoll.recv(received, (rank - 1) % size, tag=7)
        else:
            pycoll.recv(received, (rank - 1) % size, tag=7)
            pycoll.send(payloads[rank], (rank + 1) % size, tag=7)
        return received

    results = pycoll.run_local(nranks, body)
    for rank, result in enumerate(results):
        np.testing.assert_array_equal(result, payloads[(rank - 1) % nranks])


def test_an_empty_message_is_a_message():
    """As in MPI: an empty receive waits for its empty send (a token), and takes that send,
    not the next message on the tag; a message too long for it is an error."""
    import time

    def token_then_message():
        rank = pycoll.world().rank
        if rank == 0:
            time.sleep(0.3)
            pycoll.send(np.empty(0, np.float32), 1, tag=9)
            pycoll.send(np.full(2, 5.0), 1, tag=9)
            return None
        start = time.monotonic()
        pycoll.recv(np.empty((0, 3)), 0, tag=9)  # any dtype and shape of no elements
        return time.monotonic() - start, pycoll.recv(np.empty(2), 0, tag=9)[0]

    waited, after = pycoll.run_local(2, token_then_message)[1]
    assert waited >= 0.25 and after == 5.0

    def too_long():
        if pycoll.world().rank == 0:
            pycoll.send(np.full(2, 6.0), 1, tag=9)
        else:
            pycoll.recv(np.empty(0), 0, tag=9)

    with pytest.raises(ValueError, match="rank 1 expects 0 bytes from rank 0 .tag 9. and the "
                       "message is longer"):
        pycoll.run_local(2, too_long)


def _allreduce_own_row(inputs, op, algorithm):
    return pycoll.allreduce(inputs[pycoll.world().rank], op, algorithm=algorithm)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("algorithm", families_for(Collective.ALLREDUCE))
def test_allreduce_every_op_and_dtype(dtype, algorithm):
    nranks, count = 3, 11
    for op in ops_for(dtype):
        inputs = [exact_input(r, count, dtype, op) for r in range(nranks)]
        results = pycoll.run_local(nranks, _allreduce_own_row, inputs, op, algorithm)
        for result in results:
            np.testing.assert_array_equal(result, oracle.allreduce(inputs, op), err_msg=op)


@pytest.mark.parametrize(
    "collective,algorithm",
    [
        (c, a)
        for c in (
            Collective.ALLREDUCE,
            Collective.REDUCE_SCATTER,
            Collective.ALLGATHER,
            Collective.BROADCAST,
            Collective.REDUCE,
        )
        for a in families_for(c)
    ],
)
@pytest.mark.parametrize("nsegments", [2, 5])
def test_many_segments(collective, algorithm, nsegments, segments):
    """Shrunk segments, as Gloo's tests do, so a small run still crosses many segments."""
    segments(nsegments)
    nranks, count = 5, 37
    inputs = [exact_input(r, count, np.dtype(np.int64), "sum") for r in range(nranks)]
    calls = {
        Collective.ALLREDUCE: lambda x: pycoll.allreduce(x, algorithm=algorithm),
        Collective.REDUCE_SCATTER: lambda x: pycoll.reduce_scatter(
            x, counts=[8, 7, 8, 7, 7], algorithm=algorithm
        ),
        Collective.ALLGATHER: lambda x: pycoll.allgather(x, algorithm=algorithm),
        Collective.BROADCAST: lambda x: pycoll.broadcast(x.copy(), 2, algorithm=algorithm),
        Collective.REDUCE: lambda x: pycoll.reduce(x, "sum", 3, algorithm=algorithm),
    }
    results = pycoll.run_local(nranks, lambda: calls[collective](inputs[pycoll.world().rank]))
    total = oracle.allreduce(inputs, "sum")
    for rank, result in enumerate(results):
        if collective is Collective.ALLREDUCE:
            np.testing.assert_array_equal(result, total)
        elif collective is Collective.REDUCE_SCATTER:
            np.testing.assert_array_equal(
                result, oracle.reduce_scatter(inputs, "sum", [8, 7, 8, 7, 7])[rank]
            )
        elif collective is Collective.ALLGATHER:
            np.testing.assert_array_equal(result, oracle.allgather(inputs))
        elif collective is Collective.BROADCAST:
            np.testing.assert_array_equal(result, inputs[2])
        elif rank == 3:
            np.testing.assert_array_equal(result, total)


def test_in_place_and_out():
    def body():
        rank = pycoll.world().rank
        x = np.arange(10, dtype=np.int32) * (rank + 1)
        out = np.empty_like(x)
        assert pycoll.allreduce(x, out=out, algorithm="ring") is out
        same = pycoll.allreduce(x, out=x, algorithm="direct")  # reads INPUT: must still be exact
        assert same is x
        return out, x

    for out, x in pycoll.run_local(3, body):
        np.testing.assert_array_equal(out, np.arange(10) * 6)
        np.testing.assert_array_equal(x, np.arange(10) * 6)


def test_two_dimensional_rows():
    def body():
        rank = pycoll.world().rank
        x = np.full((4, 3), rank + 1, np.float32)
        shard = pycoll.reduce_scatter(x)
        gathered = pycoll.allgather(shard)
        return shard.shape, gathered

    for shape, gathered in pycoll.run_local(2, body):
        assert shape == (2, 3)
        np.testing.assert_array_equal(gathered, np.full((4, 3), 3, np.float32))


def test_back_to_back_collectives_do_not_mix():
    def body():
        rank = pycoll.world().rank
        results = []
        for i, algorithm in itertools.product(range(5), ("ring", "tree", "direct")):
            results.append(pycoll.allreduce(np.full(6, rank + i, np.int64), algorithm=algorithm))
        pycoll.barrier()
        return results

    for results in pycoll.run_local(4, body):
        for (i, _), result in zip(itertools.product(range(5), range(3)), results):
            np.testing.assert_array_equal(result, np.full(6, 6 + 4 * i))


def test_world_outside_run_local_is_one_rank():
    x = np.arange(5.0)
    np.testing.assert_array_equal(pycoll.allreduce(x), x)
    assert pycoll.world().size == 1 and pycoll.world().rank == 0


@pytest.mark.parametrize("collective,algorithm", [
    (c, a) for c in ("allreduce", "reduce_scatter", "reduce")
    for a in ("auto", *families_for(Collective(c))) if not a.startswith("hierarchical")])
def test_a_float_overflow_gives_inf_on_every_rank_where_numpy_would_raise(collective, algorithm):
    """Under np.errstate(over="raise") (or warnings as errors) numpy raised on the ranks
    whose piece overflowed, and only there: the others waited for them (a deadlock in-process,
    crossed messages under MPI). The sum is inf everywhere, as MPI and NCCL give."""

    def body():
        rank = pycoll.world().rank
        x = np.full(9, 3e38 if rank < 2 else 1.0, np.float32)
        with np.errstate(all="raise"):
            got = getattr(pycoll, collective)(x, algorithm=algorithm)
        after = pycoll.allreduce(np.array([rank]))  # the communicator still works
        return got, int(after[0])

    results = pycoll.run_local(3, body)
    for rank, (got, after) in enumerate(results):
        if collective != "reduce" or rank == 0:
            assert np.isinf(got).all(), (rank, got)
        assert after == 3


@pytest.mark.parametrize("nranks", [2, 3])
def test_a_small_allreduce_overflowing_gives_inf_where_numpy_would_raise(nranks, monkeypatch):
    """The one-shot sum over shared memory (two ranks call the ufunc directly) gives inf too,
    not an error."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")

    def body():
        with np.errstate(all="raise"):
            got = pycoll.allreduce(np.full(4, 3e38, np.float32))
        return got, pycoll.world().one_shot() is not None

    for got, one_shot in pycoll.run_local(nranks, body):
        assert one_shot and np.isinf(got).all(), got
