"""async_op=True: every collective returns a Work; collectives on two communicators overlap
and both results are right; one communicator keeps its order; bad input raises at the call,
other errors come from wait() and break the communicator."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import exact_input

import pycoll
from pycoll import oracle

TRANSPORTS = ["auto", "shm"]


def run(nranks, fn):
    return pycoll.run_local(nranks, lambda: fn(pycoll.world().rank))


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_collectives_on_two_communicators_overlap(monkeypatch, transport, nranks):
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", transport)
    big = [exact_input(r, 200_000, np.dtype(np.int64), "sum") for r in range(nranks)]
    small = [exact_input(r, 12, np.dtype(np.int32), "max", 1) for r in range(nranks)]

    def body(rank):
        world = pycoll.world()
        other = world.split(0)  # a second communicator of the same ranks
        first = pycoll.allreduce(big[rank], algorithm="ring", async_op=True)
        second = pycoll.allreduce(small[rank], "max", comm=other, async_op=True)
        gathered = pycoll.allgather(small[rank], comm=other, async_op=True)
        mine = second.wait()  # the small one need not wait for the big one
        results = first.wait(), mine, gathered.wait()
        assert first.done() and second.done() and "done" in repr(first)
        assert first.is_completed() and gathered.is_completed()  # torch's name
        return results

    for result in run(nranks, body):
        np.testing.assert_array_equal(result[0], oracle.allreduce(big, "sum"))
        np.testing.assert_array_equal(result[1], oracle.allreduce(small, "max"))
        np.testing.assert_array_equal(result[2], oracle.allgather(small))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_collective_takes_async_op(monkeypatch, transport):
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", transport)
    inputs = [exact_input(r, 6, np.dtype(np.float32), "sum") for r in range(3)]

    def body(rank):
        x = inputs[rank]
        works = [
            pycoll.allreduce(x, async_op=True),
            pycoll.reduce_scatter(x, async_op=True),
            pycoll.allgather(x, async_op=True),
            pycoll.broadcast(x.copy(), 1, async_op=True),
            pycoll.reduce(x, "sum", 2, async_op=True),
            pycoll.alltoall(x, async_op=True),
            pycoll.alltoallv(x[: 2 * rank], [rank] * 2 + [0], async_op=True),
            pycoll.alltoallv(x[: 2 * rank], [rank] * 2 + [0],
                             out=np.empty(3 * (rank < 2), np.float32), async_op=True),
            pycoll.barrier(async_op=True),
        ]
        if rank == 0:
            works.append(pycoll.send(x, 1, tag=5, async_op=True))
        if rank == 1:
            works.append(pycoll.recv(np.empty(6, np.float32), 0, tag=5, async_op=True))
        blocking = pycoll.allreduce(x)  # runs after the queued ones, in order
        return [w.wait() for w in works], blocking

    for rank, (results, blocking) in enumerate(run(3, body)):
        np.testing.assert_array_equal(results[0], oracle.allreduce(inputs, "sum"))
        np.testing.assert_array_equal(results[1], oracle.reduce_scatter(inputs, "sum",
                                                                        [2, 2, 2])[rank])
        np.testing.assert_array_equal(results[2], oracle.allgather(inputs))
        np.testing.assert_array_equal(results[3], inputs[1])
        assert (results[4] is None) == (rank != 2)
        np.testing.assert_array_equal(results[5], oracle.alltoall(inputs)[rank])
        sent = oracle.alltoallv([inputs[r][: 2 * r] for r in range(3)], [[r, r, 0]
                                                                          for r in range(3)])
        np.testing.assert_array_equal(results[6], sent[rank])
        np.testing.assert_array_equal(results[7], sent[rank])  # into the out given
        assert results[8] is None
        if rank == 1:
            np.testing.assert_array_equal(results[9], inputs[0])
        np.testing.assert_array_equal(blocking, oracle.allreduce(inputs, "sum"))


@pytest.mark.parametrize("counts", [None, [3, 0, 4]])
def test_async_allgather_and_reduce_scatter_in_place(counts):
    """NCCL's in place through async_op: its check at the call takes this rank's rows."""
    rows = counts or [2, 2, 2]
    starts = np.cumsum([0, *rows])
    inputs = [exact_input(r, 6 if counts is None else 7, np.dtype(np.int32), "sum")
              for r in range(3)]

    def body(rank):
        out = np.zeros(sum(rows), np.int32)
        mine = out[starts[rank]:starts[rank + 1]]
        mine[...] = inputs[rank][: rows[rank]]
        gathered = pycoll.allgather(mine, counts=counts, out=out, async_op=True)
        x = inputs[rank].copy()
        shard = x[starts[rank]:starts[rank + 1]]
        reduced = pycoll.reduce_scatter(x, counts=counts, out=shard, async_op=True)
        return gathered.wait() is out and reduced.wait() is shard, out, shard

    for rank, (same, out, shard) in enumerate(run(3, body)):
        assert same
        np.testing.assert_array_equal(out, oracle.allgather([x[:n] for x, n in zip(inputs,
                                                                                  rows)]))
        np.testing.assert_array_equal(shard, oracle.reduce_scatter(inputs, "sum", rows)[rank])


def _read_only(x):
    x.flags.writeable = False
    return x


BAD_ASYNC_CALLS = {  # beside test_errors.BAD_CALLS, which runs async too (there)
    "gathered counts": (lambda r: pycoll.allgather(np.ones(3), counts=[2, 2], async_op=True),
                        r"counts\[\d\]=2 but this rank's x has 3 rows"),
    "read-only": (lambda r: pycoll.broadcast(_read_only(np.ones(3)), 1 - r, async_op=True),
                  "broadcast: x is read-only"),  # off the root (the root's is only read)
    "reduce out": (lambda r: pycoll.reduce(np.ones(3), root=r, out=np.ones(3, np.int8),
                                           async_op=True), "out.dtype=int8"),
    "send counts": (lambda r: pycoll.alltoallv(np.ones(3), [1, 1], async_op=True),
                    "send_counts=\\[1, 1\\] sums to 2"),
    "tag": (lambda r: pycoll.recv(np.ones(3), 1 - r, tag=-1, async_op=True),
            "tag=-1 is invalid"),
    "stream": (lambda r: pycoll.allreduce(np.ones(3), stream="s", async_op=True),
               "allreduce: stream='s' was given for numpy arrays; allowed: None"),
    "send stream": (lambda r: pycoll.send(np.ones(3), 1 - r, stream="s", async_op=True),
                    "send: stream='s' was given for numpy arrays"),
    # _writable before _space: AttributeError: 'list' object has no attribute 'flags'
    "not an array": (lambda r: pycoll.broadcast([1, 2], async_op=True),
                     "broadcast: x is a list; allowed: a numpy.ndarray"),
    "alltoallv's name": (lambda r: pycoll.alltoallv(np.arange(4.0)[::2], [1, 1], async_op=True),
                         "alltoallv: x is not C-contiguous"),  # it said alltoall
    "alltoallv out": (lambda r: pycoll.alltoallv(np.ones(2), [1, 1], [1, 1],
                                                 out=np.ones(3), async_op=True),
                      r"alltoallv: out.shape=\(3,\); allowed: \(2,\)"),
}


@pytest.mark.parametrize("case", BAD_ASYNC_CALLS)
def test_bad_input_raises_at_the_async_call(case):
    """As blocking, and as torch.distributed's: raised on the worker, the error was seen only
    at wait(), and a rank that never waited (or waited later) went on a collective behind its
    peers."""
    call, error = BAD_ASYNC_CALLS[case]

    def body(rank):
        with pytest.raises((ValueError, TypeError), match=error):
            call(rank)
        return pycoll.allreduce(np.ones(3))  # still in step: nothing was sent

    for result in run(2, body):
        np.testing.assert_array_equal(result, np.full(3, 2.0))


def test_one_ranks_bad_async_call_is_not_paired_with_its_next_call():
    """Rank 0's bad op was found on its worker; its next (blocking) AllReduce then paired
    with rank 1's async one: a wrong result on rank 0, Deadlock on rank 1 (a hang under MPI)."""
    def body(rank):
        x = np.arange(4.0)
        pycoll.allreduce(x, "mean" if rank == 0 else "sum", async_op=True)
        return pycoll.allreduce(x * 10)

    with pytest.raises(ValueError, match="op='mean' is not a reduction"):
        run(2, body)


