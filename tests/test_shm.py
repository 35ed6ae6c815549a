"""The shared-memory transport (bindings/shm.py) on in-process ranks sharing arrays, against
the oracle: every collective and family through the rings, long messages in pieces that wrap
around small rings, routes that mix shared memory with messages, the one-shot AllReduce, and
arrays from ``pycoll.empty`` sent without a copy. The same transport between MPI processes
is run by tests/test_mpi.py."""

from __future__ import annotations

import concurrent.futures
import re
import threading
import time

import numpy as np
import pytest
from conftest import ALL_DTYPES, exact_input, ops_for

import pycoll
from pycoll import ChannelsCrossed, oracle
from pycoll.algorithms import families_for
from pycoll.bindings import shm
from pycoll.schedule import Collective

RANKS = [1, 2, 3, 5]
SMALL_RING = 4 * shm.MIN_PIECE  # the smallest ring allowed: long messages wrap often
MODES = {  # PYCOLL_RANKS_PER_NODE, PYCOLL_SHM_RING_BYTES, PYCOLL_SHM_CMA, CMA_MIN_BYTES
    "one-node": ("", "", "1", shm.CMA_MIN_BYTES),
    "small-rings": ("", str(SMALL_RING), "0", 0),  # every message through the rings
    "routed": ("2", str(SMALL_RING), "0", 0),
    "cross-memory": ("", "", "1", 1),  # every message read from the sender's array
}


def sizes(nranks: int) -> list[int]:
    return sorted({0, 1, nranks + 1, 13, 1000, 9000})


@pytest.fixture
def shared(request, monkeypatch):
    """The transport set up in the mode ``request.param`` names (tests parametrise it)."""
    per_node, ring, cma, cma_min = MODES[request.param]
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    monkeypatch.setenv("PYCOLL_RANKS_PER_NODE", per_node)
    monkeypatch.setenv("PYCOLL_SHM_RING_BYTES", ring)
    monkeypatch.setenv("PYCOLL_SHM_CMA", cma)
    monkeypatch.setattr(shm, "CMA_MIN_BYTES", cma_min)
    monkeypatch.setattr(shm, "CMA_PIECE", 4096)  # reductions read in many pieces
    return request.param


def modes(nranks):
    """One rank has no peer: the modes differ only in how peers' messages move."""
    return list(MODES) if nranks > 1 else ["one-node"]


def cases(collective):
    return [(m, a, n, c) for a in families_for(collective) + ["auto"] for n in RANKS
            for m in modes(n) for c in sizes(n)]


def every_case(collective):
    return pytest.mark.parametrize("shared,algorithm,nranks,count", cases(collective),
                                   indirect=["shared"])


