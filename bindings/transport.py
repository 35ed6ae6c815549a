"""The two-sided transport interface every runtime implements (threads, MPI, …).

The executor posts a step's receives and sends, then waits for all of them. A transport moves
bytes between numpy arrays; it knows no algorithm. Messages between one pair of ranks on one
tag match in posting order, as in MPI.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Request(Protocol):
    def done(self) -> bool: ...


class Transport(Protocol):
    rank: int
    size: int

    def isend(self, buf: np.ndarray, peer: int, tag: int) -> Request:
        """Start sending ``buf``; it must not change until the request completes."""
        ...

    def irecv(self, buf: np.ndarray, peer: int, tag: int) -> Request:
        """Start receiving into ``buf``, whose size must equal the message's."""
        ...

    def waitall(self, requests: list[Request]) -> None:
        """Block until every request completed; raise if the world failed meanwhile."""
        ...

    def sendrecv(
        self, send: np.ndarray, dst: int, recv: np.ndarray, src: int, tag: int
    ) -> None:
        """Send to ``dst`` while receiving from ``src``; the common one-in, one-out step."""
        ...


class PeerFailed(RuntimeError):
    """Another rank failed, so this rank's collective cannot complete."""


# What may stop a rank midway through a wait (Ctrl-C; a signal handler's sys.exit), leaving
# its peers in the call: the caller marks its communicator broken (Communicator.interrupted)
INTERRUPTS = (KeyboardInterrupt, SystemExit)


class WaitTimeout(TimeoutError):
    """A wait passed its deadline; ``peers``: the ranks (of the transport's group) it was
    still waiting for."""

    def __init__(self, peers: list[int], seconds: float):
        super().__init__(f"waited {seconds:g} s for rank(s) {peers}")
        self.peers, self.seconds = peers, seconds


class ChannelsCrossed(ValueError):
    """Ranks disagreed on a call (its size or count) in a way that leaves a message in an
    ordered channel, a shared-memory ring, where no later call expects one: every later call
    between those ranks would read it first. The communicator is broken after it."""


class CollectiveTimeout(TimeoutError):
    """A collective waited past the communicator's timeout; the message names the collective,
    the algorithm, the step and the peers still awaited. The communicator is broken after it."""


# What a call's mismatch error asks of the ranks: a different algorithm, or a rank checking
# or verifying alone, shows up to the transport as counts or sizes that disagree.
SAME_CALL = ("every rank must pass the same count and dtype, and the same algorithm, with "
             "comm.check and comm.verify alike")


def counts_disagree(rank: int, expected: int, peer: int, tag: int, got: int | None) -> ValueError:
    """The error of a receive of ``expected`` bytes whose message held ``got`` (None: more
    than fit), worded alike by every host transport."""
    held = "the message is longer" if got is None or got > expected else f"received {got}"
    return ValueError(f"rank {rank} expects {expected} bytes from rank {peer} (tag {tag}) and "
                      f"{held}; the ranks disagree on counts")