def test_an_async_collective_that_fails_on_its_worker_breaks_the_communicator(monkeypatch):
    """Past the checks at the call, a failure leaves this rank out of a collective its peers
    may be in: every later call on the communicator raises, naming it."""
    real = pycoll.api._execute

    def failing_on_rank_0(comm, *args, **kwargs):
        if comm.rank == 0:
            raise OSError("the wire came loose")
        return real(comm, *args, **kwargs)

    monkeypatch.setattr(pycoll.api, "_execute", failing_on_rank_0)
    seen = {}

    def body(rank):
        work = pycoll.allreduce(np.ones(4), algorithm="ring", async_op=True)
        if rank == 1:
            return work.wait()
        with pytest.raises(OSError, match="the wire came loose"):
            work.wait()
        for later in (lambda: pycoll.allreduce(np.ones(4)),
                      lambda: pycoll.allreduce(np.ones(4), async_op=True)):
            with pytest.raises(RuntimeError, match="broken \\(its async allreduce failed: "
                                                   "OSError: the wire came loose\\)"):
                later()
        seen["rank 0"] = "raised"
        raise ValueError("rank 0 stops")

    with pytest.raises(ValueError, match="rank 0 stops"):
        run(2, body)
    assert seen == {"rank 0": "raised"}


def test_a_blocking_call_after_a_failed_async_one_raises_without_waiting_on_it(monkeypatch):
    """Never waited: the failure is found when the next call drains the queue."""
    real = pycoll.api._execute
    monkeypatch.setattr(pycoll.api, "_execute", lambda comm, *a, **k: (
        (_ for _ in ()).throw(OSError("lost")) if comm.rank == 0 else real(comm, *a, **k)))

    def body(rank):
        pycoll.allgather(np.ones(2), algorithm="ring", async_op=True)
        if rank == 0:
            pycoll.allgather(np.ones(2))
        return "unreached"

    with pytest.raises(RuntimeError, match="its async allgather failed: OSError: lost"):
        run(2, body)


