"""What pycoll spends choosing the schedule for a call shape it has not seen (a new size):
the model's plays of every family and segment count (pycoll/select.py), once per shape per
communicator, before the call's own time.

    python bench/plan_cost.py [SIZES]

Each figure is the mean over SIZES new element counts (default 100: 1000, 1001, ...), with
the model's cache cleared first, on the default MPI costs.
"""

from __future__ import annotations

import sys
import time

from pycoll import select
from pycoll.schedule import Collective


def main(sizes: int = 100) -> None:
    topology = select.DEFAULTS["mpi"]
    for nranks in (3, 5, 8, 16):
        for collective, itemsize in ((Collective.ALLREDUCE, 8), (Collective.ALLGATHER, 4)):
            select._exact.cache_clear()
            started = time.perf_counter()
            for count in range(1000, 1000 + sizes):
                total = count * nranks if collective is Collective.ALLGATHER else count
                select.plan_for(collective, total * itemsize, nranks, "auto", topology,
                                itemsize)
            seconds = (time.perf_counter() - started) / sizes
            print(f"{nranks:>3} ranks, {collective.value:>9}: {seconds * 1e3:6.2f} ms per new "
                  f"size ({sizes} sizes from 1000 elements)")


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) > 1 or (args and not args[0].isdigit()):
        sys.exit(f"usage: python bench/plan_cost.py [SIZES]; got {args}")
    main(int(args[0]) if args else 100)
