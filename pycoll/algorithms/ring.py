"""Ring schedules: every rank talks only to its ring neighbours (Patarasuk & Yuan 2009).

``n`` is the size of the whole array in bytes, ``p`` the number of ranks, ``S`` the number of
segments; ``alpha`` is the latency of one message, ``beta`` the time per byte on the wire,
``gamma`` the time per reduced byte. A round is one step of every rank.

* :func:`reduce_scatter_ring` (``nblocks = p``): p-1 rounds per segment; in round k rank r
  sends block ``r-k-1`` to rank r+1, which reduces it into its own copy, so that rank r ends
  with block r reduced over all ranks. Each rank sends ``(p-1)/p * n`` bytes.
  Cost: ``S(p-1) alpha + (p-1)/p n beta + (p-1)/p n gamma``.
* :func:`allgather_ring` (``nblocks = p``): p-1 rounds per segment; in round k rank r passes
  block ``r-k`` (its own block first) on to rank r+1. Each rank sends ``(p-1)/p * n`` bytes.
  Cost: ``S(p-1) alpha + (p-1)/p n beta``.
* :func:`allreduce_ring` (``nblocks = p``): the ReduceScatter rounds, then the AllGather
  rounds: 2(p-1) rounds per segment. Each rank sends ``2(p-1)/p * n`` bytes, the least any
  AllReduce can (Patarasuk & Yuan 2009). Cost:
  ``2S(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma``.

  The three run their segments one after another, each with its own explicit rounds, as
  NCCL's ``runRing`` loops over chunks: in every round each ring link already carries one
  chunk, so interleaving segments would only put two chunks on the same link.

* :func:`broadcast_chain` (``nblocks = 1``): the ranks form the chain root, root+1, ...,
  root+p-1 (mod p); in round t the rank at chain position i forwards segment ``t-i`` to
  position i+1, in the same step as it receives segment ``t-i+1`` from position i-1, so the
  segments flow as a pipeline: ``(p-1) + (S-1)`` rounds. Every rank but the last sends ``n``
  bytes. Cost: ``(p+S-2)(alpha + n/S beta)``.
* :func:`reduce_chain` (``nblocks = 1``): the same chain run backwards: in round t the rank at
  position i (from p-1 down to 1) sends its partial sum of segment ``t-(p-1-i)`` to position
  i-1, which reduces it, while it receives the next segment from position i+1:
  ``(p-1) + (S-1)`` rounds; the root ends with the result. Every rank but the root sends ``n``
  bytes. Cost: ``(p+S-2)(alpha + n/S beta + n/S gamma)``.
"""

from __future__ import annotations

from collections.abc import Callable

from pycoll.schedule import Collective, Schedule, ScheduleBuilder


def _senders(b: ScheduleBuilder) -> list[int]:
    """The ranks whose ring link touches a rank being built (every rank, unless costing one
    rank at scale: then the loops below skip the others' transfers instead of dropping them)."""
    n = b.nranks
    return [r for r in range(n) if b.wants(r) or b.wants((r + 1) % n)]


def _reduce_scatter_rounds(b: ScheduleBuilder, segment: int) -> None:
    """p-1 rounds after which rank r holds block r of ``segment`` reduced over all ranks."""
    nranks, senders = b.nranks, _senders(b)
    for k in range(nranks - 1):
        # round k: reduce the block from the previous rank into mine, pass it on
        for r in senders:
            b.transfer(r, (r + 1) % nranks, b.chunk((r - k - 1) % nranks, segment), reduce=True)
        b.end_step()


def _allgather_rounds(b: ScheduleBuilder, segment: int) -> None:
    """p-1 rounds that pass every rank's block r of ``segment`` around the ring."""
    nranks, senders = b.nranks, _senders(b)
    for k in range(nranks - 1):
        # round k: pass on the block that arrived last round (my own in round 0)
        for r in senders:
            b.transfer(r, (r + 1) % nranks, b.chunk((r - k) % nranks, segment))
        b.end_step()


def reduce_scatter_ring(nranks: int, nsegments: int = 1) -> Schedule:
    b = ScheduleBuilder(Collective.REDUCE_SCATTER, "ring", nranks, nblocks=nranks,
                        nsegments=nsegments)
    for segment in range(nsegments):
        # p-1 steps: reduce each block on its way around the ring until it ends at its owner
        _reduce_scatter_rounds(b, segment)
    return b.build()


def allgather_ring(nranks: int, nsegments: int = 1) -> Schedule:
    b = ScheduleBuilder(Collective.ALLGATHER, "ring", nranks, nblocks=nranks,
                        nsegments=nsegments)
    for segment in range(nsegments):
        # p-1 steps: pass each rank's block around the ring
        _allgather_rounds(b, segment)
    return b.build()


def allreduce_ring(nranks: int, nsegments: int = 1) -> Schedule:
    b = ScheduleBuilder(Collective.ALLREDUCE, "ring", nranks, nblocks=nranks,
                        nsegments=nsegments)
    for segment in range(nsegments):
        # p-1 steps: reduce-scatter, rank r ends with block r fully reduced
        _reduce_scatter_rounds(b, segment)
        # p-1 steps: all-gather the fully reduced blocks around the ring
        _allgather_rounds(b, segment)
    return b.build()


def broadcast_chain(nranks: int, root: int, nsegments: int = 1) -> Schedule:
    b = ScheduleBuilder(Collective.BROADCAST, "ring", nranks, nblocks=1, nsegments=nsegments,
                        root=root)
    chain = [(root + i) % nranks for i in range(nranks)]
    for t in range(nranks - 1 + nsegments - 1):
        # round t: position i forwards segment t-i down the chain (and receives segment t-i+1)
        for i in range(nranks - 1):
            segment = t - i
            if 0 <= segment < nsegments:
                b.transfer(chain[i], chain[i + 1], b.chunk(0, segment))
        b.end_step()
    return b.build()


def reduce_chain(nranks: int, root: int, nsegments: int = 1) -> Schedule:
    b = ScheduleBuilder(Collective.REDUCE, "ring", nranks, nblocks=1, nsegments=nsegments,
                        root=root)
    chain = [(root + i) % nranks for i in range(nranks)]
    for t in range(nranks - 1 + nsegments - 1):
        # round t: position i adds its share to segment t-(p-1-i) and passes it towards the root
        for i in range(nranks - 1, 0, -1):
            segment = t - (nranks - 1 - i)
            if 0 <= segment < nsegments:
                b.transfer(chain[i], chain[i - 1], b.chunk(0, segment), reduce=True)
        b.end_step()
    return b.build()


SCHEDULES: dict[Collective, Callable[..., Schedule]] = {
    Collective.ALLREDUCE: allreduce_ring,
    Collective.REDUCE_SCATTER: reduce_scatter_ring,
    Collective.ALLGATHER: allgather_ring,
    Collective.BROADCAST: broadcast_chain,
    Collective.REDUCE: reduce_chain,
}
