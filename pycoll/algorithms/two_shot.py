"""Two-shot AllReduce: a direct ReduceScatter, then a direct AllGather (the shared-memory
AllReduce of vLLM's and TensorRT-LLM's custom kernels, and NCCL's for NVLS).

``n`` is the size of the array in bytes, ``p`` the number of ranks; ``alpha``, ``beta``,
``gamma`` as in :mod:`pycoll.algorithms.direct`.

* :func:`allreduce_two_shot` (``nblocks = p``): round 1: every rank sends block j of its
  INPUT to rank j and reduces block r from every peer into its WORK; round 2: every rank
  sends its reduced block r to every peer and copies block q from rank q. Each rank sends
  ``2 (p-1)/p n`` bytes, like the ring, but in two rounds instead of ``2(p-1)``; each rank
  reduces only its ``n/p``. Cost: ``2 (p-1) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma``
  (messages of one round serialised on a rank's one link; with every link in parallel
  ``2 alpha + 2 n/p beta + (p-1)/p n gamma``). Where a peer's memory can be read in place
  (shared memory, CUDA IPC) this is the large-message AllReduce: every rank reads each input
  byte of its block once and writes its result once. Every rank adds block r's arrays in the
  same order on the rank that owns it, so all ranks get the same bits.
"""

from __future__ import annotations

from collections.abc import Callable

from pycoll.algorithms import direct
from pycoll.schedule import Collective, Schedule, ScheduleBuilder


def allreduce_two_shot(nranks: int, nsegments: int = 1) -> Schedule:
    b = ScheduleBuilder(Collective.ALLREDUCE, "two_shot", nranks, nblocks=nranks,
                        nsegments=nsegments)
    direct.reduce_scatter_round(b)  # round 1: block r reduced on rank r
    b.end_step()
    direct.allgather_round(b)  # round 2: block r copied from rank r
    return b.build()


SCHEDULES: dict[Collective, Callable[..., Schedule]] = {
    Collective.ALLREDUCE: allreduce_two_shot,
}