def test_an_error_the_ranks_agreed_on_leaves_the_communicator_whole():
    """AllToAllv's counts that disagree are agreed and raised on every rank, as blocking:
    still in step, so the async call's failure must not break the communicator."""
    def body(rank):
        expected = [2, 1] if rank == 0 else [1, 1]
        with pytest.raises(ValueError, match="the counts must agree between peers"):
            pycoll.alltoallv(np.arange(2), [1, 1], expected, async_op=True).wait()
        return pycoll.world().broken, pycoll.allreduce(np.ones(2)).tolist()

    assert run(2, body) == [(None, [2.0, 2.0])] * 2


def test_an_unreadable_tuning_file_leaves_the_communicator_whole(monkeypatch, tmp_path):
    """Every rank reads the same file (under MPI, is sent rank 0's verdict) and raises alike:
    still in step."""
    path = tmp_path / "tuning.json"
    path.write_text("{bad json")
    monkeypatch.setenv("PYCOLL_TUNING", str(path))

    def body(rank):
        with pytest.raises(ValueError, match="is unreadable"):
            pycoll.allreduce(np.ones(3), algorithm="ring", async_op=True).wait()
        return pycoll.world().broken

    assert run(2, body) == [None, None]


def test_async_counts_may_be_an_iterator():
    """Read once, at the call: the worker got the used-up iterator."""
    def body(rank):
        gathered = pycoll.allgather(np.ones(rank + 1), counts=iter([1, 2]), async_op=True)
        scattered = pycoll.reduce_scatter(np.arange(3.0), counts=iter([2, 1]), async_op=True)
        sent = pycoll.alltoallv(np.arange(3.0), iter([1, 2]), iter([1 + rank, 1 + rank]),
                                async_op=True)
        return gathered.wait().tolist(), scattered.wait().tolist(), sent.wait().tolist()

    assert run(2, body) == [([1.0, 1.0, 1.0], [0.0, 2.0], [0.0, 0.0]),
                            ([1.0, 1.0, 1.0], [4.0], [1.0, 2.0, 1.0, 2.0])]


