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