def pick(index):
    dtype = ALL_DTYPES[index % len(ALL_DTYPES)]
    ops = ops_for(dtype)
    return dtype, ops[(index // len(ALL_DTYPES)) % len(ops)]


def run(nranks, fn):
    return pycoll.run_local(nranks, lambda: fn(pycoll.world().rank))


@every_case(Collective.ALLREDUCE)
def test_allreduce(shared, algorithm, nranks, count):
    index = nranks * 7 + count
    dtype, op = pick(index)
    inputs = [exact_input(r, count, dtype, op, index) for r in range(nranks)]
    results = run(nranks, lambda r: pycoll.allreduce(inputs[r], op, algorithm=algorithm))
    for result in results:
        np.testing.assert_array_equal(result, oracle.allreduce(inputs, op))


@every_case(Collective.REDUCE_SCATTER)
def test_reduce_scatter_with_uneven_counts(shared, algorithm, nranks, count):
    index = nranks * 5 + count
    dtype, op = pick(index)
    counts = [count // nranks + (1 if r < count % nranks else 0) for r in range(nranks)]
    inputs = [exact_input(r, count, dtype, op, index) for r in range(nranks)]
    results = run(nranks, lambda r: pycoll.reduce_scatter(inputs[r], op, counts=counts,
                                                          algorithm=algorithm))
    expected = oracle.reduce_scatter(inputs, op, counts)
    for rank, result in enumerate(results):
        np.testing.assert_array_equal(result, expected[rank])


@every_case(Collective.ALLGATHER)
def test_allgather(shared, algorithm, nranks, count):
    dtype, _ = pick(count)
    inputs = [exact_input(r, count, dtype, "sum") for r in range(nranks)]
    results = run(nranks, lambda r: pycoll.allgather(inputs[r], algorithm=algorithm))
    for result in results:
        np.testing.assert_array_equal(result, oracle.allgather(inputs))


@every_case(Collective.BROADCAST)
def test_broadcast(shared, algorithm, nranks, count):
    root = nranks - 1
    inputs = [exact_input(r, count, np.dtype(np.int32), "sum") for r in range(nranks)]
    results = run(nranks, lambda r: pycoll.broadcast(inputs[r].copy(), root,
                                                     algorithm=algorithm))
    for result in results:
        np.testing.assert_array_equal(result, oracle.broadcast(inputs, root))


@every_case(Collective.REDUCE)
def test_reduce(shared, algorithm, nranks, count):
    root = nranks // 2
    inputs = [exact_input(r, count, np.dtype(np.int64), "max") for r in range(nranks)]
    results = run(nranks, lambda r: pycoll.reduce(inputs[r], "max", root, algorithm=algorithm))
    np.testing.assert_array_equal(results[root], oracle.reduce(inputs, "max", root))
    assert all(result is None for rank, result in enumerate(results) if rank != root)


@pytest.mark.parametrize("shared,nranks", [(m, n) for n in RANKS for m in modes(n)],
                         indirect=["shared"])
def test_alltoall_alltoallv_and_send_recv(shared, nranks):
    inputs = [np.arange(nranks * 3000, dtype=np.float32) + 100 * r for r in range(nranks)]
    sends = [[(r + j) % 3 * 1000 for j in range(nranks)] for r in range(nranks)]

    def body(rank):
        everyone = pycoll.alltoall(inputs[rank])
        varied = pycoll.alltoallv(inputs[rank][: sum(sends[rank])], sends[rank])
        ring = np.full(4, -1.0, np.float32)
        for turn in (rank % 2, 1 - rank % 2) if nranks > 1 else ():  # sends block: alternate
            if turn == 0:
                pycoll.send(np.full(4, rank, np.float32), (rank + 1) % nranks, tag=3)
            else:
                pycoll.recv(ring, (rank - 1) % nranks, tag=3)
        return everyone, varied, ring

    results = run(nranks, body)
    arrivals = oracle.alltoall(inputs)
    varied = oracle.alltoallv([inputs[r][: sum(sends[r])] for r in range(nranks)], sends)
    for rank, (everyone, got, ring) in enumerate(results):
        np.testing.assert_array_equal(everyone, arrivals[rank])
        np.testing.assert_array_equal(got, varied[rank])
        assert (ring == ((rank - 1) % nranks if nranks > 1 else -1)).all()


def test_the_transport_is_shared_memory_where_ranks_share_a_node(monkeypatch):
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    monkeypatch.setenv("PYCOLL_RANKS_PER_NODE", "2")

    def body(rank):
        comm = pycoll.world()
        return type(comm.host_transport()).__name__, comm.host_kind(), comm.one_shot()

    kinds = run(3, body)
    # ranks 0 and 1 share a node; rank 2 is alone on its node, so it has messages only (the
    # kind, which prices the schedules, is the group's: every rank must choose alike)
    assert [k[:2] for k in kinds] == [("RoutedTransport", "shm"), ("RoutedTransport", "shm"),
                                      ("LocalTransport", "shm")]
    assert all(k[2] is None for k in kinds)  # one shot needs every rank on one node
    monkeypatch.setenv("PYCOLL_RANKS_PER_NODE", "")
    assert all(type(k[2]).__name__ == "SharedMemoryTransport" for k in run(3, body))


def test_peers_find_each_others_memory_readable(monkeypatch):
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")

    def body(rank):
        transport = pycoll.world().host_transport()
        return transport._readable, transport._read_by

    for rank, (readable, read_by) in enumerate(run(3, body)):
        assert readable == read_by == [peer != rank for peer in range(3)]
    monkeypatch.setenv("PYCOLL_SHM_CMA", "0")
    assert all(r == ([False] * 3, [False] * 3) for r in run(3, body))


@pytest.mark.parametrize("nranks", [2, 3, 5])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_one_shot_allreduce_every_op_and_dtype(monkeypatch, nranks, dtype):
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    ops = ops_for(dtype)
    inputs = {op: [exact_input(r, (3, 5), dtype, op, 9) for r in range(nranks)] for op in ops}

    def body(rank):
        results = {}
        for op in ops:  # more calls than slots: each slot is reused several times
            results[op] = pycoll.allreduce(inputs[op][rank], op)
            again = inputs[op][rank].copy()
            assert pycoll.allreduce(again, op, out=again) is again  # in place
            np.testing.assert_array_equal(again, results[op])
        return results

    for results in run(nranks, body):
        for op in ops:
            flat = [x.reshape(-1) for x in inputs[op]]
            np.testing.assert_array_equal(results[op].reshape(-1), oracle.allreduce(flat, op))


def test_one_shot_gives_every_rank_the_same_bits(monkeypatch):
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(1000).astype(np.float32) for _ in range(5)]
    results = run(5, lambda r: pycoll.allreduce(inputs[r]))
    for result in results[1:]:
        assert result.tobytes() == results[0].tobytes()


def test_one_shot_stands_aside_when_an_algorithm_is_forced(monkeypatch):
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    monkeypatch.setenv("PYCOLL_ALGO", "ring")
    assert run(2, lambda r: pycoll.world().one_shot()) == [None, None]


def test_the_one_shot_a_plan_names_is_explained_when_passed_as_an_algorithm(monkeypatch):
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")

    def body(rank):
        named = pycoll.plan("allreduce", 64).algorithm
        with pytest.raises(ValueError, match="is what 'auto' runs for small calls") as error:
            pycoll.allreduce(np.ones(16, np.float32), algorithm=named)
        return named, str(error.value).startswith("allreduce: algorithm='one_shot' is not")

    assert run(2, body) == [("one_shot", True)] * 2


def test_one_shot_reports_bad_out_like_the_general_path(monkeypatch):
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")

    def body(rank):
        x = np.ones(4, np.float32)
        with pytest.raises(TypeError, match="out.dtype=float64 but x.dtype=float32"):
            pycoll.allreduce(x, out=np.empty(4))
        with pytest.raises(ValueError, match="out overlaps x"):
            big = np.ones(8, np.float32)
            pycoll.allreduce(big[:4], out=big[2:6])
        with pytest.raises(ValueError, match="'bogus'"):
            pycoll.allreduce(x, "bogus")
        return pycoll.allreduce(x)  # the ranks are still in step

    for result in run(2, body):
        np.testing.assert_array_equal(result, np.full(4, 2, np.float32))


@pytest.mark.parametrize("count", [4, 100_000])  # the one-shot's size, and the schedules'
def test_a_roots_bad_out_raises_before_its_part_in_reduce_at_any_size(monkeypatch, count):
    """The root checks out before it takes part, as at every size: it raised after the
    one-shot's exchange, so the other ranks returned as if the call had worked."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    said = []

    def body(rank):
        pycoll.world().timeout = 20
        if rank == 0:
            with pytest.raises(ValueError) as error:
                pycoll.reduce(np.ones(count), root=0, out=np.zeros(count + 1))
            said.append(str(error.value))
        else:
            pycoll.reduce(np.ones(count), root=0)

    with pytest.raises(pycoll.Deadlock, match=r"rank 1 waits for ranks \[0\], which already"):
        run(2, body)
    assert said == [f"reduce: out.shape=({count + 1},); allowed: ({count},)"]


@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_arrays_from_empty_are_sent_without_a_copy(monkeypatch, nranks):
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    monkeypatch.setenv("PYCOLL_CHECK", "0")  # its exchange would be copies too
    monkeypatch.setenv("PYCOLL_SHM_RING_BYTES", str(SMALL_RING))
    count = 50_000  # larger than a ring: a copy would travel in pieces
    inputs = [exact_input(r, count, np.dtype(np.int32), "sum") for r in range(nranks)]
    copies = []

    def body(rank):
        x = pycoll.empty(count, np.int32)
        x[...] = inputs[rank]
        out = pycoll.empty((count,), np.int32)
        transport = pycoll.world()._shared
        if transport is not None:
            counted = transport._push

            def push(request):  # count records of data copied into a ring
                before = request.sent
                moved = counted(request)
                if request.window < 0 and request.sent > before:
                    copies.append(request.sent - before)
                return moved

            transport._push = push
        pycoll.allreduce(x, out=out, algorithm="two_shot")
        gathered = pycoll.allgather(out[:10])
        return out.copy(), gathered

    results = run(nranks, body)
    for out, gathered in results:
        np.testing.assert_array_equal(out, oracle.allreduce(inputs, "sum"))
        np.testing.assert_array_equal(gathered, np.tile(out[:10], nranks))
    # only allgather's 10-element slices of out (not a window view's start) were copied
    assert sum(copies) <= nranks * (nranks - 1) * 40


def test_empty_validates_and_is_plain_numpy_without_peers():
    assert isinstance(pycoll.empty(3), np.ndarray)
    assert pycoll.empty((2, 3), np.int8).shape == (2, 3)
    with pytest.raises(ValueError, match=r"empty: shape=\(2, -1\) is invalid"):
        pycoll.empty((2, -1))
    with pytest.raises(ValueError, match=r"empty: shape=\(1048576, 8796093022208\) of int16 "
                                         r"is 18446744073709551616 bytes; allowed: at most 9223"):
        pycoll.empty((1 << 20, 1 << 43), np.int16)  # numpy: "array is too big", naming neither


def test_ranks_that_disagree_on_a_size_fail_with_both_sizes(monkeypatch):
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")

    def body(rank):
        pycoll.allreduce(np.ones(1000 + rank * 10, np.float32), algorithm="ring")

    with pytest.raises((ValueError, pycoll.PeerFailed), match="expects|disagree|failed"):
        run(2, body)


def test_one_shot_ranks_that_disagree_fail_on_every_rank(monkeypatch):
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    monkeypatch.setenv("PYCOLL_CHECK", "0")  # the one-shot's own check, without the general one
    errors = []

    def body(rank):
        pycoll.allreduce(np.ones(4, np.float32))  # agreeing calls first: both slots used
        pycoll.allreduce(np.ones(8, np.float32))
        try:
            pycoll.allreduce(np.ones(3, np.float32 if rank == 0 else np.int64))
        except ValueError as error:
            errors.append(str(error))
        # the communicator stays usable: each later call is right (it read the failed
        # call's slots, or raised its error again); equal dtypes of two numpy types agree
        for k in range(3):
            x = np.arange(8, dtype=np.longlong if rank == 0 else np.int64) * (rank + 1) + k
            np.testing.assert_array_equal(pycoll.allreduce(x), np.arange(8) * 3 + 2 * k)

    run(2, body)
    assert sorted(errors) == [
        "allreduce: rank 0 passed 3 elements of float32 but rank 1 passed 3 of int64; every "
        "rank must pass the same count and dtype, and the same algorithm, with comm.check and "
        "comm.verify alike",
        "allreduce: rank 1 passed 3 elements of int64 but rank 0 passed 3 of float32; every "
        "rank must pass the same count and dtype, and the same algorithm, with comm.check and "
        "comm.verify alike",
    ]


@pytest.mark.parametrize("name,call", [
    ("allreduce", lambda r, x: pycoll.allreduce(x, "max" if r == 1 else "sum")),
    ("broadcast", lambda r, x: pycoll.broadcast(x, root=r % 2)),
    ("reduce", lambda r, x: pycoll.reduce(x, root=1 if r == 2 else 0)),
    ("reduce_scatter", lambda r, x: pycoll.reduce_scatter(x, counts=[1, 1, 4] if r == 1
                                                          else [2, 2, 2])),
])
def test_one_shot_ranks_that_disagree_on_op_root_or_counts_fail(monkeypatch, name, call):
    """Each rank took its own op, root or counts and returned without a word."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    monkeypatch.setenv("PYCOLL_CHECK", "0")

    def body(rank):
        try:
            call(rank, np.arange(6, dtype=np.int64))
        except ValueError as error:
            return str(error)
        return "no error"

    for said in run(3, body):
        assert re.fullmatch(rf"{name}: rank \d and rank \d passed a different collective, op, "
                            r"root or counts; every rank must pass the same \(PYCOLL_CHECK=1 "
                            r"names which\)", said), said


def test_one_shot_ranks_in_different_collectives_fail(monkeypatch):
    """An AllGather beside AllReduces of the same size: named as a different collective too
    (it said "a different op, root or counts")."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    monkeypatch.setenv("PYCOLL_CHECK", "0")

    def body(rank):
        x = np.arange(6, dtype=np.int64)
        try:
            pycoll.allgather(x) if rank == 1 else pycoll.allreduce(x)
        except ValueError as error:
            return str(error)
        return "no error"

    for rank, said in enumerate(run(3, body)):
        assert said.startswith("allgather: " if rank == 1 else "allreduce: ")
        assert "passed a different collective, op, root or counts" in said, said


def test_a_rank_that_skips_a_collective_is_reported(monkeypatch):
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")

    def body(rank):
        pycoll.allreduce(np.ones(3))  # makes the transport
        if rank != 1:
            pycoll.allreduce(np.ones(100_000), algorithm="ring")

    with pytest.raises((pycoll.Deadlock, pycoll.PeerFailed)):
        run(3, body)


def _deadlock_over_shared_memory(monkeypatch, then) -> str:
    """``then(rank, first, second)`` run on 2 in-process ranks over shared memory, each
    communicator's shared memory made first; the Deadlock's text, which must come at once
    (the timeout ends a verdict that never comes, which hung)."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    monkeypatch.setenv("PYCOLL_TIMEOUT", "20")

    def body(rank):
        world = pycoll.world()
        first, second = world.split(0), world.split(0)
        for comm in (first, second):
            pycoll.allreduce(np.ones(3), comm=comm)
        then(rank, first, second)

    started = time.monotonic()
    with pytest.raises((pycoll.Deadlock, pycoll.PeerFailed), match="deadlock") as caught:
        run(2, body)
    assert time.monotonic() - started < 10
    return str(caught.value)


@pytest.mark.parametrize("count", [3, 300_000], ids=["one-shot", "rings"])
def test_ranks_polling_shared_memory_in_a_cycle_are_a_deadlock_at_once(monkeypatch, count):
    """Rank 0 calls A then B, rank 1 B then A: both poll shared memory for each other. Only
    a rank waiting for ranks that had returned was reported; this hung until killed."""
    def then(rank, first, second):
        for comm in (first, second) if rank == 0 else (second, first):
            pycoll.allreduce(np.ones(count), comm=comm)

    said = _deadlock_over_shared_memory(monkeypatch, then)
    assert "rank 0 waits in shared memory for rank(s) 1" in said
    assert "rank 1 waits in shared memory for rank(s) 0" in said


def test_an_async_wait_beside_a_peer_polling_another_communicator_is_a_deadlock(monkeypatch):
    """Rank 0 waits on its async AllReduce on A while rank 1 is in one on B: rank 0's worker
    and rank 1 poll shared memory, rank 0's own thread is parked."""
    def then(rank, first, second):
        if rank == 0:
            pycoll.allreduce(np.ones(3), comm=first, async_op=True).wait()
        pycoll.allreduce(np.ones(3), comm=second)
        pycoll.allreduce(np.ones(3), comm=first)

    said = _deadlock_over_shared_memory(monkeypatch, then)
    assert "rank 0 waits for its allreduce" in said


def test_a_pool_thread_polling_beside_a_computing_rank_is_no_deadlock(monkeypatch):
    """Rank 1's pool thread (made before the run: no grace) and its own thread poll shared
    memory while rank 0 computes: two polling threads stood in for two ranks' threads, a
    false Deadlock in 0.2 s, until a polling thread counted among the threads that may move
    data."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    monkeypatch.delenv("PYCOLL_TIMEOUT", raising=False)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: None).result()  # its worker lives before run_local

        def body(rank):
            world = pycoll.world()
            side = world.split(0)
            for comm in (world, side):
                pycoll.allreduce(np.ones(8), comm=comm)  # each makes its shared memory
            if rank == 1:
                aside = pool.submit(pycoll.allreduce, np.ones(8), comm=side)
                return pycoll.allreduce(np.ones(8), comm=world)[0] + aside.result()[0]
            time.sleep(0.3)  # computing
            return pycoll.allreduce(np.ones(8), comm=world)[0] + pycoll.allreduce(
                np.ones(8), comm=side)[0]

        assert run(2, body) == [4.0, 4.0]


def test_a_deadlock_after_a_polling_thread_ended_is_still_reported(monkeypatch):
    """A thread a rank started polled shared memory, then ended: its entry held back every
    later verdict (the cycle below hung until killed)."""
    def then(rank, first, second):
        def helper():
            if rank == 1:
                time.sleep(0.2)  # rank 0's helper polls meanwhile
            pycoll.allreduce(np.ones(8), comm=first)

        thread = threading.Thread(target=helper)
        thread.start()
        thread.join()
        for comm in (first, second) if rank == 0 else (second, first):
            pycoll.allreduce(np.ones(8), comm=comm)

    said = _deadlock_over_shared_memory(monkeypatch, then)
    assert "rank 0 waits in shared memory for rank(s) 1" in said


def test_ranks_taking_turns_through_shared_memory_are_no_deadlock(monkeypatch):
    """The verdict must not fire while data is on its way: rank 1 computes between calls
    while rank 0 polls, over and over, with an async worker busy beside them."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    monkeypatch.delenv("PYCOLL_TIMEOUT", raising=False)

    def body(rank):
        total = 0.0
        pending = pycoll.allreduce(np.ones(50_000), async_op=True)
        for step in range(40):
            if rank == 1 and step % 10 == 0:
                time.sleep(0.05)  # computing: rank 0 polls meanwhile
            total += pycoll.allreduce(np.full(3 if step % 2 else 40_000, 1.0))[0]
        return total + pending.wait()[0]

    assert run(2, body) == [82.0, 82.0]


@pytest.mark.parametrize("name,value", [("PYCOLL_HOST_TRANSPORT", "fast"),
                                        ("PYCOLL_SHM_RING_BYTES", "1000"),
                                        ("PYCOLL_SHM_ONE_SHOT_BYTES", "x"),
                                        # a bare MemoryError; isdigit() took '²'
                                        ("PYCOLL_SHM_RING_BYTES", "99999999999999"),
                                        ("PYCOLL_SHM_ONE_SHOT_BYTES", "\u00b2"),
                                        ("PYCOLL_RANKS_PER_NODE", "\u00b2"),
                                        ("PYCOLL_SHM_CMA", "yes")])
def test_bad_settings_are_named(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    if name != "PYCOLL_HOST_TRANSPORT":
        monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    with pytest.raises(ValueError, match=f"{name}='{value}' is invalid"):
        run(2, lambda r: pycoll.allreduce(np.ones(2)))


def test_byte_settings_take_surrounding_spaces_as_every_setting_does(monkeypatch):
    monkeypatch.setenv("PYCOLL_SHM_RING_BYTES", " 65536 ")
    assert shm._env_bytes("PYCOLL_SHM_RING_BYTES", 1 << 20) == 65536
    monkeypatch.setenv("PYCOLL_SHM_RING_BYTES", "  ")
    assert shm._env_bytes("PYCOLL_SHM_RING_BYTES", 1 << 20) == 1 << 20


@pytest.mark.parametrize("transport", ["shm", "auto"])
def test_free_releases_the_shared_memory_and_later_calls_fail(monkeypatch, transport):
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", transport)

    def body(rank):
        comm = pycoll.world().split(0)
        x = pycoll.empty(10, np.int32, comm=comm)
        x[...] = rank
        total = pycoll.allreduce(x, comm=comm).copy()
        comm.free()
        comm.free()  # twice is harmless
        with pytest.raises(RuntimeError, match="was freed"):
            pycoll.allreduce(np.ones(2), comm=comm)
        return total

    for total in run(3, body):
        np.testing.assert_array_equal(total, np.full(10, 3, np.int32))


def test_free_lets_go_of_every_ranks_segment_in_process(monkeypatch):
    """In-process ranks keep their segments in a list the world shares: each rank's free
    drops its own, so nothing of a freed communicator stays (64 MiB per split at 3 ranks)."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")

    def body(rank):
        world = pycoll.world()
        pycoll.barrier()  # the world's own segments, made first
        before = {key for key, value in world.transport.world.shared.items()
                  if key[-1] == "segments"}
        comm = world.split(0)
        pycoll.allreduce(np.ones(3), comm=comm)
        comm.free()
        pycoll.barrier()
        return [value for key, value in world.transport.world.shared.items()
                if key[-1] == "segments" and key not in before]

    assert run(3, body) == [[], [], []]  # not even the (emptied) entries


def test_one_shot_slot_views_are_kept_for_a_bounded_number_of_shapes(monkeypatch):
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    monkeypatch.setattr(shm, "SMALL_VIEWS_KEPT", 4)

    def body(rank):
        comm = pycoll.world()
        totals = [pycoll.allreduce(np.arange(n) + rank)[-1] for n in range(1, 11)]
        return totals, len(comm.one_shot_for(Collective.ALLREDUCE)._small_views)

    for totals, kept in run(3, body):
        assert totals == [3 * (n - 1) + 3 for n in range(1, 11)]
        assert kept <= 4


def _memmap(x, tmp):
    mapped = np.memmap(tmp / f"x{id(x)}", x.dtype, "w+", shape=x.shape)
    mapped[...] = x
    return mapped


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather",
                                        "broadcast", "reduce"])
def test_one_rank_passing_an_ndarray_subclass_takes_the_same_path(
        monkeypatch, tmp_path, collective):
    """Whether a small call goes through the one-shot slots must not depend on what may
    differ between ranks: rank 0's np.memmap (what np.load(..., mmap_mode="r+") returns)
    sent it down the schedules while the others waited in the slots (a hang under MPI,
    CollectiveTimeout here)."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    monkeypatch.setenv("PYCOLL_TIMEOUT", "20")
    nranks, count = 3, 6
    inputs = [np.arange(count, dtype=np.float64) + 10 * r for r in range(nranks)]

    def call(rank):
        x = inputs[rank].copy()
        if rank == 0:
            x = _memmap(x, tmp_path)
        if collective == "broadcast":
            return np.array(pycoll.broadcast(x, 1))
        if collective == "reduce":
            return np.array(pycoll.reduce(x, "sum", 1))
        return np.array(getattr(pycoll, collective)(x))

    results = run(nranks, call)
    expected = {"allreduce": [oracle.allreduce(inputs, "sum")] * nranks,
                "reduce_scatter": oracle.reduce_scatter(inputs, "sum"),
                "allgather": [oracle.allgather(inputs)] * nranks,
                "broadcast": [inputs[1]] * nranks}
    if collective == "reduce":
        np.testing.assert_array_equal(results[1], oracle.reduce(inputs, "sum", 1))
    else:
        for got, want in zip(results, expected[collective]):
            np.testing.assert_array_equal(got, want)



def test_a_mismatch_names_every_dtype_a_peer_may_pass():
    """The one-shot's mismatch error names the peer's dtype from its number: bfloat16 read
    "dtype number 256"."""
    for dtype in ALL_DTYPES:
        assert shm._dtype_name(shm._dtype_number(np.dtype(dtype))) == str(np.dtype(dtype))


@pytest.mark.parametrize("collective", ["allreduce", "broadcast", "reduce_scatter"])
@pytest.mark.parametrize("nranks", [2, 3])
def test_sizes_on_both_sides_of_the_one_shot_limit_are_named(monkeypatch, collective, nranks):
    """Ranks that disagree on a size, with one size above the one-shot limit and one below,
    took different channels and waited forever (the slots on one side, the rings on the
    other); now the channel that sees the other's traffic names the disagreement."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    monkeypatch.setenv("PYCOLL_TIMEOUT", "30")  # a regression fails, not hangs

    def call(rank):
        big = 2 * max(shm.SMALL_BYTES, 64 << 10) // 8 // nranks * nranks
        x = np.ones(big if rank == 0 else nranks, np.float64)
        if collective == "broadcast":
            return pycoll.broadcast(x, 0)
        return getattr(pycoll, collective)(x)

    with pytest.raises(ValueError, match="every rank must pass the same count and dtype"):
        run(nranks, call)


def test_ranks_whose_channels_crossed_are_left_with_a_broken_communicator(monkeypatch):
    """After sizes straddling the one-shot limit, a message is left in a ring where no later
    call expects one: every later call read it first and failed with a misleading mismatch
    (or could not tell). The communicator is now broken and says why at once."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    monkeypatch.setenv("PYCOLL_TIMEOUT", "30")  # a regression fails, not hangs

    def call(rank):
        comm = pycoll.world()
        with pytest.raises(ChannelsCrossed,
                           match="same count and dtype|one-shot slots|gave up the call"):
            pycoll.allreduce(np.ones(1 << 20 if rank == 0 else 2), comm=comm)
        with pytest.raises(RuntimeError, match="is broken") as later:
            pycoll.allreduce(np.arange(1000.0), comm=comm)
        return str(later.value)

    said = run(2, call)
    assert all(re.search("one-shot slots|gave up the call", why) for why in said)


class _PlainSegments:
    """Two ranks' segments as plain arrays, driven from one thread."""

    def __init__(self, segments):
        self.segments = segments

    def fence(self):
        pass

    def barrier(self):
        pass


def _two_endpoints():
    nbytes = shm.segment_bytes(2, 1 << 16, 4096)
    raw = [np.zeros(nbytes, np.uint8) for _ in range(2)]
    a, b = (shm.SharedMemoryTransport(_PlainSegments(raw), r, 2, [0, 1], 1 << 16, 4096)
            for r in (0, 1))
    a.connect()
    b.connect()
    a._spins = b._spins = 0  # every idle poll counts: the check comes at once
    return a, b


def _peer_moves_before_the_check(a, action):
    """Run ``action`` (the peer's steps) inside a's idle poll that is about to check the
    other channel: the peer scheduled between a's last poll and its check."""
    real, done = a._idle, []

    def idle(count, peers=(), crossed=None):
        if (count + 1) & 1023 == 0 and not done:
            done.append(action())
        return real(count, peers, crossed)

    a._idle = idle


def test_a_peer_that_publishes_then_sends_is_no_disagreement():
    """Both ranks: a one-shot call, then a ring call whose first message the peer pushes
    eagerly. If the peer does both between this rank's last look at its flag and the check,
    its ring message is of the next call, not a rank in the wrong channel (a false alarm a
    review found)."""
    a, b = _two_endpoints()

    def peer():
        b.publish_small(np.ones(1), "allreduce")  # sees a's flag: returns at once
        b.isend(np.ones(1000), 0, 7)  # the next call's first message

    _peer_moves_before_the_check(a, peer)
    slots = a.publish_small(np.ones(1), "allreduce")
    assert [s.tolist() for s in slots] == [[1.0], [1.0]]


def test_a_send_read_in_place_just_as_the_peer_moves_on_is_no_disagreement():
    """A message the peer reads from this rank's memory is done when this rank sees the
    peer's tail; the peer may read it, publish its tail, and enter a one-shot call before
    this rank looks again (a false alarm a review found)."""
    import threading

    a, b = _two_endpoints()
    if not b._readable[0]:
        pytest.skip("cross-memory attach (process_vm_readv) is not permitted here")
    a._read_by[1] = True  # what connect finds when both connect together (here one by one)
    send = a.isend(np.ones(1 << 14), 1, 7)
    assert send.window == shm._FROM_PROCESS

    one_shot = threading.Thread(target=lambda: b.publish_small(np.ones(1), "allreduce"),
                                daemon=True)

    def peer():
        b.waitall([b.irecv(np.empty(1 << 14), 0, 7)])
        one_shot.start()
        while b._my_control[b._layout.small_flag] < 1:
            pass

    _peer_moves_before_the_check(a, peer)
    a.waitall([send])
    assert send.done_
    a.publish_small(np.ones(1), "allreduce")  # the one-shot call the peer waits in
    one_shot.join(30)
    assert not one_shot.is_alive()


@pytest.mark.parametrize("wait", ["one-shot", "rings"])
def test_a_peer_that_gave_up_the_call_is_named_by_those_waiting_for_it(wait):
    """Rank 1 raised ChannelsCrossed (it saw rank 2 in the other channel) and will never
    publish, nor send: rank 0, waiting for rank 1 with nothing of its in either channel (a
    tree rank 1 sends rank 0 nothing on), waited forever."""
    a, b = _two_endpoints()
    with pytest.raises(ChannelsCrossed):
        raise b._give_up(ChannelsCrossed("rank 1: the other channel"))
    with pytest.raises(ChannelsCrossed, match="rank 0 waits for rank 1, which gave up the call"):
        if wait == "one-shot":
            a.publish_small(np.ones(1), "allreduce")
        else:
            a.waitall([a.irecv(np.empty(4), 1, 7)])
    assert a._my_control[a._layout.gave_up]  # and so on, to whoever waits for rank 0


class _RoundEndsAsTheWaitTimesOut:
    """The barrier's condition, where rank 1 ends the round, and arrives at the next, just
    as rank 0's wait times out (before rank 0 takes the lock back)."""

    def __init__(self, barrier):
        self.barrier, self.real = barrier, barrier._condition

    def __enter__(self):
        return self.real.__enter__()

    def __exit__(self, *exc):
        return self.real.__exit__(*exc)

    def release(self):
        self.real.release()

    def acquire(self):
        self.real.acquire()

    def wait(self, timeout):
        self.barrier._arrived = {1}
        self.barrier._generation += 1
        return False


def test_a_barrier_round_that_ends_as_a_wait_times_out_is_no_deadlock():
    """The ranks missing were read from the next round's arrivals: "rank 0 waits for ranks
    [0], which already returned" (a false Deadlock, 1 in 3 runs of 100 quick run_locals)."""
    barrier = shm._ThreadBarrier(2)
    barrier._condition = _RoundEndsAsTheWaitTimesOut(barrier)
    asked = []
    barrier.wait(0, asked.append, every=0.01)
    assert asked == []


def test_async_work_left_unwaited_finishes_with_its_rank_and_leaves_no_thread(monkeypatch):
    """run_local returned while the ranks' async workers still ran: over quick runs tens of
    threads and gigabytes stayed (each holding its communicator's shared memory) until
    collected, and a worker still running when the run closed could fail."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    x = np.arange(4096, dtype=np.float32)
    kept = []

    def body(rank):
        kept.append(pycoll.allreduce(x, async_op=True))  # never waited
        return rank

    before = {t for t in threading.enumerate() if t.name.startswith("pycoll-async")}
    for _ in range(20):
        assert run(3, body) == [0, 1, 2]
        assert all(work.done() for work in kept)  # finished before its rank returned
    np.testing.assert_array_equal(kept[-1].wait(), 3 * x)
    for _ in range(100):  # closed workers end once idle
        left = {t for t in threading.enumerate() if t.name.startswith("pycoll-async")} - before
        if not left:
            break
        time.sleep(0.05)
    assert left == set()


@pytest.mark.parametrize("check", ["0", "1"])
def test_free_on_one_rank_beside_another_call_is_named_free(monkeypatch, check):
    """free()'s barrier, an allreduce of one int8, was reported as an "allreduce" the
    program never made."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    monkeypatch.setenv("PYCOLL_CHECK", check)

    def body(rank):
        comm = pycoll.world().split(0)
        comm.timeout = 20
        x = np.ones(4, np.float32)
        with pytest.raises(ValueError) as error:
            comm.free() if rank == 0 else pycoll.allreduce(x, comm=comm)
        return str(error.value)

    freed, other = run(2, body)
    assert freed.startswith("free() (collective: every rank of the communicator calls it): "
                            "barrier (an allreduce of one int8): "), freed
    assert other.startswith("allreduce: " if check == "0" else "rank 1: "), other


def test_shared_memory_free_is_the_folders_room_within_the_memory_left(tmp_path, monkeypatch):
    """What a new window may take: the shared-memory folder's free space (statvfs), never
    more than the memory Linux can still give, and the memory alone where the folder is
    missing."""
    import os

    stat = os.statvfs(tmp_path)
    room = stat.f_bavail * stat.f_frsize
    assert shm.available_memory() > 0  # Linux's MemAvailable, read here
    monkeypatch.setattr(shm, "available_memory", lambda: 1 << 62)
    assert abs(shm.shared_memory_free(str(tmp_path)) - room) < (64 << 20)  # others write too
    monkeypatch.setattr(shm, "available_memory", lambda: 12345)
    assert shm.shared_memory_free(str(tmp_path)) == 12345
    assert shm.shared_memory_free(str(tmp_path / "missing")) == 12345
    monkeypatch.setattr(shm, "available_memory", lambda: None)
    assert shm.shared_memory_free(str(tmp_path / "missing")) is None
