"""Bad input gets a clear error naming the argument, on every rank; no rank hangs."""

from __future__ import annotations

import functools
import re
import time
from pathlib import Path

import numpy as np
import pytest

import pycoll


def every_rank(nranks, call):
    """Run ``call`` on every rank and return what each rank raised."""

    def body():
        try:
            call(pycoll.world().rank)
        except Exception as error:  # the test inspects every rank's error
            return error
        return None

    return pycoll.run_local(nranks, body)


X = np.arange(8, dtype=np.int32)

BAD_CALLS = [
    (
        "out dtype",
        lambda r: pycoll.allreduce(X, out=np.empty(8, np.float32)),
        TypeError,
        r"out.dtype=float32 but x.dtype=int32",
    ),
    (
        "out shape",
        lambda r: pycoll.allreduce(X, out=np.empty(9, np.int32)),
        ValueError,
        r"out.shape=\(9,\); allowed: \(8,\)",
    ),
    (
        "read-only out",
        lambda r: pycoll.allreduce(X, out=_read_only()),
        ValueError,
        r"out is read-only",
    ),
    ("out the wrong rows of x", lambda r: _next_ranks_rows(r), ValueError,
     r"out overlaps x; allowed: separate arrays, or out as this rank's rows of x "
     r"\(out = x\[\d:\d\], in place\)"),
    (
        "non-contiguous",
        lambda r: pycoll.allreduce(np.arange(16)[::2]),
        ValueError,
        r"x is not C-contiguous",
    ),
    # numpy.ascontiguousarray(out), as said for x, would be filled and out not
    ("non-contiguous out", lambda r: pycoll.recv(np.empty(16)[::2], src=(r + 1) % 4),
     ValueError, r"^recv: out is not C-contiguous \(strides \(16,\)\); pass a C-contiguous "
     r"array \(numpy.empty\(out.shape, out.dtype\)\) and copy it into yours after$"),
    ("non-contiguous out of a collective", lambda r: pycoll.allreduce(
        X, out=np.empty((8, 2), np.int32)[:, 0]), ValueError,
     r"^allreduce: out is not C-contiguous .* and copy it into yours after$"),
    (
        "not an array",
        lambda r: pycoll.allreduce([1, 2, 3]),
        TypeError,
        r"x is a list; allowed: a numpy.ndarray",
    ),
    ("bool dtype", lambda r: pycoll.allreduce(np.ones(3, bool)), TypeError,
     r"^allreduce: x.dtype='bool' is not supported; allowed: int8, "),
    ("out of no supported dtype", lambda r: pycoll.recv(np.empty(3, object), src=(r + 1) % 4),
     TypeError, r"^recv: out.dtype='object' is not supported; allowed: int8, "),
    ("other byte order", lambda r: pycoll.allgather(np.ones(3, ">f4")), TypeError,
     r"^allgather: x.dtype='>f4' is not supported \(float32 in the other byte order: convert "
     r"with .astype\('float32'\)\); allowed: int8, "),
    (
        "root range",
        lambda r: pycoll.broadcast(X.copy(), root=4),
        ValueError,
        r"root=4 is not a rank; allowed: 0..3",
    ),
    (
        "root negative",
        lambda r: pycoll.reduce(X, root=-1),
        ValueError,
        r"root=-1 is not a rank; allowed: 0..3",
    ),
    (
        "counts sum",
        lambda r: pycoll.reduce_scatter(X, counts=[1, 2, 3, 1]),
        ValueError,
        r"counts=\[1, 2, 3, 1\] sums to 7 but len\(x\)=8",
    ),
    (
        "counts length",
        lambda r: pycoll.reduce_scatter(X, counts=[4, 4]),
        ValueError,
        r"counts=\[4, 4\] is invalid; allowed: 4 non-negative ints",
    ),
    (
        "not divisible",
        lambda r: pycoll.reduce_scatter(np.arange(7)),
        ValueError,
        r"len\(x\)=7 does not divide by the 4 ranks",
    ),
    ("op name", lambda r: pycoll.allreduce(X, "mean"), ValueError, r"op='mean' is not a reduction"),
    (
        "op for dtype",
        lambda r: pycoll.allreduce(np.ones(3, np.complex64), "max"),
        ValueError,
        r"max.*complex64",
    ),
    (
        "unknown algorithm",
        lambda r: pycoll.allreduce(X, algorithm="butterfly"),
        ValueError,
        r"algorithm='butterfly' is not an algorithm family; allowed: 'ring', 'tree'",
    ),
    (
        "family without schedule",
        lambda r: pycoll.broadcast(X.copy(), algorithm="direct"),
        ValueError,
        r"algorithm='direct' has no broadcast schedule; allowed for broadcast:",
    ),
    (
        "send to self",
        lambda r: pycoll.send(X, dst=r),
        ValueError,
        r"dst=\d is not a rank; allowed: 0..3, other than this rank",
    ),
    (
        "bad tag",
        lambda r: pycoll.send(X, dst=(r + 1) % 4, tag=-2),
        ValueError,
        r"tag=-2 is invalid",
    ),
    (
        "alltoall divisibility",
        lambda r: pycoll.alltoall(np.arange(6)),
        ValueError,
        r"len\(x\)=6 does not divide by the 4 ranks",
    ),
]


