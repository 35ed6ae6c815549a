"""The agreement check (PYCOLL_CHECK=1): ranks that agree run as before; ranks that disagree
on any argument, or that skip a collective, all raise CollectiveMismatch naming the field and
who holds which value, instead of a wrong result or a hang."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import exact_input

import pycoll
from pycoll import oracle

NRANKS = 3


@pytest.fixture(autouse=True, params=["auto", "shm"])
def checked(request, monkeypatch):
    """The check over both exchanges: a direct AllGather (threads' rendezvous transport) and
    the shared-memory slots."""
    monkeypatch.setenv("PYCOLL_CHECK", "1")
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", request.param)


def run(fn):
    return pycoll.run_local(NRANKS, lambda: fn(pycoll.world().rank))


def mismatch_on_every_rank(fn) -> list[str]:
    def body(rank):
        try:
            fn(rank)
        except pycoll.CollectiveMismatch as error:
            return str(error)
        return "no error"

    return run(body)


def test_agreeing_ranks_get_the_oracle():
    inputs = [exact_input(r, 12, np.dtype(np.int32), "sum") for r in range(NRANKS)]

    def body(rank):
        x = inputs[rank]
        return (pycoll.allreduce(x), pycoll.reduce_scatter(x, counts=[5, 0, 7]),
                pycoll.allgather(x[: rank + 1], counts=[1, 2, 3]), pycoll.broadcast(x.copy(), 2),
                pycoll.reduce(x, "max", 1), pycoll.alltoall(x),
                pycoll.alltoallv(x[: 3 * rank], [rank] * 3), pycoll.world().agreements)

    for rank, got in enumerate(run(body)):
        np.testing.assert_array_equal(got[0], oracle.allreduce(inputs, "sum"))
        np.testing.assert_array_equal(got[1], oracle.reduce_scatter(inputs, "sum", [5, 0, 7])[rank])
        np.testing.assert_array_equal(got[2], np.concatenate([x[: r + 1]
                                                              for r, x in enumerate(inputs)]))
        np.testing.assert_array_equal(got[3], inputs[2])
        assert (got[4] is None) == (rank != 1)
        np.testing.assert_array_equal(got[5], oracle.alltoall(inputs)[rank])
        assert got[7] >= 7  # each collective was checked (alltoallv: its counts exchange too)


@pytest.mark.parametrize("name,call,field,values", [
    ("dtype", lambda r: pycoll.allreduce(np.ones(4, np.float64 if r == 1 else np.float32)),
     "dtype", '"float32" on ranks 0, 2; "float64" on rank 1'),
    ("count", lambda r: pycoll.allreduce(np.ones(4 + (r == 2))),
     "count", "4 on ranks 0, 1; 5 on rank 2"),
    ("op", lambda r: pycoll.allreduce(np.ones(4), "max" if r == 0 else "sum"),
     "op", '"max" on rank 0; "sum" on ranks 1, 2'),
    ("root", lambda r: pycoll.broadcast(np.ones(4), root=r % 2),
     "root", "0 on ranks 0, 2; 1 on rank 1"),
    ("algorithm", lambda r: pycoll.allreduce(np.ones(4), algorithm="ring" if r else "tree"),
     "algorithm", '"tree" on rank 0; "ring" on ranks 1, 2'),
    ("counts", lambda r: pycoll.reduce_scatter(np.ones(6), counts=[2, 2, 2] if r else [3, 3, 0]),
     "counts", "[3, 3, 0] on rank 0; [2, 2, 2] on ranks 1, 2"),
    ("collective", lambda r: (pycoll.reduce if r == 1 else pycoll.allreduce)(np.ones(4)),
     "collective", '"allreduce" on ranks 0, 2; "reduce" on rank 1'),
    ("alltoall count", lambda r: pycoll.alltoall(np.ones(6 if r == 2 else 3)),
     "count", "3 on ranks 0, 1; 6 on rank 2"),
    # alltoallv's counts go by an internal alltoall: it was named, with its int64 pairs
    ("alltoall against alltoallv", lambda r: pycoll.alltoall(np.ones(3)) if r == 0
     else pycoll.alltoallv(np.ones(3), [1, 1, 1]),
     "collective", '"alltoall" on rank 0; "alltoallv" on ranks 1, 2'),
    ("alltoallv dtype", lambda r: pycoll.alltoallv(np.ones(3, np.float32 if r else np.int32),
                                                   [1, 1, 1]),
     "dtype", '"int32" on rank 0; "float32" on ranks 1, 2'),
    # rows of 2 and of 3 elements, 6 elements each: each rank read the others' in its shape
    ("allgather row", lambda r: pycoll.allgather(np.ones((3, 2) if r else (2, 3))),
     "row", "[3] on rank 0; [2] on ranks 1, 2"),
    ("reduce_scatter row", lambda r: pycoll.reduce_scatter(np.ones((3, 4) if r else (6, 2))),
     "row", "[2] on rank 0; [4] on ranks 1, 2"),
])
def test_a_disagreement_is_named_on_every_rank(name, call, field, values):
    errors = mismatch_on_every_rank(call)
    for rank, error in enumerate(errors):
        assert error.startswith(f"rank {rank}: the ranks disagree on collective #1"), error
        assert f"{field}: {values}" in error


def test_a_rank_that_skips_a_collective_is_named_not_waited_for():
    def body(rank):
        pycoll.allreduce(np.ones(2))
        if rank != 1:
            pycoll.allreduce(np.ones(8))  # rank 1 skips this one
        pycoll.allgather(np.ones(2))

    # rank 1's allgather meets the others' second allreduce: named, on every rank
    for error in mismatch_on_every_rank(body):
        assert 'collective: "allreduce" on ranks 0, 2; "allgather" on rank 1' in error
        assert "count: 8 on ranks 0, 2; 6 on rank 1" in error


def test_the_check_can_be_turned_on_per_communicator(monkeypatch):
    monkeypatch.setenv("PYCOLL_CHECK", "0")

    def body(rank):
        comm = pycoll.world()
        assert comm.check is False
        comm.check = True
        try:
            pycoll.allreduce(np.ones(2 + rank))
        except pycoll.CollectiveMismatch as error:
            return "count: 2 on rank 0; 3 on rank 1; 4 on rank 2" in str(error)

    assert run(body) == [True] * NRANKS


def test_turning_the_check_on_waits_for_the_async_calls_before(monkeypatch):
    """Every rank makes the same calls; only timing differs. The async calls queued before
    ``comm.check = True`` run unchecked on every rank, not checked on some (whose agreement
    messages would meet the others' data)."""
    import time

    monkeypatch.setenv("PYCOLL_CHECK", "0")
    monkeypatch.setenv("PYCOLL_TIMEOUT", "10")

    def body(rank):
        comm = pycoll.world()
        first = pycoll.allreduce(np.ones(8), async_op=True)
        second = pycoll.allreduce(np.ones(8), async_op=True)
        if rank == 0:
            time.sleep(0.3)
        comm.check = True
        return first.wait().tolist(), second.wait().tolist()

    assert run(body) == [([float(NRANKS)] * 8,) * 2] * NRANKS
    with pytest.raises(TypeError, match="check=1 is invalid; allowed: True or False"):
        pycoll.world().check = 1
    comm = pycoll.world()
    comm.check = np.True_  # numpy's bools, as async_op takes them
    assert comm.check is True
    comm.check = False


def test_a_bad_setting_is_named(monkeypatch):
    monkeypatch.setenv("PYCOLL_CHECK", "yes")
    with pytest.raises(ValueError, match="PYCOLL_CHECK='yes' is invalid; allowed: 0 or 1"):
        pycoll.run_local(2, lambda: pycoll.allreduce(np.ones(2)))


def test_host_and_device_arrays_in_one_collective_are_named():
    """One rank passing device arrays where the others pass numpy: named, not a hang."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from fake_device import FakeDevice, device_array

    from pycoll import spaces

    fake = FakeDevice(seed=3, name="fake-agree")
    spaces.register(fake)
    try:
        errors = mismatch_on_every_rank(lambda r: pycoll.allreduce(
            device_array(np.ones(8, np.float32)) if r == 1 else np.ones(8, np.float32)))
    finally:
        spaces.unregister(fake)
    for error in errors:
        assert 'memory: "host" on ranks 0, 2; "fake-agree" on rank 1' in error, error


@pytest.mark.parametrize("setting", ["check", "verify"])
def test_a_rank_checking_alone_never_takes_the_checksums_for_data(monkeypatch, setting):
    """comm.check (or comm.verify) set on one rank only: its checksums travelled on the next
    collective's tag, and the other ranks summed them as their peer's data (16 bytes of sums
    for a 2-element float64 AllReduce). Now they travel on tags of their own: an error (the
    threads' Deadlock, or each rank's own), not a wrong sum."""
    monkeypatch.setenv("PYCOLL_CHECK", "0")
    expected = sum(np.arange(2.0) + r for r in range(NRANKS))
    wrong, errors = [], []

    def body(rank):
        comm = pycoll.world()
        comm.timeout = 10
        setattr(comm, setting, rank == 0)
        try:
            for _ in range(3):
                got = pycoll.allreduce(np.arange(2.0) + rank)
                if not np.array_equal(got, expected):
                    wrong.append((rank, got))
        except Exception as error:  # noqa: BLE001 - any error will do
            errors.append(error)

    try:
        run(body)
    except pycoll.Deadlock as error:
        errors.append(error)
    assert not wrong
    assert errors  # the ranks disagree on the call: someone says so


@pytest.mark.parametrize("transport", ["auto", "shm"])
def test_the_check_leaves_the_traffic_counts_alone(monkeypatch, transport):
    """With the check on, comm.traffic counted its AllGather on the message transports (6
    messages for a ring's 4) but not through shared memory: counts to compare with a plan
    depended on the transport."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", transport)

    def body(check: bool):
        comm = pycoll.world()
        comm.check = check
        comm.traffic.reset()
        pycoll.allreduce(np.arange(300.0), algorithm="ring")
        return dict(comm.traffic.messages), dict(comm.traffic.bytes)

    assert pycoll.run_local(3, lambda: body(True)) == pycoll.run_local(3, lambda: body(False))
