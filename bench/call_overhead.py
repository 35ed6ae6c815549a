"""Python time of one small pycoll.allreduce with the transport taken away.

A communicator over a transport that moves nothing isolates what pycoll itself costs per call
(argument checks, the prepared-call lookup, the executor loop, the reduction of 2 floats):

    python bench/call_overhead.py
"""

from __future__ import annotations

import statistics
import timeit

import numpy as np

import pycoll
from pycoll.comm import Communicator


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


def main() -> None:
    comm = Communicator._over(NullTransport(), NullTransport())
    x = np.ones(2, np.float32)
    out = np.empty_like(x)
    for algorithm in ("direct", "ring", "auto"):
        def call(algorithm=algorithm):
            return pycoll.allreduce(x, out=out, comm=comm, algorithm=algorithm)
        samples = [t / 10_000 * 1e6 for t in timeit.repeat(call, number=10_000, repeat=7)]
        print(f"allreduce 8 B, 2 ranks, {algorithm:>6}: median {statistics.median(samples):.2f} us "
              f"per call (7 repeats of 10000)")


if __name__ == "__main__":
    main()