def _next_ranks_rows(rank):
    """An in-place ReduceScatter into the next rank's rows of x: not this rank's."""
    x = X.copy()
    start = (2 * rank + 2) % 8
    return pycoll.reduce_scatter(x, out=x[start:start + 2])


def _read_only():
    out = np.zeros(8, np.int32)
    out.flags.writeable = False
    return out


@pytest.mark.parametrize("name,call,kind,message", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_on_every_rank(name, call, kind, message):
    errors = every_rank(4, call)
    for rank, error in enumerate(errors):
        assert isinstance(error, kind), f"rank {rank}: {error!r}"
        assert re.search(message, str(error)), f"rank {rank}: {error}"


ASYNC_CALLS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall",
               "alltoallv", "send", "recv")


@pytest.mark.parametrize("name,call,kind,message", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_at_an_async_call_as_at_a_blocking_one(monkeypatch, name, call, kind,
                                                               message):
    """Not at wait(): a rank whose Work is waited late, or never, would go on a collective
    behind its peers."""
    for collective in ASYNC_CALLS:
        blocking = getattr(pycoll, collective)
        monkeypatch.setattr(pycoll, collective, functools.partial(blocking, async_op=True))
    for rank, error in enumerate(every_rank(4, call)):
        assert isinstance(error, kind), f"rank {rank}: {error!r}"
        assert re.search(message, str(error)), f"rank {rank}: {error}"


def test_a_rank_whose_count_is_wrong_raises_and_nobody_hangs():
    def body():
        rank = pycoll.world().rank
        return pycoll.allgather(X, counts=[8, 8, 8, 9 if rank == 3 else 8])

    with pytest.raises(ValueError, match=r"counts\[3\]=9 but this rank's x has 8 rows"):
        pycoll.run_local(4, body)


def test_alltoallv_counts_that_disagree_fail_on_every_rank():
    def call(rank):
        send_counts = [1, 1, 1]
        recv_counts = [1, 2, 1] if rank == 0 else [1, 1, 1]  # rank 0 expects 2 from rank 1
        pycoll.alltoallv(np.arange(3), send_counts, recv_counts)

    errors = every_rank(3, call)
    for error in errors:
        assert isinstance(error, ValueError)
        assert "rank 1 sends 1 rows to rank 0 (its send_counts[0]) but rank 0 expects 2" in str(
            error
        )


@pytest.mark.parametrize("nranks", [2, 3, 5])
def test_alltoallv_every_rank_names_the_first_disagreement(nranks):
    """Only some ranks give recv_counts, several pairs disagree: every rank raises for the
    first (receiver, sender) pair, and no rank waits in the data exchange."""
    def call(rank):
        send_counts = [1] * nranks
        recv_counts = [1] * nranks
        if rank == nranks - 1:
            recv_counts[0] = 3  # the first disagreeing pair: rank 0 -> rank nranks-1
        if rank == nranks - 1 or rank % 2:
            pycoll.alltoallv(np.arange(nranks), send_counts, recv_counts)
        else:
            send_counts[-1] = 0 if rank else 1  # rank 0 sends 1 as expected; others send 0
            pycoll.alltoallv(np.arange(sum(send_counts)), send_counts)

    want = (f"rank 0 sends 1 rows to rank {nranks - 1} (its send_counts[{nranks - 1}]) but "
            f"rank {nranks - 1} expects 3")
    for error in every_rank(nranks, call):
        assert isinstance(error, ValueError) and want in str(error), error


def test_one_rank_raising_releases_the_others():
    def body():
        rank = pycoll.world().rank
        out = np.empty(8, np.float32 if rank == 0 else np.int32)  # only rank 0 is wrong
        return pycoll.allreduce(X, out=out, algorithm="ring")

    started = time.monotonic()
    with pytest.raises(TypeError, match="out.dtype=float32"):
        pycoll.run_local(4, body)
    assert time.monotonic() - started < 10


def test_a_rank_that_skips_a_collective_is_a_reported_deadlock():
    def body():
        if pycoll.world().rank != 2:
            pycoll.allreduce(X, algorithm="ring")

    with pytest.raises(pycoll.Deadlock, match="rank 2 already returned|waits"):
        pycoll.run_local(3, body)


def test_user_exception_propagates_and_others_are_released():
    def body():
        if pycoll.world().rank == 1:
            raise KeyError("boom")
        pycoll.barrier()

    with pytest.raises(KeyError, match="boom"):
        pycoll.run_local(4, body)


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("sent,expected", [(5, 4), (4, 5), (0, 3)])
def test_a_message_of_another_size_fails_its_receive_alone(sent, expected, async_op):
    """As under MPI: the receive raises (worded as the MPI transport's), the send completes,
    and a program that catches the error goes on with the same communicator (in-process the
    whole run failed, the sender's call too)."""
    def body():
        rank = pycoll.world().rank
        told = None
        try:
            if rank == 0:
                pycoll.send(np.arange(sent, dtype=np.float64), dst=1, async_op=async_op)
            else:
                work = pycoll.recv(np.zeros(expected), src=0, async_op=async_op)
                if async_op:
                    work.wait()
        except ValueError as error:
            told = str(error)
        if rank == 0:
            pycoll.send(np.array([7.0]), dst=1, tag=3)
            after = None
        else:
            after = pycoll.recv(np.zeros(1), src=0, tag=3)[0]
        return told, after, pycoll.allreduce(np.array([rank]))[0]

    (sender_told, _, total0), (told, after, total1) = pycoll.run_local(2, body)
    assert sender_told is None
    got = "the message is longer" if sent > expected else f"received {8 * sent}"
    assert told == (f"rank 1 expects {8 * expected} bytes from rank 0 (tag 0) and {got}; "
                    "the ranks disagree on counts")
    assert after == 7.0 and total0 == total1 == 1


def test_a_receive_of_another_size_gets_what_fits_as_under_mpi():
    def body():
        if pycoll.world().rank == 0:
            pycoll.send(np.arange(1.0, 3.0), dst=1)
            return None
        buffer = np.zeros(3)
        with pytest.raises(ValueError, match="received 16"):
            pycoll.recv(buffer, src=0)
        return buffer.tolist()

    assert pycoll.run_local(2, body)[1] == [1.0, 2.0, 0.0]


def test_uncaught_mismatched_sizes_end_the_run():
    def body():
        rank = pycoll.world().rank
        x = np.zeros(4 if rank else 5)
        if rank == 0:
            pycoll.send(x, dst=1)
        else:
            pycoll.recv(x, src=0)

    with pytest.raises(ValueError, match="rank 1 expects 32 bytes from rank 0 .tag 0. and the "
                       "message is longer"):
        pycoll.run_local(2, body)


@pytest.mark.parametrize("nranks", [0, -1, 2.5, True, np.int64(0)])
def test_run_local_rejects_bad_rank_counts(nranks):
    with pytest.raises(ValueError, match="is not a rank count"):
        pycoll.run_local(nranks, lambda: None)


def test_run_local_takes_a_numpy_rank_count():
    assert pycoll.run_local(np.int64(2), lambda: pycoll.world().size) == [2, 2]


def test_the_reliability_doc_tables_every_bad_call():
    """docs/reliability.md's table of bad input names exactly the cases tested above."""
    doc = (Path(__file__).parent.parent / "docs" / "reliability.md").read_text()
    table = doc.split("## Bad input", 1)[1].split("Settings and communicators", 1)[0]
    rows = [line for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| bad input")]
    assert [row.split("|")[1].strip() for row in rows] == [name for name, *_ in BAD_CALLS]
    # and quotes rank 0's message as it is (two had gone stale)
    for row, (name, call, kind, _) in zip(rows, BAD_CALLS):
        quoted = row.rsplit("|", 2)[1].strip()
        raised = every_rank(4, call)[0]
        assert quoted == f"`{kind.__name__}`: {raised}", name


@pytest.mark.parametrize("call,kind,message", [
    (lambda: pycoll.allreduce(np.matrix([[1, 2]])), TypeError,
     r"allreduce: x is a numpy.matrix; allowed: a numpy.ndarray \(pass numpy.asarray\(x\)\)"),
    (lambda: pycoll.allreduce(np.ma.masked_array([1, 2], mask=[0, 1])), TypeError,
     r"allreduce: x is a numpy\.ma(\.core)?\.MaskedArray; allowed: a numpy.ndarray"),
    # a dict was read as its keys (named as counts[0]=0)
    (lambda: pycoll.reduce_scatter(np.arange(2), counts={0: 1, 1: 1}), ValueError,
     r"counts=\{0: 1, 1: 1\} is invalid; allowed: 2 non-negative ints"),
    # send_counts is alltoallv's whole point: None split evenly (as alltoall), and once named
    # a counts= it does not take
    (lambda: pycoll.alltoallv(np.arange(7), None), ValueError,
     r"alltoallv: send_counts=None is invalid; allowed: 2 non-negative ints, one per rank "
     r"\(or alltoall\(x\) for even rows\)"),
    (lambda: pycoll.alltoallv(np.arange(4), None), ValueError, r"send_counts=None is invalid"),
    # an iterator's values were read once, so the check for ints saw none (2.5 ran as 2)
    (lambda: pycoll.reduce_scatter(np.arange(4), counts=iter([1.5, 2.5])), ValueError,
     r"counts=<list_iterator object at .*> is invalid; allowed: 2 non-negative ints"),
    (lambda: pycoll.reduce_scatter(np.arange(4), counts=np.array([1.5, 2.5])), ValueError,
     r"counts=array\(\[1.5, 2.5\]\) is invalid"),  # as given, not as listed
    (lambda: pycoll.reduce_scatter(np.arange(2), counts=[True, True]), ValueError,
     r"counts=\[True, True\] is invalid; allowed: 2 non-negative ints"),
    (lambda: pycoll.reduce_scatter(np.arange(2), counts=[1.0, 1.0]), ValueError,
     r"counts=\[1.0, 1.0\] is invalid; allowed: 2 non-negative ints"),
    (lambda: pycoll.empty(2.5), ValueError,
     r"empty: shape=2.5 is invalid; allowed: an int >= 0 or a tuple of them"),
    (lambda: pycoll.empty(None), ValueError, r"empty: shape=None is invalid"),
    (lambda: pycoll.empty(3, "bool"), TypeError,  # it named no call
     r"^empty: dtype='bool' is not supported; allowed: int8, "),
])
@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_arrays_and_arguments_that_only_look_right_are_named(call, kind, message):
    """A matrix broadcast into a raw numpy error, a masked array lost its mask, bools and
    floats passed as counts, and empty(2.5) raised 'float object is not iterable'."""
    errors = pycoll.run_local(2, lambda: every_rank_raises(call))
    for error in errors:
        assert isinstance(error, kind) and re.search(message, str(error)), repr(error)


def every_rank_raises(call):
    try:
        call()
    except Exception as error:  # the test inspects it
        return error
    return None


@pytest.mark.parametrize("name,value,allowed", [
    ("PYCOLL_SHM_CMA", "yes", "0 or 1"), ("PYCOLL_FORWARD", "yes", "0 or 1"),
    ("PYCOLL_CUDA_AWARE_MPI", "yes", "0 or 1"), ("PYCOLL_KERNELS", "foo", "cupy, numba"),
    ("PYCOLL_SHM_RING_BYTES", "1000", "an int in 16384"),
    ("PYCOLL_DEVICE_TRANSPORT", "foo", "auto, ipc, staged")])
def test_every_bad_setting_is_refused_when_ranks_are_made(monkeypatch, name, value, allowed):
    """Settings read only on the path that uses them went unnoticed on every other (a numpy
    program over the default transport, or one rank under mpiexec while its peers waited)."""
    monkeypatch.setenv(name, value)
    called = []
    with pytest.raises(ValueError, match=f"{name}='{value}' is .*allowed: {allowed}"):
        pycoll.run_local(2, lambda: called.append(pycoll.allreduce(np.ones(2))))
    assert called == []


def test_alltoall_takes_algorithm_as_every_collective_does():
    """alltoall(x, algorithm='direct') was a bare TypeError (no such keyword), though the
    README says every collective takes a family and names one it has no schedule for."""
    x = np.arange(6.0)

    def body():
        rank = pycoll.world().rank
        mine = x + 10 * rank
        results = [pycoll.alltoall(mine, algorithm="direct"),
                   pycoll.alltoallv(mine, [3, 3], algorithm="direct"),
                   pycoll.alltoall(mine, algorithm="direct", async_op=True).wait()]
        said = []
        for call in (lambda: pycoll.alltoall(mine, algorithm="ring"),
                     lambda: pycoll.alltoallv(mine, [3, 3], algorithm="ring", async_op=True)):
            with pytest.raises(ValueError) as error:
                call()
            said.append(str(error.value))
        return results, said

    for rank, (results, said) in enumerate(pycoll.run_local(2, body)):
        want = np.concatenate([x[3 * rank:3 * rank + 3], x[3 * rank:3 * rank + 3] + 10])
        assert all(np.array_equal(r, want) for r in results), rank
        assert said == [f"{name}: algorithm='ring' has no alltoall schedule; allowed for "
                        "alltoall: 'direct'" for name in ("alltoall", "alltoallv")]


def test_a_result_too_large_to_allocate_is_named():
    """Rank 1's x had 2 rows and counts said 2**48 (beyond any address space: no allocator
    grants it): rank 1 named it, and rank 0, sizing its result first, raised numpy's bare
    "Unable to allocate 1.00 PiB"."""
    def body():
        with pytest.raises((MemoryError, ValueError)) as error:
            pycoll.allgather(np.zeros(2, np.int32), counts=[2, 2**48])
        return str(error.value)

    said = pycoll.run_local(2, body)
    assert said[0].startswith("allgather: the result, shape (281474976710658,) of int32 "
                              "(1.05e+06 GiB), cannot be allocated here"), said[0]
    assert said[1].startswith("allgather: counts[1]=281474976710656 but this rank's x has 2 rows")