def test_a_deadlock_through_async_work_is_reported_at_once(monkeypatch):
    """Rank 0 waits on its async AllReduce; rank 1 waits to receive what rank 0 never sends:
    every thread that could post is blocked, so Deadlock (naming both) comes at once, not after
    PYCOLL_TIMEOUT."""
    monkeypatch.delenv("PYCOLL_TIMEOUT", raising=False)

    def body(rank):
        if rank == 0:
            pycoll.allreduce(np.ones(4), algorithm="ring", async_op=True).wait()
        else:
            pycoll.recv(np.empty(4), 0)

    started = time.monotonic()
    with pytest.raises((pycoll.Deadlock, pycoll.PeerFailed), match="deadlock") as caught:
        run(2, body)
    assert time.monotonic() - started < 10
    assert "rank 0 waits for its allreduce" in str(caught.value)
    assert "rank 1 waits to receive from rank 0" in str(caught.value)


def test_a_rank_whose_own_thread_waits_while_a_peer_computes_is_no_deadlock(monkeypatch):
    """Rank 0 and a thread it started both wait to receive; rank 1 computes, then sends to
    both. Two blocked threads of two live ranks looked like every thread blocked: a false
    Deadlock, while the same program runs under MPI."""
    monkeypatch.delenv("PYCOLL_TIMEOUT", raising=False)

    def body(rank):
        comm = pycoll.world()
        if rank == 1:
            time.sleep(1.0)  # computing: in no wait
            pycoll.send(np.array([1, 1]), 0, tag=1)
            pycoll.send(np.array([2, 2]), 0, tag=2)
            return None
        got = np.zeros(2, np.int64)
        helper = threading.Thread(target=pycoll.recv, args=(got, 1, 2), kwargs={"comm": comm})
        helper.start()
        first = pycoll.recv(np.zeros(2, np.int64), 1, tag=1)
        helper.join()
        return first.tolist(), got.tolist()

    assert run(2, body)[0] == ([1, 1], [2, 2])


@pytest.mark.parametrize("idle", ["pool", "event"])
def test_a_thread_that_never_posts_leaves_a_deadlock_reported(monkeypatch, idle):
    """A rank's thread that never posts (a pool's idle worker, a thread waiting on an Event)
    cannot end a deadlock: it must not turn the verdict off (every live thread counted did)."""
    import concurrent.futures

    monkeypatch.delenv("PYCOLL_TIMEOUT", raising=False)
    release = threading.Event()

    def body(rank):
        if rank == 0 and idle == "pool":
            pool = concurrent.futures.ThreadPoolExecutor(1)
            pool.submit(lambda: None).result()
        elif rank == 0:
            threading.Thread(target=release.wait, daemon=True).start()
        pycoll.recv(np.zeros(3), 1 - rank, tag=1)  # both receive: nothing can come

    started = time.monotonic()
    try:
        with pytest.raises((pycoll.Deadlock, pycoll.PeerFailed), match="deadlock"):
            run(2, body)
    finally:
        release.set()
    assert time.monotonic() - started < 10


def test_a_deadlock_with_a_rank_started_thread_is_still_reported(monkeypatch):
    """Rank 1 returns without sending: rank 0 and its thread wait for nothing that can
    come, and both are counted as blocked."""
    monkeypatch.delenv("PYCOLL_TIMEOUT", raising=False)
    errors = []

    def body(rank):
        comm = pycoll.world()
        if rank == 1:
            return

        def receive():
            try:
                pycoll.recv(np.zeros(2), 1, tag=2, comm=comm)
            except Exception as error:  # the verdict reaches this thread too
                errors.append(error)

        helper = threading.Thread(target=receive)
        helper.start()
        try:
            pycoll.recv(np.zeros(2), 1, tag=1)
        finally:
            helper.join()

    started = time.monotonic()
    with pytest.raises((pycoll.Deadlock, pycoll.PeerFailed), match="deadlock|returned"):
        run(2, body)
    assert time.monotonic() - started < 10
    assert errors and all(isinstance(e, (pycoll.Deadlock, pycoll.PeerFailed)) for e in errors)


