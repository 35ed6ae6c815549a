"""Collectives in flight: ``async_op=True`` returns a :class:`Work` instead of the result.

Each communicator runs its async collectives one after another, in the order they were
called, on a worker thread of its own, so async collectives on different communicators overlap
each other and the caller's own work. A blocking call on a communicator first lets its queued
async collectives finish, so every rank still sees one order per communicator. Async Send/Recv
of host arrays are posted as MPI's Isend/Irecv are (:class:`Posted`); those of device arrays
have a worker per direction and peer (``Communicator.submit``'s lanes).

The contract is the seed's completion rule: until ``wait()`` returns, the output may not be
read and the input may not be changed.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pycoll.bindings.transport import WaitTimeout


class _Unretrieved:
    """Held by a failed collective's future until its ``wait()`` raises the error: if the
    future goes first (its Work dropped, or the program ending, unwaited), the error is said
    on stderr rather than lost (as asyncio says a task's "exception was never retrieved")."""

    def __init__(self, what: str, error: BaseException):
        self.what, self.error, self.retrieved = what, error, False
        _UNRETRIEVED.add(self)

    def say(self) -> None:
        if not self.retrieved:
            self.retrieved = True
            try:
                sys.stderr.write(f"pycoll: an async {self.what} failed and was never waited: "
                                 f"{type(self.error).__name__}: {self.error}\n")
            except Exception:  # at interpreter shutdown stderr may be gone
                pass

    __del__ = say


# The failures not yet retrieved: said at exit, after the workers finished (Python joins
# them before it runs atexit's functions), where a global Work would outlive stderr
_UNRETRIEVED: weakref.WeakSet[_Unretrieved] = weakref.WeakSet()


@atexit.register
def _say_unretrieved() -> None:
    for unretrieved in list(_UNRETRIEVED):
        unretrieved.say()


# Orders a future's done-callback against its wait(): a waiter woken before the callback
# runs must not leave it a failure to say that the wait raised
_RETRIEVING = threading.Lock()


def _keep_error(what: str) -> Callable[[Future], None]:
    def done(future: Future) -> None:
        if not future.cancelled() and future.exception() is not None:
            with _RETRIEVING:
                if not getattr(future, "waited", False):
                    future.unretrieved = _Unretrieved(what, future.exception())

    return done


class Work:
    """A collective in flight (as ``torch.distributed``'s ``Work``)."""

    def __init__(self, future: Future, what: str, parked: Callable[[str, list[Future]], Any]):
        self._future, self._what, self._parked = future, what, parked
        self._finish: Callable[[Any], Any] | None = None

    def then(self, finish: Callable[[Any], Any]) -> Work:
        """``wait()`` returns ``finish(what the call returned)``, run in the waiting thread."""
        self._finish = finish
        return self

    def done(self) -> bool:
        """Whether the collective has finished (successfully or not); never blocks."""
        return self._future.done()

    def is_completed(self) -> bool:
        """``done()``, by torch.distributed's name."""
        return self.done()

    def wait(self) -> Any:
        """Block until the collective has finished; return its result (what the blocking call
        returns), or raise what it raised."""
        with self._parked(self._what, [self._future]):
            self._future.exception()  # waits
        with _RETRIEVING:  # raised here, to the caller: nothing to say later
            self._future.waited = True
            unretrieved = getattr(self._future, "unretrieved", None)
            if unretrieved is not None:
                unretrieved.retrieved = True
        result = self._future.result()
        return result if self._finish is None else self._finish(result)

    def __repr__(self) -> str:
        return f"Work({self._what}, {'done' if self.done() else 'in flight'})"


class Posted(Work):
    """A host Send/Recv posted as MPI's Isend/Irecv are (pycoll/api.py ``_posted``): the
    transport completes it; ``wait()`` waits for it (a deadline counts from there) and
    returns what the blocking call returns, or raises its error."""

    def __init__(self, transport: Any, request: Any, message: tuple[bool, int, int],
                 result: Any, error: BaseException | None = None, comm: Any = None):
        # ``message``: (sending, peer, tag), put in words only for an error or a repr: a
        # posted Send/Recv costs little more than MPI's own
        self._transport, self._request, self._message = transport, request, message
        self._result, self._error, self._comm = result, error, comm
        self._waited = error is not None
        # below MPI_THREAD_MULTIPLE only the posting thread may ask MPI about it (another's
        # MPI_Wait beside this thread's next call crashed MPICH)
        self._poster = (None if comm is None or comm.threads_may_call_mpi
                        else threading.get_ident())

    @property
    def _what(self) -> str:
        sending, peer, tag = self._message
        return f"{'send to' if sending else 'recv from'} rank {peer} (tag {tag})"

    def done(self) -> bool:
        if self._waited:
            return True
        self._on_the_posting_thread("done()")
        return self._transport.test(self._request)

    def __repr__(self) -> str:  # not done(): logging it from another thread must not raise
        return f"Work({self._what}, {'waited' if self._waited else 'posted'})"

    def _on_the_posting_thread(self, call: str) -> None:
        if self._poster is not None and self._poster != threading.get_ident():
            from pycoll.comm import needs_threads

            raise RuntimeError(f"{self._what}: {call} from a thread other than the one that "
                               f"posted it needs {needs_threads()}: call it on the posting "
                               "thread")

    def __del__(self) -> None:
        # Dropped unwaited (torch's isend allows it): the transport's bookkeeping for its
        # wait goes too; the communicator holds the request until MPI is done with it.
        if not getattr(self, "_waited", True):
            forget = getattr(self._transport, "forget", None)
            if forget is not None:
                forget(self._request)

    def wait(self) -> Any:
        if not self._waited:
            self._on_the_posting_thread("wait()")
            try:
                self._transport.waitall([self._request])
            except WaitTimeout as late:
                self._error = self._comm.timed_out(self._what, late)
            except Exception as error:  # counts that disagree, a peer that failed
                self._error = error
            self._waited = True
        if self._error is not None:
            raise self._error
        return self._result


class AsyncQueue:
    """One communicator's worker: async collectives run here, in call order."""

    def __init__(self, world: Any = None, rank: int = 0):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pycoll-async")
        self._in_flight: list[Future] = []
        # In-process: the world learns when this worker is busy and when the rank's thread
        # blocks on it, so that its deadlock verdicts count every thread that could post.
        self._world, self._rank = world, rank
        self._queued = 0
        self.worker: int | None = None  # the worker thread's ident
        if world is not None:
            world.add_queue(rank, self)

    def submit(self, fn: Callable[..., Any], what: str, *args: Any, **kwargs: Any) -> Work:
        def job() -> Any:
            self.worker = threading.get_ident()
            return fn(*args, **kwargs)

        if self._world is not None:
            self._count(+1)
        future = self._executor.submit(job)
        if self._world is not None:
            future.add_done_callback(lambda _: self._count(-1))
        future.add_done_callback(_keep_error(what))
        self._in_flight = [f for f in self._in_flight if not f.done()] + [future]
        return Work(future, what, self._parked)

    def _count(self, change: int) -> None:
        with self._world._lock:
            self._queued += change
            if self._queued == (1 if change > 0 else 0):
                self._world.busy_workers += change
                if change > 0:
                    self._world.changed()  # a thread that may write again
                else:  # idle: no longer among the threads that may be polling
                    self._world.forget_polling(self._rank, self.worker)

    def _parked(self, what: str, futures: list[Future]) -> Any:
        if self._world is None or threading.get_ident() == self.worker:
            return contextlib.nullcontext()
        return self._world.parked(self._rank, what, futures)

    def drain(self) -> None:
        """Wait (without raising) until every queued collective has finished; a no-op on the
        worker itself."""
        if threading.get_ident() == self.worker:
            return
        with self._parked("queued async collectives", self._in_flight):
            for future in self._in_flight:
                future.exception()  # waits; the error belongs to that collective's wait()
        self._in_flight = []

    @property
    def busy(self) -> bool:
        return bool(self._in_flight)

    def close(self) -> None:
        """Let the worker thread end (after its queued work); no more work may come."""
        self._executor.shutdown(wait=False)
        if self._world is not None:
            self._world.remove_queue(self._rank, self)
