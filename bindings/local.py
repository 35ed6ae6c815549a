"""The in-process world: ranks are threads of one process, messages are numpy copies.

Sends are rendezvous: the receiver copies straight from the sender's array, and the send
completes only then, so a schedule that would hang on MPI's rendezvous protocol hangs here too,
and is reported. No rank can wait forever: when a rank raises, every other rank's wait raises
:class:`PeerFailed`; when every live rank waits and nothing can arrive, all of them raise
:class:`Deadlock`, naming who waits for whom.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from pycoll.bindings.transport import PeerFailed, WaitTimeout, counts_disagree


class Deadlock(RuntimeError):
    """Every live rank waits for a message that no rank will send."""


class _Request:
    __slots__ = ("buf", "rank", "peer", "tag", "kind", "_done", "sent_bytes")

    def __init__(self, buf: np.ndarray, rank: int, peer: int, tag: int, kind: str):
        self.buf, self.rank, self.peer, self.tag, self.kind = buf, rank, peer, tag, kind
        self._done = False
        self.sent_bytes: int | None = None  # a receive's message, where its size differed

    def done(self) -> bool:
        return self._done

    def describe(self) -> str:
        verb = "send to" if self.kind == "send" else "receive from"
        return f"{verb} rank {self.peer} (tag {self.tag}, {self.buf.nbytes} bytes)"


def _bytes_of(buf: np.ndarray) -> np.ndarray:
    """A flat byte view of a contiguous array (what the executor hands a transport)."""
    if not buf.flags.c_contiguous:  # reshape would copy, and a receive would fill the copy
        raise ValueError(f"a message buffer must be contiguous; got strides {buf.strides}")
    return buf.reshape(-1).view(np.uint8)


DEADLOCK_GRACE = 3.0  # seconds a verdict waits for threads started by ranks to post


class LocalWorld:
    """Mailboxes shared by the threads of one in-process world."""

    def __init__(self, nranks: int, threads_before: set[threading.Thread] | None = None):
        self.nranks = nranks
        self._lock = threading.Lock()
        # One condition per rank on the shared lock: a completed message wakes its two ranks,
        # not every waiting thread.
        self._wakeup = [threading.Condition(self._lock) for _ in range(nranks)]
        # (channel, src, dst, tag) -> requests posted first, waiting for their match
        self._unmatched_sends: dict[tuple, deque[_Request]] = defaultdict(deque)
        self._unmatched_recvs: dict[tuple, deque[_Request]] = defaultdict(deque)
        # (rank, thread) -> the request it is blocked on (a rank's async collectives wait on
        # threads of their own)
        self._waiting: dict[tuple[int, int], _Request] = {}
        # Threads that can still post besides each live rank's own: async workers with work
        # queued. Threads parked in Work.wait() can post nothing until that work finishes.
        self.busy_workers = 0
        self._parked: dict[tuple[int, int], tuple[str, list]] = {}  # -> (what, its futures)
        # (rank, thread) -> [world ranks awaited, idle checks since anything changed, the
        # thread]: threads that poll shared memory, which the world sees only through
        # check_waiting. An entry of a thread that found its data and left stays until it
        # waits, posts, returns or ends.
        self._polling: dict[tuple[int, int], list] = {}
        self._finished: set[int] = set()
        self.failure: BaseException | None = None
        self.failed_rank: int | None = None
        self.shared: dict[Any, Any] = {}  # objects every rank of the world uses (setdefault)
        # Threads that have posted in this world: a rank's own threads among them may post
        # again (an idle thread that never posts, a pool's worker, cannot end a deadlock).
        # Thread objects, not idents, which a new thread may reuse once an old one ended.
        self._posters: set[threading.Thread] = set()
        # A thread started since, which has yet to post, may be computing what it will send:
        # it holds a deadlock's verdict for DEADLOCK_GRACE seconds without progress.
        self._threads_before = (set(threading.enumerate()) if threads_before is None
                                else threads_before)
        self._last_progress = time.monotonic()
        self._queues: dict[int, list[Any]] = defaultdict(list)  # rank -> its async workers

    def add_queue(self, rank: int, queue: Any) -> None:
        """``queue`` (pycoll/work.py's AsyncQueue) runs async collectives for ``rank``."""
        with self._lock:
            self._queues[rank].append(queue)

    def remove_queue(self, rank: int, queue: Any) -> None:
        """``queue`` is closed (its communicator freed): its rank's return need not drain it
        (a world that lives on kept every freed one)."""
        with self._lock:
            queues = self._queues.get(rank, [])
            if queue in queues:
                queues.remove(queue)

    def drain_queues(self, rank: int) -> None:
        """A rank that returns lets its async work finish first, as a process's exit waits
        for its executor threads: left running, it outlived run_local (a thread and every
        buffer per communicator, gigabytes over quick runs), and could fail at close."""
        with self._lock:
            queues = list(self._queues.get(rank, ()))
        for queue in queues:
            queue.drain()

    def endpoint(self, rank: int, channel: str = "collective") -> LocalTransport:
        return LocalTransport(self, rank, channel)

    def fail(self, rank: int | None, error: BaseException) -> None:
        """Record the first failure and wake every waiting rank."""
        with self._lock:
            if self.failure is None:
                self.failure, self.failed_rank = error, rank
            self._wake_everyone()

    def finish(self, rank: int) -> None:
        with self._lock:
            self._finished.add(rank)
            for me in [me for me in self._polling if me[0] == rank]:
                del self._polling[me]
            self.changed()  # what it wrote in shared memory before returning, unreported
            self._wake_everyone()

    def forget_polling(self, rank: int, thread: int | None) -> None:
        """``thread`` of ``rank`` polls no more (an async worker gone idle, having perhaps
        written in shared memory since its last look). Under the lock."""
        self._polling.pop((rank, thread), None)
        self.changed()

    def changed(self) -> None:
        """Something moved or may move (a message, a thread newly blocked, a worker given
        work): what the polling threads saw before no longer rules anything out. Under the
        lock."""
        self._last_progress = time.monotonic()
        for entry in self._polling.values():
            entry[1] = 0

    def close(self, why: str = "the run_local that made this communicator has returned; use "
              "a communicator within the run that made it") -> None:
        """The run is over: every wait, and every later call on a communicator kept from it,
        fails at once (its peers are gone) rather than wait for ranks that will never call."""
        self.fail(None, RuntimeError(why))
        with self._lock:
            queues = [queue for kept in self._queues.values() for queue in kept]
            self._queues.clear()  # (each holds this world: no cycle left for the collector)
        for queue in queues:  # their threads end once idle, not when collected
            queue.close()

    def _wake_everyone(self) -> None:
        for condition in self._wakeup:
            condition.notify_all()

    def _raise_if_failed(self, rank: int) -> None:
        if self.failure is not None and self.failed_rank is None:  # closed
            raise PeerFailed(f"rank {rank}: {self.failure}")
        if self.failure is not None:
            raise PeerFailed(
                f"rank {rank}: rank {self.failed_rank} failed "
                f"({type(self.failure).__name__}: {self.failure}); this collective cannot complete"
            )

    def check_waiting(self, rank: int, awaited: list[int], moved: bool = True) -> None:
        """For ranks that wait by polling shared memory, now and then after a poll that found
        nothing (``moved``: the rank wrote or read anything since its last call): raise if
        the world failed, if every rank awaited has returned (nothing more can arrive from
        them), or if every thread that could write waits too."""
        me = (rank, threading.get_ident())
        with self._lock:
            self._raise_if_failed(rank)
            if awaited and all(peer in self._finished for peer in awaited):
                error = Deadlock(
                    f"deadlock: rank {rank} waits for ranks {sorted(awaited)}, which already "
                    "returned"
                )
                if self.failure is None:
                    self.failure, self.failed_rank = error, rank
                self._wake_everyone()
                raise error
            # a thread a rank started counts among the threads that may move data, as a
            # poster does: else its polling stood in for a rank's own thread still computing
            self._posters.add(threading.current_thread())
            entry = self._polling.get(me)
            if moved or entry is None or entry[0] != sorted(awaited):
                self._polling[me] = [sorted(awaited), 0, threading.current_thread()]
                self.changed()  # a thread newly blocked, or one whose writes may free others
            else:
                entry[1] += 1
            if self._nobody_can_progress():
                self._report_deadlock()

    def post(self, request: _Request, channel: str, messages_only: bool = False) -> _Request:
        """Match ``request`` with its partner, if posted, and copy. A size mismatch fails the
        world, except where ``messages_only`` (Send/Recv): there, as under MPI, the receive
        alone fails (its wait raises) and the send completes."""
        if request.kind == "send":
            key = (channel, request.rank, request.peer, request.tag)
            mine, theirs = self._unmatched_sends, self._unmatched_recvs
        else:
            key = (channel, request.peer, request.rank, request.tag)
            mine, theirs = self._unmatched_recvs, self._unmatched_sends
        with self._lock:
            self._raise_if_failed(request.rank)
            self._posters.add(threading.current_thread())
            self._polling.pop((request.rank, threading.get_ident()), None)  # it polls no more
            self.changed()
            waiting = theirs.get(key)
            if not waiting:
                mine[key].append(request)
                return request
            partner = waiting.popleft()
            if not waiting:  # a key per tag ever used would pile up
                del theirs[key]
        # Copy outside the lock so that copies between other pairs run concurrently.
        send, recv = (request, partner) if request.kind == "send" else (partner, request)
        try:
            if send.buf.nbytes == recv.buf.nbytes:  # bytes, as MPI moves them: any dtypes
                np.copyto(_bytes_of(recv.buf), _bytes_of(send.buf))
            elif messages_only:
                recv.sent_bytes = send.buf.nbytes  # MPI's partial receive: what fits
                nbytes = min(send.buf.nbytes, recv.buf.nbytes)
                np.copyto(_bytes_of(recv.buf)[:nbytes], _bytes_of(send.buf)[:nbytes])
            else:
                raise ValueError(
                    f"rank {send.rank} sends {send.buf.nbytes} bytes to rank {recv.rank}, "
                    f"which expects {recv.buf.nbytes} (tag {send.tag}); the ranks disagree on "
                    "counts"
                )
        except BaseException as error:
            self.fail(request.rank, error)
            raise
        with self._lock:
            send._done = recv._done = True
            self.changed()
            self._wakeup[send.rank].notify_all()
            self._wakeup[recv.rank].notify_all()
        return request

    def wait(self, rank: int, requests: list[_Request], timeout: float | None = None) -> None:
        """Block until every request is done; ``timeout`` seconds at most (WaitTimeout names
        the world ranks still awaited)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        me = (rank, threading.get_ident())
        with self._lock:
            if self._polling.pop(me, None) is not None or not all(r._done for r in requests):
                self.changed()  # blocked here now, not polling
            for request in requests:
                while not request._done:
                    self._raise_if_failed(rank)
                    self._waiting[me] = request
                    if self._nobody_can_progress():
                        self._report_deadlock()
                    left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
                    if left <= 0:
                        del self._waiting[me]
                        raise WaitTimeout(sorted({r.peer for r in requests if not r._done}),
                                          timeout)
                    self._wakeup[rank].wait(timeout=left)
                    del self._waiting[me]
            self._raise_if_failed(rank)

    @contextmanager
    def parked(self, rank: int, what: str, futures: list) -> Iterator[None]:
        """Rank ``rank``'s thread blocks on its own async work (``what``: ``futures``) meanwhile;
        it counts as blocked while any of them is unfinished."""
        me = (rank, threading.get_ident())
        with self._lock:
            self._polling.pop(me, None)
            self._parked[me] = (what, futures)
            self.changed()
            self._wake_everyone()  # the last thread to block lets the waiters judge
        try:
            yield
        finally:
            with self._lock:
                del self._parked[me]

    def _nobody_can_progress(self) -> bool:
        """Every thread that could post blocks: each live rank's own (in a wait, parked on
        its async work, or polling shared memory), every busy async worker and every thread a
        rank started, and no awaited message has completed. A polling thread counts once it
        has found nothing twice since the last change: its second look began after the
        change, so it saw every write made before it (and a thread blocked writes nothing)."""
        threads = self.nranks - len(self._finished) + self.busy_workers
        ended = [me for me, (_, _, thread) in self._polling.items() if not thread.is_alive()]
        for me in ended:  # a thread that polled, then ended: its entry would hold back
            del self._polling[me]  # every verdict
        if ended:
            self.changed()  # what it wrote before it ended, unreported
        if any(checks < 2 for _, checks, _ in self._polling.values()):
            return False
        blocked = len(self._waiting) + len(self._polling) + sum(
            not all(f.done() for f in futures) for _, futures in self._parked.values()
        )
        if blocked < threads:  # the common verdict, without counting the ranks' threads
            return False
        posters, newcomers = self._threads_started_by_ranks()
        if blocked != threads + posters or any(r._done for r in self._waiting.values()):
            return False
        return not newcomers or time.monotonic() - self._last_progress > DEADLOCK_GRACE

    def _threads_started_by_ranks(self) -> tuple[int, int]:
        """Live threads, not pycoll's own (ranks, async workers): those that have posted here
        (a rank's, which may post again with its rank's communicator: a rank computing while
        its helper thread waits is no deadlock), and those started since the world was made
        that have not (yet)."""
        posters = newcomers = 0
        for thread in threading.enumerate():
            if thread.name.startswith("pycoll-"):
                continue
            if thread in self._posters:
                posters += 1
            elif thread not in self._threads_before:
                newcomers += 1
        return posters, newcomers

    def _report_deadlock(self) -> None:
        waits = "; ".join(
            [f"rank {rank} waits to {request.describe()}"
             for (rank, _), request in sorted(self._waiting.items())]
            + [f"rank {rank} waits for its {what}"
               for (rank, _), (what, _) in sorted(self._parked.items())]
            + [f"rank {rank} waits in shared memory for rank(s) "
               f"{', '.join(map(str, sorted(awaited)))}"
               for (rank, _), (awaited, _, _) in sorted(self._polling.items())]
        )
        done = sorted(self._finished)
        error = Deadlock(
            f"deadlock: {waits}" + (f"; ranks {done} already returned" if done else "")
        )
        if self.failure is None:
            self.failure, self.failed_rank = error, min(
                [*self._waiting, *self._parked, *self._polling])[0]
        self._wake_everyone()
        raise error


class LocalTransport:
    """One rank's endpoint on one channel of a :class:`LocalWorld`.

    ``members`` lists the world ranks of this endpoint's group in group order, so that a
    sub-communicator speaks in its own rank numbers; None means the whole world.
    """

    def __init__(
        self, world: LocalWorld, rank: int, channel: str, members: list[int] | None = None
    ):
        self.world, self.channel = world, channel
        # Send/Recv's channels: a message of the wrong size fails its receive alone
        self.messages_only = channel == "p2p" or channel.endswith("/p2p")
        self.members = list(range(world.nranks)) if members is None else members
        self.world_rank = rank
        self.timeout: float | None = None  # seconds each wait may take (None: no deadline)
        self.rank = self.members.index(rank)
        self.size = len(self.members)

    def isend(self, buf: np.ndarray, peer: int, tag: int) -> _Request:
        request = _Request(buf, self.world_rank, self.members[peer], tag, "send")
        return self.world.post(request, self.channel, self.messages_only)

    def irecv(self, buf: np.ndarray, peer: int, tag: int) -> _Request:
        request = _Request(buf, self.world_rank, self.members[peer], tag, "recv")
        return self.world.post(request, self.channel, self.messages_only)

    def waitall(self, requests: list[_Request]) -> None:
        try:
            self.world.wait(self.world_rank, requests, self.timeout)
        except WaitTimeout as late:  # world ranks -> this group's ranks
            raise WaitTimeout([self.members.index(p) for p in late.peers], late.seconds) from None
        for request in requests:  # worded as the MPI transport's, in this group's ranks
            if request.sent_bytes is not None:
                got, request.sent_bytes = request.sent_bytes, None  # raised once, as MPI does
                raise counts_disagree(self.rank, request.buf.nbytes,
                                      self.members.index(request.peer), request.tag, got)

    def sendrecv(self, send: np.ndarray, dst: int, recv: np.ndarray, src: int, tag: int) -> None:
        requests = [self.irecv(recv, src, tag), self.isend(send, dst, tag)]
        self.waitall(requests)

    def test(self, request: _Request) -> bool:
        """Whether ``request`` completed; never blocks."""
        return request.done() or self.world.failure is not None  # wait() raises why

    def subgroup(self, members: list[int], channel: str) -> LocalTransport:
        """An endpoint for the group of ``members`` (ranks of this group) on a new channel."""
        return LocalTransport(
            self.world, self.world_rank, channel, [self.members[m] for m in members]
        )


def run_threads(nranks: int, body: Callable[[int, LocalWorld], Any],
                threads_before: set[threading.Thread] | None = None) -> list[Any]:
    """Run ``body(rank, world)`` on ``nranks`` threads; return their results in rank order.

    If any rank raises, the others are released and the first failure is raised here.
    ``threads_before``: the threads alive before (not started by a rank); default: now.
    """
    world = LocalWorld(nranks, threads_before)
    results: list[Any] = [None] * nranks

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank, world)
            world.drain_queues(rank)  # a Deadlock where its work can never finish
        except BaseException as error:  # re-raised in the caller
            world.fail(rank, error)
        finally:
            world.finish(rank)

    threads = [
        threading.Thread(target=run, args=(rank,), name=f"pycoll-rank-{rank}", daemon=True)
        for rank in range(nranks)
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    except BaseException as error:  # Ctrl-C: the ranks stop at their next wait
        world.close(f"run_local was interrupted ({type(error).__name__})")
        raise
    failure = world.failure
    world.close()
    if failure is not None:
        raise failure
    return results