@pytest.mark.parametrize("park", ["wait", "drain"])
def test_a_rank_busy_beside_its_async_work_is_no_deadlock(park):
    """While rank 0 computes (not in any wait) beside its async AllReduce, rank 1 waits for a
    message rank 0 has yet to send (on a second communicator, which need not wait for the
    first's queue): no verdict; the program completes."""
    def body(rank):
        x = np.full(4, rank + 1.0)
        other = pycoll.world().split(0)
        if rank == 0:
            work = pycoll.allreduce(x, async_op=True)
            time.sleep(1.5)  # the others are blocked all this time
            pycoll.send(np.arange(4.0), 1, comm=other)
            result = work.wait() if park == "wait" else pycoll.allreduce(x)  # drains first
        else:
            got = pycoll.recv(np.empty(4), 0, comm=other)
            result = pycoll.allreduce(x)
            if park == "drain":
                result = pycoll.allreduce(x)
            np.testing.assert_array_equal(got, np.arange(4.0))
        return result

    for result in run(2, body):
        np.testing.assert_array_equal(result, np.full(4, 3.0))


@pytest.mark.parametrize("nranks", [2, 3])
def test_async_send_and_recv_post_like_irecv_and_isend(nranks):
    """A posted receive holds back no send (each direction and peer has its own worker), and
    a blocking receive does not wait for this rank's own queued sends: the exchanges MPI's
    Irecv/Isend and torch.distributed's ring tutorial make, which queued one after another
    would deadlock."""

    def body():
        rank = pycoll.world().rank
        right, left = (rank + 1) % nranks, (rank - 1) % nranks
        got, got_big = np.empty(4), np.empty(1 << 16)
        receiving = pycoll.recv(got, left, tag=7, async_op=True)
        sending = pycoll.send(np.full(4, float(rank)), right, tag=7, async_op=True)
        sending.wait()
        receiving.wait()
        sending = pycoll.send(np.full(1 << 16, float(rank)), right, tag=8, async_op=True)
        pycoll.recv(got_big, left, tag=8)
        sending.wait()
        return got[0], got_big[-1]

    for rank, (small, big) in enumerate(pycoll.run_local(nranks, body)):
        assert small == big == (rank - 1) % nranks


@pytest.mark.parametrize("blocking_second", [False, True])
def test_receives_posted_out_of_tag_order_match_by_tag(blocking_second):
    """As MPI matches by tag: receives posted for tags 2 then 1 take sends of tags 1 then 2,
    each waiting for its receive (in-process sends do), with the second send async or
    blocking. One worker per direction and peer ran them in call order: a deadlock."""
    n = 1 << 10

    def body():
        rank = pycoll.world().rank
        if rank == 0:
            first = pycoll.send(np.full(n, 1.0), 1, tag=1, async_op=True)
            if blocking_second:
                pycoll.send(np.full(n, 2.0), 1, tag=2)
            else:
                pycoll.send(np.full(n, 2.0), 1, tag=2, async_op=True).wait()
            first.wait()
            return None
        second, first = np.empty(n), np.empty(n)
        waiting = [pycoll.recv(second, 0, tag=2, async_op=True),
                   pycoll.recv(first, 0, tag=1, async_op=True)]
        for work in waiting:
            work.wait()
        return first[-1], second[-1]

    assert pycoll.run_local(2, body)[1] == (1.0, 2.0)


def test_async_host_send_and_recv_are_posted_without_threads():
    """Posted as MPI's Isend/Irecv: 200 receives on 200 tags, posted in the reverse order of
    their sends, start no thread and complete."""
    def body():
        comm = pycoll.world()
        peer = 1 - comm.rank
        threads = set(threading.enumerate())  # (a count: other tests' threads end meanwhile)
        got = [np.empty(2) for _ in range(200)]
        if comm.rank == 1:
            works = [pycoll.recv(got[t], peer, tag=t, async_op=True) for t in reversed(range(200))]
        else:
            works = [pycoll.send(np.full(2, float(t)), peer, tag=t, async_op=True)
                     for t in range(200)]
        # (not the other rank's thread, which may start after this one looked)
        started = len({t for t in set(threading.enumerate()) - threads
                       if not t.name.startswith("pycoll-rank-")})
        for work in works:
            work.wait()
        assert all(work.done() for work in works)
        return started, comm.lanes, [g[0] for g in got] if comm.rank == 1 else None

    results = pycoll.run_local(2, body)
    assert [(started, lanes) for started, lanes, _ in results] == [(0, {}), (0, {})]
    assert results[1][2] == [float(t) for t in range(200)]


