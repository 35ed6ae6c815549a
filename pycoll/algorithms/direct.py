"""Direct schedules: every rank exchanges with every other rank at once.

``n`` is the size of the whole array in bytes (for AllToAll: of one rank's input), ``p`` the
number of ranks, ``S`` the number of segments; ``alpha`` is the latency of one message,
``beta`` the time per byte on the wire, ``gamma`` the time per reduced byte. A round is one
step of every rank. In one round a rank posts all its sends to different peers together; the
costs below serialize a rank's messages and bytes on its one link (the multi-port figure, with
every link in parallel, pays alpha once and divides the beta term by the number of peers).
Segments only cut each block into ``S`` chunks, sent in the same step, so the round counts do
not depend on ``S``.

* :func:`allreduce_one_shot` (``nblocks = 1``): one round: every rank sends its whole INPUT to
  every other rank and reduces the ``p-1`` arrays it receives into its WORK (already seeded with
  its own). It sends from INPUT because it receives into WORK in the same step. Each rank sends
  ``(p-1) n`` bytes. Cost: ``(p-1)(alpha + n beta) + (p-1) n gamma``; with links in parallel
  ``alpha + n beta + (p-1) n gamma``. The executor combines a step's reductions into one
  range in rank order, the rank's own array at its own place (``_in_rank_order`` in
  pycoll/execute.py), so every rank gets the same bits.
* :func:`reduce_scatter_direct` (``nblocks = p``): one round: every rank sends block j (from
  INPUT) to rank j and reduces block r from every peer. Each rank sends ``(p-1)/p n`` bytes.
  Cost: ``(p-1) alpha + (p-1)/p n beta + (p-1)/p n gamma``.
* :func:`allgather_direct` (``nblocks = p``): one round: every rank sends its own block (WORK
  block r, which it never receives into) to every other rank and copies block q from rank q.
  Each rank sends ``(p-1)/p n`` bytes. Cost: ``(p-1) alpha + (p-1)/p n beta``.
* :func:`alltoall_pairwise` (``nblocks = p``): p-1 rounds; in round k (1..p-1) rank r sends
  INPUT block ``r+k`` to rank ``r+k`` and receives WORK block ``r-k`` from rank ``r-k``
  (mod p): one peer in, one out, per round. Each rank sends ``(p-1)/p n`` bytes (for
  AllToAllv, the rows it sends to others). Cost: ``(p-1) alpha + (p-1)/p n beta``.
* :func:`sendrecv` (``nblocks = 1``): one round, in which ``src`` sends every chunk of its
  INPUT to ``dst``, which copies it into its WORK. ``src`` sends ``n`` bytes.
  Cost: ``alpha + n beta``.
"""

from __future__ import annotations

from collections.abc import Callable

from pycoll.schedule import Buffer, Collective, Schedule, ScheduleBuilder


def allreduce_one_shot(nranks: int, nsegments: int = 1) -> Schedule:
    b = ScheduleBuilder(Collective.ALLREDUCE, "direct", nranks, nblocks=1, nsegments=nsegments)
    # one step: send my INPUT to every peer, reduce every peer's array into my WORK
    for src in range(nranks):
        for dst in range(nranks):
            if dst != src:
                for chunk in b.chunks_of_block(0):
                    b.transfer(src, dst, chunk, reduce=True, buffer=Buffer.INPUT)
    return b.build()


def reduce_scatter_direct(nranks: int, nsegments: int = 1) -> Schedule:
    b = ScheduleBuilder(Collective.REDUCE_SCATTER, "direct", nranks, nblocks=nranks,
                        nsegments=nsegments)
    reduce_scatter_round(b)
    return b.build()


def allgather_direct(nranks: int, nsegments: int = 1) -> Schedule:
    b = ScheduleBuilder(Collective.ALLGATHER, "direct", nranks, nblocks=nranks,
                        nsegments=nsegments)
    allgather_round(b)
    return b.build()


def reduce_scatter_round(b: ScheduleBuilder) -> None:
    """One step: every rank sends block j (of INPUT) to rank j and reduces block r from every
    peer."""
    for src in range(b.nranks):
        for dst in range(b.nranks):
            if dst != src:
                for chunk in b.chunks_of_block(dst):
                    b.transfer(src, dst, chunk, reduce=True, buffer=Buffer.INPUT)


def allgather_round(b: ScheduleBuilder) -> None:
    """One step: every rank sends its block r (of WORK) to every peer and copies block q from
    rank q."""
    for src in range(b.nranks):
        for dst in range(b.nranks):
            if dst != src:
                for chunk in b.chunks_of_block(src):
                    b.transfer(src, dst, chunk)


def alltoall_pairwise(nranks: int, nsegments: int = 1) -> Schedule:
    b = ScheduleBuilder(Collective.ALLTOALL, "direct", nranks, nblocks=nranks,
                        nsegments=nsegments)
    for k in range(1, nranks):
        # round k: send my piece for rank r+k, receive rank r-k's piece for me
        for src in range(nranks):
            dst = (src + k) % nranks
            for segment in range(nsegments):
                b.transfer(src, dst, b.chunk(dst, segment), dst_chunk=b.chunk(src, segment),
                           buffer=Buffer.INPUT)
        b.end_step()
    return b.build()


def sendrecv(nranks: int, src: int, dst: int, nsegments: int = 1) -> Schedule:
    for name, rank in (("src", src), ("dst", dst)):
        if not 0 <= rank < nranks:
            raise ValueError(
                f"sendrecv: {name}={rank} is not a rank; allowed: 0..{nranks - 1}"
            )
    if src == dst:
        raise ValueError(f"sendrecv: src={src} and dst={dst} must be different ranks")
    b = ScheduleBuilder(Collective.SENDRECV, "direct", nranks, nblocks=1, nsegments=nsegments,
                        root=src, peer=dst)
    # one step: src sends every chunk of its INPUT, dst copies it into its WORK
    for chunk in b.chunks_of_block(0):
        b.transfer(src, dst, chunk, buffer=Buffer.INPUT)
    return b.build()


SCHEDULES: dict[Collective, Callable[..., Schedule]] = {
    Collective.ALLREDUCE: allreduce_one_shot,
    Collective.REDUCE_SCATTER: reduce_scatter_direct,
    Collective.ALLGATHER: allgather_direct,
    Collective.ALLTOALL: alltoall_pairwise,
    Collective.SENDRECV: sendrecv,
}
