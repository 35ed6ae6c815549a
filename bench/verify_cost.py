"""What PYCOLL_VERIFY costs: a ring AllReduce of float32 on 4 in-process ranks, verified and
not, alternating in one run (median of 5 calls per turn, median over 3 turns each):

    python bench/verify_cost.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np

import pycoll

RANKS, TURNS, CALLS = 4, 3, 5


def measure(count: int) -> dict[bool, float]:
    comm = pycoll.world()
    x = np.random.default_rng(comm.rank).normal(size=count).astype(np.float32)
    medians: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(TURNS):
        for verify in (False, True):
            comm.verify = verify
            pycoll.allreduce(x, algorithm="ring")  # warm: buffers, the prepared call
            times = []
            for _ in range(CALLS):
                pycoll.barrier()
                started = time.perf_counter()
                pycoll.allreduce(x, algorithm="ring")
                times.append(time.perf_counter() - started)
            medians[verify].append(statistics.median(times))
    comm.verify = False
    return {verify: statistics.median(t) for verify, t in medians.items()}


if __name__ == "__main__":
    for nbytes in (1 << 10, 1 << 20):
        times = pycoll.run_local(RANKS, measure, nbytes // 4)[0]
        print(f"{nbytes:>8} B: off {times[False] * 1e6:8.0f} us, on {times[True] * 1e6:8.0f} us,"
              f" x{times[True] / times[False]:.1f}")