def test_an_async_receives_deadline_counts_from_wait(monkeypatch):
    """A receive posted early and polled with done() meanwhile is not late: its deadline
    (the communicator's timeout) starts when the program waits for it."""
    monkeypatch.setenv("PYCOLL_TIMEOUT", "0.3")

    def body():
        comm = pycoll.world()
        if comm.rank == 0:
            time.sleep(0.6)
            pycoll.send(np.full(3, 4.0), 1, tag=2)
            return None
        stop = pycoll.recv(np.empty(3), 0, tag=2, async_op=True)
        polled = 0
        while not stop.done():
            polled += 1
            time.sleep(0.01)
        return polled > 10, stop.wait()[0]

    assert pycoll.run_local(2, body)[1] == (True, 4.0)


def test_async_sends_to_one_peer_arrive_in_call_order():
    def body():
        rank = pycoll.world().rank
        if rank == 0:
            works = [pycoll.send(np.full(3, float(i)), 1, tag=5, async_op=True)
                     for i in range(20)]
            for work in works:
                work.wait()
            return None
        return [pycoll.recv(np.empty(3), 0, tag=5)[0] for _ in range(20)]

    assert pycoll.run_local(2, body)[1] == [float(i) for i in range(20)]


def test_free_ends_the_async_workers():
    import threading

    def body():
        sub = pycoll.world().split(0)
        pycoll.allreduce(np.ones(3), comm=sub, async_op=True).wait()
        peer = 1 - sub.rank
        pycoll.send(np.ones(2), peer, comm=sub, async_op=True)
        pycoll.recv(np.empty(2), peer, comm=sub, async_op=True).wait()
        workers = {q.worker for q in [sub.queue, *sub.lanes.values()]}
        sub.free()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            alive = {t.ident for t in threading.enumerate()} & workers
            if not alive:
                return True
            time.sleep(0.01)
        return False

    assert pycoll.run_local(2, body) == [True, True]


@pytest.mark.parametrize("call", [
    lambda flag: pycoll.allreduce(np.ones(2), async_op=flag),
    lambda flag: pycoll.reduce_scatter(np.ones(2), async_op=flag),
    lambda flag: pycoll.allgather(np.ones(2), async_op=flag),
    lambda flag: pycoll.broadcast(np.ones(2), async_op=flag),
    lambda flag: pycoll.reduce(np.ones(2), async_op=flag),
    lambda flag: pycoll.alltoall(np.ones(2), async_op=flag),
    lambda flag: pycoll.alltoallv(np.ones(2), [2], async_op=flag),
    lambda flag: pycoll.barrier(async_op=flag),
])
def test_async_op_takes_a_bool_and_names_anything_else(call):
    """async_op="no" ran asynchronously (any truthy value did); None, 0 and [] ran blocking,
    and an array raised numpy's ambiguity error."""
    for flag, shown in [("no", "'no'"), (None, "None"), (0, "0"), ([], r"\[\]"),
                        (np.ones(2), r"array\(\[1., 1.\]\)")]:
        with pytest.raises(ValueError, match=f"async_op={shown} is invalid; allowed: True or "
                                             "False"):
            pycoll.run_local(1, call, flag)
    assert pycoll.run_local(1, lambda: (call(np.True_).wait(), True)[1]) == [True]
    assert pycoll.run_local(1, lambda: not hasattr(call(np.False_), "wait")) == [True]


def test_point_to_point_async_op_takes_a_bool():
    def body():
        for call in (lambda: pycoll.send(np.ones(2), 1, async_op="no"),
                     lambda: pycoll.recv(np.ones(2), 1, async_op="no")):
            with pytest.raises(ValueError, match="async_op='no' is invalid"):
                call()
        return True

    assert pycoll.run_local(2, lambda: pycoll.world().rank == 1 or body()) == [True, True]


def test_a_thread_a_rank_starts_may_compute_before_it_sends():
    """Rank 0's thread computes, then sends; meanwhile both ranks' own threads wait (rank 0
    for rank 1's reply, rank 1 for the thread's message). Under MPI this completes; the
    verdict counted only threads that had posted, and called it a deadlock at once."""
    assert pycoll.run_local(2, _a_thread_computes_then_sends)[0] == [10.0, 20.0]


