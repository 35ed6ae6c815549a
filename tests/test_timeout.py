"""Deadlines: a collective that waits longer than the communicator's timeout raises
CollectiveTimeout naming the collective, algorithm, step and the peer it waits for, on every
transport; the communicator is then broken and later calls fail at once."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import pycoll

TRANSPORTS = ["auto", "shm"]  # in-process: the rendezvous transport, shared memory


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("size", [3, 30_000])  # the one-shot AllReduce, and a schedule
@pytest.mark.parametrize("check", ["0", "1"])  # PYCOLL_CHECK: the wait is the agreement's
def test_a_rank_that_never_comes_is_named(monkeypatch, transport, size, check):
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", transport)
    monkeypatch.setenv("PYCOLL_CHECK", check)
    gate = threading.Barrier(3)

    def body(rank):
        comm = pycoll.world()
        comm.timeout = 0.3
        pycoll.allreduce(np.ones(3))  # every rank came to this one
        if rank == 1:
            gate.wait()  # never comes to the next, and does not return either
            return None
        started = time.monotonic()
        try:
            pycoll.allreduce(np.ones(size), algorithm="auto" if size < 10 else "ring")
        except pycoll.CollectiveTimeout as error:
            message, waited = str(error), time.monotonic() - started
        gate.wait()
        with pytest.raises(RuntimeError, match="is broken .*waited 0.3 s"):
            pycoll.broadcast(np.ones(2))
        return message, waited

    results = pycoll.run_local(3, lambda: body(pycoll.world().rank))
    for rank in (0, 2):
        message, waited = results[rank]
        assert message.startswith("allreduce (")
        assert f"rank {rank} waited 0.3 s" in message and "for rank(s) " in message
        assert waited < 5
    # rank 2 receives from rank 1 in the ring; in the one-shot everyone waits for rank 1
    assert results[2][0].endswith("for rank(s) 1")
    if check == "1":
        assert all(results[r][0].startswith("allreduce (agreement check)") for r in (0, 2))
    elif size > 10:
        assert "(ring)" in results[2][0] and "at step 1 of 4" in results[2][0]


@pytest.mark.parametrize("what,warm_up,call", [
    ("the first collective (connecting shared memory)", False,
     lambda: pycoll.allreduce(np.ones(3))),
    ("empty", True, lambda: pycoll.empty(4)),
    # it named only the first collective, which the program had not called
    ("free() (collective: every rank of the communicator calls it): the first collective "
     "(connecting shared memory)", False, lambda: pycoll.world().free()),
])
def test_a_rank_that_never_comes_to_a_first_step_is_named(monkeypatch, what, warm_up, call):
    """Connecting shared memory (the first collective) and pycoll.empty's window wait within
    the timeout too (the first waited until the late rank returned, then reported a
    Deadlock; empty ignored the timeout)."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    monkeypatch.setenv("PYCOLL_TIMEOUT", "0.3")
    gate = threading.Barrier(3)

    def body(rank):
        if warm_up:
            pycoll.allreduce(np.ones(3))
        if rank == 1:
            gate.wait()  # never comes, and does not return either
            return None
        try:
            call()
        except pycoll.CollectiveTimeout as error:
            message = str(error)
        gate.wait()
        return message

    results = pycoll.run_local(3, lambda: body(pycoll.world().rank))
    for rank in (0, 2):
        assert results[rank] == f"{what}: rank {rank} waited 0.3 s for rank(s) 1"


def test_without_a_timeout_nothing_changes(monkeypatch):
    monkeypatch.delenv("PYCOLL_TIMEOUT", raising=False)
    assert pycoll.run_local(2, lambda: pycoll.world().timeout) == [None, None]
    monkeypatch.setenv("PYCOLL_TIMEOUT", "2.5")
    assert pycoll.run_local(2, lambda: pycoll.world().timeout) == [2.5, 2.5]
    monkeypatch.setenv("PYCOLL_TIMEOUT", "1e400")  # more than any wait can take: none
    assert pycoll.run_local(2, lambda: pycoll.world().timeout) == [None, None]


