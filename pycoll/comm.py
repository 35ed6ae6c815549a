"""Communicators: a group of ranks, how to reach each peer, and the calling thread's default.

A communicator owns two transport endpoints: one for collectives, tagged with a sequence
number so back-to-back collectives never mix messages, and one for the user's Send/Recv tags.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from pycoll.bindings.local import LocalWorld, run_threads
from pycoll.bindings.transport import Transport

_TAG_LIMIT = 32767  # the smallest MPI_TAG_UB the MPI standard allows


class Communicator:
    """One rank's view of a group of ``size`` ranks."""

    def __init__(self, rank: int, size: int, transport: Transport, p2p: Transport):
        self.rank = rank
        self.size = size
        self.transport = transport
        self.p2p = p2p
        self._sequence = 0

    def next_tag(self) -> int:
        """The tag of the next collective; every rank calls collectives in the same order."""
        self._sequence = (self._sequence + 1) % _TAG_LIMIT
        return self._sequence

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, size={self.size})"


def local_communicator(world: LocalWorld, rank: int) -> Communicator:
    return Communicator(rank, world.nranks, world.endpoint(rank), world.endpoint(rank, "p2p"))


_default = threading.local()
_process_world: Communicator | None = None


def world() -> Communicator:
    """The calling rank's default communicator.

    Inside :func:`run_local` it is the thread's own rank; elsewhere a world of one rank.
    """
    comm = getattr(_default, "comm", None)
    if comm is not None:
        return comm
    global _process_world
    if _process_world is None:
        _process_world = local_communicator(LocalWorld(1), 0)
    return _process_world


def run_local(nranks: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``nranks`` threads, each with its own communicator.

    Returns the per-rank results in rank order. If any rank raises, the others are released
    and that exception is raised here; a deadlock raises :class:`Deadlock` instead of hanging.
    """
    if isinstance(nranks, bool) or not isinstance(nranks, int) or nranks < 1:
        raise ValueError(f"nranks={nranks!r} is not a rank count; allowed: an int >= 1")

    def body(rank: int, local_world: LocalWorld) -> Any:
        _default.comm = local_communicator(local_world, rank)
        try:
            return fn(*args, **kwargs)
        finally:
            _default.comm = None

    return run_threads(nranks, body)