def _a_thread_computes_then_sends(before_starting=lambda: None):
    """Rank 0 starts a thread that computes, then sends to rank 1, and waits for rank 1's
    reply (the message times 10); returns the reply on rank 0."""
    comm = pycoll.world()
    if comm.rank == 1:
        got = pycoll.recv(np.zeros(2), 0, tag=1)
        pycoll.send(got * 10, 0, tag=2)
        return None
    before_starting()

    def compute_then_send():
        time.sleep(0.5)
        pycoll.send(np.array([1.0, 2.0]), 1, tag=1, comm=comm)

    sender = threading.Thread(target=compute_then_send)
    sender.start()
    reply = pycoll.recv(np.zeros(2), 1, tag=2)
    sender.join()
    return reply.tolist()


def test_an_async_receive_is_done_once_a_peer_fails():
    """done() turns True when the world fails (then wait() says why), as torch's
    is_completed() does for failed work: a program polling done() must not spin forever."""
    seen = {}

    def body():
        if pycoll.world().rank == 0:
            time.sleep(0.1)
            raise ValueError("rank 0 gives up")
        work = pycoll.recv(np.zeros(3), 0, async_op=True)
        started = time.monotonic()
        while not work.done() and time.monotonic() - started < 5:
            time.sleep(0.01)
        seen["done"] = work.done() and work.is_completed()  # torch's name for done()
        with pytest.raises(pycoll.PeerFailed, match="rank 0 failed"):
            work.wait()
        seen["raised"] = True

    with pytest.raises(ValueError, match="rank 0 gives up"):
        pycoll.run_local(2, body)
    assert seen == {"done": True, "raised": True}


def test_a_communicator_kept_after_its_run_fails_at_once():
    """A communicator outlives the run_local that made it (kept in a cache): used in a later
    run, whose other ranks never join it, it raised nothing and waited forever."""
    kept = {}
    pycoll.run_local(2, lambda: kept.setdefault(pycoll.world().rank, pycoll.world()))

    def body():
        if pycoll.world().rank == 0:
            pycoll.allreduce(np.ones(2), comm=kept[0])

    with pytest.raises(pycoll.PeerFailed, match="run_local that made this communicator has "
                                                "returned"):
        pycoll.run_local(2, body)


def test_changing_the_timeout_lets_queued_async_collectives_finish_first():
    """Queued without a deadline, an async collective kept none when the timeout was set
    after it: rank 1 comes 0.5 s late, beyond the 0.1 s set once the call was queued."""
    def body():
        comm = pycoll.world()
        if comm.rank == 1:
            time.sleep(0.5)
        work = pycoll.allreduce(np.ones(3), algorithm="ring", async_op=True)
        comm.timeout = 0.1
        return work.wait().tolist()

    assert pycoll.run_local(2, body) == [[2.0] * 3] * 2


def test_ctrl_c_in_run_local_stops_its_ranks():
    """Ctrl-C reached the caller of run_local while its ranks ran on, forever (a notebook
    kept burning CPU): now each stops at its next wait."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import os, signal, threading, time
        import numpy as np, pycoll

        def body():
            while True:
                pycoll.allreduce(np.ones(4))

        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        try:
            pycoll.run_local(2, body)
        except KeyboardInterrupt:
            print("interrupted")
        time.sleep(0.5)
        print("running:", [t.name for t in threading.enumerate() if t.name.startswith("pycoll-")])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.splitlines()[:2] == ["interrupted", "running: []"], done.stdout + done.stderr


def test_a_thread_reusing_an_ended_threads_ident_is_still_new():
    """A thread alive when run_local began ends; a rank then starts one that computes before
    it sends, which Linux gives the ended thread's ident: known by ident, it passed for a
    thread from before the run (not one that may yet post), and a Deadlock was called."""
    release = threading.Event()
    lingering = threading.Thread(target=release.wait)
    lingering.start()

    def end_the_lingering_thread():
        release.set()
        lingering.join()

    assert pycoll.run_local(2, _a_thread_computes_then_sends,
                            end_the_lingering_thread)[0] == [10.0, 20.0]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_free_lets_queued_collectives_and_posted_send_recv_finish(monkeypatch, transport):
    """As the README says of free(): queued async collectives finish first, and a posted
    Send/Recv still completes after it (as after MPI_Comm_free), a dropped send included."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", transport)
    count = 1 << 18  # beyond the shared-memory ring's one piece

    def body(rank):
        comm = pycoll.world().split(0)
        comm.timeout = 20
        queued = pycoll.allreduce(np.full(5, rank + 1), comm=comm, async_op=True)
        if rank == 0:
            message = np.zeros(count)
            posted = pycoll.recv(message, 1, tag=3, comm=comm, async_op=True)
        else:
            pycoll.send(np.arange(count, dtype=np.float64), 0, tag=3, comm=comm,
                        async_op=True)  # dropped unwaited
        comm.free()
        assert queued.done()
        total = queued.wait()
        return total, posted.wait() if rank == 0 else None

    (total, message), (other, _) = run(2, body)
    np.testing.assert_array_equal(total, np.full(5, 3))
    np.testing.assert_array_equal(other, np.full(5, 3))
    np.testing.assert_array_equal(message, np.arange(count, dtype=np.float64))