@pytest.mark.parametrize("value", ["0", "-1", "soon"])
def test_a_bad_setting_is_named(monkeypatch, value):
    monkeypatch.setenv("PYCOLL_TIMEOUT", value)
    with pytest.raises(ValueError, match=f"PYCOLL_TIMEOUT='{value}' is invalid"):
        pycoll.run_local(1, lambda: pycoll.allreduce(np.ones(2)))


def test_a_bad_value_is_named():
    def body():
        with pytest.raises(ValueError, match="timeout=0 is invalid; allowed: seconds > 0"):
            pycoll.world().timeout = 0
        with pytest.raises(ValueError, match=r"timeout=(np\.True_|True) is invalid"):
            pycoll.world().timeout = np.bool_(True)
        pycoll.world().timeout = np.int64(5)  # numpy's numbers are seconds too
        five = pycoll.world().timeout == 5.0
        forever = []
        for value in (10**400, float("inf")):  # no deadline (10**400: OverflowError)
            pycoll.world().timeout = value
            forever.append(pycoll.world().timeout)
        return five, forever

    assert pycoll.run_local(1, body) == [(True, [None, None])]


def test_an_mpi_wait_past_its_deadline_forgets_only_its_own_requests():
    """Async Send/Recv wait on threads of their own: one wait's timeout must not forget the
    peers of another's requests (the next timeout named rank -1). MPI stood in for: requests
    that never complete."""
    import types

    from pycoll.bindings.mpi import MPITransport
    from pycoll.bindings.transport import WaitTimeout

    class Pending:
        def Test(self) -> bool:
            return False

    transport = MPITransport.__new__(MPITransport)
    transport._MPI = types.SimpleNamespace(Request=types.SimpleNamespace(
        Testall=lambda requests, statuses=None: False), Status=object,
        Exception=type("MPIException", (Exception,), {}))
    transport.timeout, transport._peer_of, transport._expected = 0.05, {}, {}
    mine, theirs = Pending(), Pending()
    transport._peer_of[id(mine)], transport._peer_of[id(theirs)] = 1, 2
    for request, peer in ((mine, 1), (theirs, 2)):
        with pytest.raises(WaitTimeout) as late:
            transport.waitall([request])
        assert late.value.peers == [peer]
    assert transport._peer_of == {}


def test_a_late_send_or_recv_names_its_direction_and_peer(monkeypatch):
    """Blocking, and async (posted: its deadline counts from wait()); the peer is busy
    meanwhile, so no deadlock is seen first."""
    monkeypatch.setenv("PYCOLL_TIMEOUT", "0.3")

    def body(waiting):
        comm = pycoll.world()
        if comm.rank != waiting:
            time.sleep(0.6)
            return None
        try:
            if waiting == 1:
                pycoll.recv(np.empty(4), 0, tag=3)
            else:
                pycoll.recv(np.empty(4), 1, tag=3, async_op=True).wait()
        except pycoll.CollectiveTimeout as error:
            return str(error)

    assert pycoll.run_local(2, body, 1)[1] == (
        "recv from rank 0 (tag 3): rank 1 waited 0.3 s at step 1 of 1 for rank(s) 0")
    assert pycoll.run_local(2, body, 0)[0] == (
        "recv from rank 1 (tag 3): rank 0 waited 0.3 s for rank(s) 1")


def test_a_late_peer_in_a_one_exchange_call_is_named(monkeypatch):
    """The two-rank small AllReduce over messages: one exchange, in the player's own Sendrecv
    (bindings/mpi.py's one call, where no deadline applies); with one, named as any step."""
    monkeypatch.setenv("PYCOLL_TIMEOUT", "0.3")
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "mpi")  # in-process: messages, no one-shot

    def body():
        comm = pycoll.world()
        if comm.rank == 1:
            time.sleep(0.6)
            return None
        try:
            pycoll.allreduce(np.ones(4), algorithm="direct")
        except pycoll.CollectiveTimeout as error:
            return str(error)

    said = pycoll.run_local(2, body)[0]
    assert said.endswith("rank 0 waited 0.3 s at step 1 of 1 for rank(s) 1"), said
