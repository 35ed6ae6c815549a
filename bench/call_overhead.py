"""Python time of one small collective with the transport taken away.

A communicator over a transport that moves nothing isolates what pycoll itself costs per call
(argument checks, finding the prepared call, the executor loop, the reduction of 2 floats).
Each figure is the lowest of ROUNDS rounds of 25 × 2000 calls, in thread time (a round that
the shared machine slows down only raises its own figure):

    python bench/call_overhead.py [ROUNDS] [--layers]

``--layers`` times one AllReduce entered at each layer of pycoll instead, outermost first.
"""

from __future__ import annotations

import sys
import time
import timeit

import numpy as np

import pycoll
from pycoll.comm import Communicator

NUMBER, REPEAT = 2000, 25  # calls per timing, timings per round


class NullTransport:
    """Two ranks that never talk: every send and receive completes at once."""

    rank, size, channel = 0, 2, "null"

    def isend(self, buf, peer, tag):
        return None

    def irecv(self, buf, peer, tag):
        return None

    def waitall(self, requests):
        pass

    def sendrecv(self, send, dst, recv, src, tag):
        pass


def calls(comm: Communicator) -> dict:
    """8-byte calls of each collective, by name."""
    x = np.ones(2, np.float32)
    out, half, gathered = np.empty_like(x), np.empty(1, np.float32), np.empty(4, np.float32)
    return {
        "allreduce (out given)": lambda: pycoll.allreduce(x, out=out, comm=comm),
        "allreduce": lambda: pycoll.allreduce(x, comm=comm),
        "allreduce ring": lambda: pycoll.allreduce(x, out=out, comm=comm, algorithm="ring"),
        "reduce_scatter": lambda: pycoll.reduce_scatter(x, out=half, comm=comm),
        "allgather": lambda: pycoll.allgather(x, out=gathered, comm=comm),
        "broadcast": lambda: pycoll.broadcast(x, 0, comm=comm),
        "reduce": lambda: pycoll.reduce(x, root=0, out=out, comm=comm),
        "alltoall": lambda: pycoll.alltoall(x, out=out, comm=comm),
    }


def layers(comm: Communicator) -> dict:
    """The 8-byte AllReduce (out given) entered at each layer, outermost first: what each
    layer adds is its time less the next one's (these are pycoll's private functions)."""
    from pycoll import api, select

    x = np.ones(2, np.float32)
    out = np.empty_like(x)
    pycoll.allreduce(x, out=out, comm=comm)  # remembered from here on
    key = (api._KNOWN, "allreduce", x.dtype, x.shape, "sum", "auto", select.FORCED_SEGMENTS)
    _, call = comm.prepared[key]
    transport = comm.host_transport()
    play, scratch, _ = call.kept  # what its first call bound (api._player)
    into = scratch[: x.size]
    return {
        "public call": lambda: pycoll.allreduce(x, out=out, comm=comm),
        "api._execute": lambda: api._execute(comm, call, x, out),
        "kept player": lambda: play(x, out, scratch, 1),
        "sendrecv + reduce": lambda: (transport.sendrecv(x, 1, into, 1, 1),
                                      call.reduce(out, into, x)),
    }


def main(rounds: int = 3, which: str = "calls") -> None:
    comm = Communicator._over(NullTransport(), NullTransport())
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, call in (layers if which == "--layers" else calls)(comm).items():
            timer = timeit.Timer(call, timer=time.thread_time)
            seconds = min(timer.repeat(number=NUMBER, repeat=REPEAT)) / NUMBER
            best[name] = min(best.get(name, seconds), seconds)
    for name, seconds in best.items():
        print(f"{name:>22}: {seconds * 1e6:6.2f} us per call (2 ranks, 8 B; lowest of {rounds} "
              "rounds)")


if __name__ == "__main__":
    args = sys.argv[1:]
    which = "--layers" if "--layers" in args else "calls"
    numbers = [a for a in args if a != "--layers"]
    if len(numbers) > 1 or (numbers and not numbers[0].isdigit()):
        sys.exit(f"usage: python bench/call_overhead.py [ROUNDS] [--layers]; got {args}")
    main(int(numbers[0]) if numbers else 3, which)