def test_an_async_failure_never_waited_is_said_not_lost(capfd):
    """Rank 0's async allreduce that rank 1 never joined timed out and was never waited: the
    run returned as a success and the error went nowhere (without a timeout: a Deadlock)."""
    import gc

    from pycoll import work

    def body(wait: bool):
        comm = pycoll.world()
        comm.timeout = 0.3
        if comm.rank == 1:
            time.sleep(0.6)
            return None
        handle = pycoll.allreduce(np.ones(4), async_op=True)
        if wait:
            with pytest.raises(pycoll.CollectiveTimeout):
                handle.wait()
        return None

    gc.collect()
    work._say_unretrieved()  # earlier tests' (what exit runs)
    capfd.readouterr()
    pycoll.run_local(2, lambda: body(wait=True))
    gc.collect()
    work._say_unretrieved()
    assert "never waited" not in capfd.readouterr().err  # raised to its wait(): said there
    pycoll.run_local(2, lambda: body(wait=False))
    gc.collect()
    work._say_unretrieved()
    err = capfd.readouterr().err
    assert err.count("pycoll: an async allreduce failed and was never waited: "
                     "CollectiveTimeout: allreduce") == 1, err


class _OneThreadMPI:
    """What a Posted asks of its communicator below MPI_THREAD_MULTIPLE."""

    threads_may_call_mpi = False


class _NeverDone:
    def test(self, request):
        return False

    def waitall(self, requests):
        raise AssertionError("waited on a thread MPI forbids")


def test_a_posted_message_below_thread_multiple_is_waited_on_its_posting_thread():
    """Another thread's MPI_Wait beside the main thread's calls crashed MPICH (serialized);
    such a wait or done() raises instead, naming the setting; repr may come from anywhere
    (logging), so it asks MPI nothing."""
    from pycoll.work import Posted

    posted = Posted(_NeverDone(), object(), (False, 0, 3), None, comm=_OneThreadMPI())
    seen: dict[str, str] = {}

    def elsewhere():
        seen["repr"] = repr(posted)
        for call in ("wait", "done"):
            try:
                getattr(posted, call)()
            except RuntimeError as error:
                seen[call] = str(error)

    helper = threading.Thread(target=elsewhere)
    helper.start()
    helper.join()
    assert seen["repr"] == "Work(recv from rank 0 (tag 3), posted)"
    for call in ("wait", "done"):
        assert seen[call].startswith(f"recv from rank 0 (tag 3): {call}() from a thread other "
                                     "than the one that posted it needs MPI_THREAD_MULTIPLE")
    assert posted.done() is False  # on the posting thread: asked


def test_ctrl_c_midway_breaks_a_communicator_with_peers_not_a_world_of_one():
    """Ctrl-C in a notebook's call on the default world of one broke it for good (world()
    gives the same one): with no peer left in the call, nothing needs breaking."""
    alone = pycoll.world()
    alone.interrupted("allreduce (ring)", KeyboardInterrupt())
    assert alone.broken is None and pycoll.allreduce(np.ones(2)).tolist() == [1.0, 1.0]

    def body():
        comm = pycoll.world()
        comm.interrupted("allreduce (ring)", KeyboardInterrupt())
        try:
            pycoll.allreduce(np.ones(2))
        except RuntimeError as error:
            return str(error)

    for said in pycoll.run_local(2, body):
        assert said.endswith("is broken (allreduce (ring) was interrupted by KeyboardInterrupt "
                             "midway, and the other ranks may still be in it); make a new "
                             "communicator")
