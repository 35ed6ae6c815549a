"""Halving-doubling schedules: recursive halving and doubling (Thakur, Rabenseifner & Gropp 2005).

``n`` is the size of the whole array in bytes, ``p`` the number of ranks, ``S`` the number of
segments, ``p'`` the largest power of two not above ``p`` and ``lg = log2 p'``; ``alpha`` is the
latency of one message, ``beta`` the time per byte on the wire, ``gamma`` the time per reduced
byte. A round is one step of every rank. Segments only cut each block into ``S`` chunks: a
transfer of a set of blocks becomes one transfer per chunk, all in the same step, so the round
counts do not depend on ``S`` (the alpha terms count rounds; each carries ``S`` times as many,
smaller, messages).

Power of two (``p = p'``), with partners ``r XOR d``:

* :func:`reduce_scatter_halving` (``nblocks = p``): lg rounds; in the round with distance
  ``d = p/2, p/4, ..., 1`` a rank still reduces an aligned range of ``2d`` blocks that holds its
  own; it sends its partner the half that holds the partner's block and reduces the other half
  from the partner. Rank r ends with block r. Each rank sends ``(p-1)/p n`` bytes.
  Cost: ``lg alpha + (p-1)/p n beta + (p-1)/p n gamma``.
* :func:`allgather_doubling` (``nblocks = p``): lg rounds, the mirror image: in the round with
  distance ``d = 1, 2, ..., p/2`` a rank sends its partner the ``d`` blocks it holds and
  receives the partner's ``d``. Each rank sends ``(p-1)/p n`` bytes.
  Cost: ``lg alpha + (p-1)/p n beta``.
* :func:`allreduce_rabenseifner` (``nblocks = p'``): the halving rounds, then the doubling
  rounds: ``2 lg`` rounds. Each rank sends ``2(p-1)/p n`` bytes, the ring's volume in
  logarithmically many rounds.
  Cost: ``2 lg alpha + 2(p-1)/p n beta + (p-1)/p n gamma``.

Any other ``p`` folds the ``2 rem`` first ranks (``rem = p - p'``) in pairs ``(2i, 2i+1)``:
the even rank steps aside, the odd one stands for both in the power-of-two rounds among the
``p'`` survivors (``i`` for ``2i+1`` when ``i < rem``, ``r - rem`` for ranks ``r >= 2 rem``),
then hands the even rank its result. That adds two rounds. Survivor ``i`` owns the blocks of
both ranks it stands for, so the blocks of a range of survivors stay contiguous.

* ReduceScatter: the even rank sends every block but its own to its partner (reduced there);
  survivors run the halving rounds; the partner sends block ``2i`` back, reduced into the even
  rank's own contribution. ``lg + 2`` rounds; every rank sends ``(p-1)/p n`` bytes in all,
  but a survivor owning two blocks makes the halving rounds uneven: the busiest link of the
  round with distance ``d`` carries ``(d + min(d, rem))/p n``. Cost:
  ``(lg+2) alpha + (p + p' - 1 + sum_d min(d, rem))/p n (beta + gamma)`` at most, which is
  below ``(lg+2) alpha + 3n (beta + gamma)``.
* AllGather, the mirror image: the even rank sends its block to its partner; survivors run
  the doubling rounds; the partner sends the even rank every other block. ``lg + 2`` rounds;
  the even rank sends ``n/p`` bytes, its partner up to ``(p-1)/p n`` more than the others.
  Cost: at most ``(lg+2) alpha + (p + p' - 1 + sum_d min(d, rem))/p n beta``.
* AllReduce (``nblocks = p'``, so the survivors split the array evenly): the even rank sends
  its whole array to its partner, which reduces it; survivors run Rabenseifner's rounds; the
  partner sends the even rank the whole result. ``2 lg + 2`` rounds. The even rank sends
  ``n`` bytes, its partner ``n + 2(p'-1)/p' n``. Cost:
  ``(2 lg + 2) alpha + (2 + 2(p'-1)/p') n beta + (1 + (p'-1)/p') n gamma``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pycoll.schedule import Collective, Schedule, ScheduleBuilder

# The blocks of survivors lo..hi-1, as a range of block indices.
BlocksOf = Callable[[int, int], range]


@dataclass(frozen=True)
class Survivors:
    """The ``p'`` ranks that run the power-of-two rounds, numbered ``0 .. p'-1``.

    Ranks ``2i`` and ``2i+1`` for ``i < extra`` fold into survivor ``i`` (rank ``2i+1``); rank
    ``r >= 2 extra`` is survivor ``r - extra``.
    """

    nranks: int

    @property
    def power_of_two(self) -> int:
        return 1 << (self.nranks.bit_length() - 1)

    @property
    def extra(self) -> int:
        return self.nranks - self.power_of_two

    def rank(self, survivor: int) -> int:
        return 2 * survivor + 1 if survivor < self.extra else survivor + self.extra

    def folded_pairs(self) -> list[tuple[int, int]]:
        """(rank that steps aside, rank that stands for both), for each folded pair."""
        return [(2 * i, 2 * i + 1) for i in range(self.extra)]

    def first_block(self, survivor: int) -> int:
        """The first rank block owned by ``survivor``: its partner's block, then its own."""
        return 2 * survivor if survivor < self.extra else survivor + self.extra

    def rank_blocks(self, lo: int, hi: int) -> range:
        """The rank blocks owned by survivors ``lo .. hi-1`` (nblocks = p)."""
        return range(self.first_block(lo), self.first_block(hi))


def _survivor_blocks(lo: int, hi: int) -> range:
    """Block v for survivor v (nblocks = p')."""
    return range(lo, hi)


def _send_blocks(
    b: ScheduleBuilder, src: int, dst: int, blocks: range, *, reduce: bool
) -> None:
    for block in blocks:
        for chunk in b.chunks_of_block(block):
            b.transfer(src, dst, chunk, reduce=reduce)


def _halving_rounds(b: ScheduleBuilder, survivors: Survivors, blocks_of: BlocksOf) -> None:
    """lg p' rounds after which survivor v holds ``blocks_of(v, v+1)`` reduced over all."""
    distance = survivors.power_of_two // 2
    while distance:
        # round: send the partner the half of my range that holds its blocks, reduce the other
        for v in range(survivors.power_of_two):
            partner = v ^ distance
            if not (b.wants(survivors.rank(v)) or b.wants(survivors.rank(partner))):
                continue  # costing one rank at scale: skip the others' transfers
            partner_half = partner & ~(distance - 1)
            _send_blocks(
                b, survivors.rank(v), survivors.rank(partner),
                blocks_of(partner_half, partner_half + distance), reduce=True,
            )
        b.end_step()
        distance //= 2


def _doubling_rounds(b: ScheduleBuilder, survivors: Survivors, blocks_of: BlocksOf) -> None:
    """lg p' rounds after which every survivor holds every survivor's blocks."""
    distance = 1
    while distance < survivors.power_of_two:
        # round: swap the aligned range of blocks I hold with the partner's, doubling it
        for v in range(survivors.power_of_two):
            partner = v ^ distance
            if not (b.wants(survivors.rank(v)) or b.wants(survivors.rank(partner))):
                continue
            my_half = v & ~(distance - 1)
            _send_blocks(
                b, survivors.rank(v), survivors.rank(partner),
                blocks_of(my_half, my_half + distance), reduce=False,
            )
        b.end_step()
        distance *= 2


def reduce_scatter_halving(nranks: int, nsegments: int = 1) -> Schedule:
    b = ScheduleBuilder(Collective.REDUCE_SCATTER, "halving_doubling", nranks, nblocks=nranks,
                        nsegments=nsegments)
    survivors = Survivors(nranks)
    everything = range(nranks)
    # fold in: the even rank of each pair sends its partner every block but its own, reduced
    for even, odd in survivors.folded_pairs():
        _send_blocks(b, even, odd, everything[:even], reduce=True)
        _send_blocks(b, even, odd, everything[even + 1:], reduce=True)
    b.end_step()
    # lg p' rounds: recursive halving among the survivors, each owning its pair's blocks
    _halving_rounds(b, survivors, survivors.rank_blocks)
    # fold out: the partner sends the even rank its block (all but its own contribution)
    for even, odd in survivors.folded_pairs():
        _send_blocks(b, odd, even, range(even, even + 1), reduce=True)
    return b.build()


def allgather_doubling(nranks: int, nsegments: int = 1) -> Schedule:
    b = ScheduleBuilder(Collective.ALLGATHER, "halving_doubling", nranks, nblocks=nranks,
                        nsegments=nsegments)
    survivors = Survivors(nranks)
    everything = range(nranks)
    # fold in: the even rank of each pair sends its partner its block
    for even, odd in survivors.folded_pairs():
        _send_blocks(b, even, odd, range(even, even + 1), reduce=False)
    b.end_step()
    # lg p' rounds: recursive doubling among the survivors, each owning its pair's blocks
    _doubling_rounds(b, survivors, survivors.rank_blocks)
    # fold out: the partner sends the even rank every block but its own
    for even, odd in survivors.folded_pairs():
        _send_blocks(b, odd, even, everything[:even], reduce=False)
        _send_blocks(b, odd, even, everything[even + 1:], reduce=False)
    return b.build()


def allreduce_rabenseifner(nranks: int, nsegments: int = 1) -> Schedule:
    survivors = Survivors(nranks)
    nblocks = survivors.power_of_two
    b = ScheduleBuilder(Collective.ALLREDUCE, "halving_doubling", nranks, nblocks=nblocks,
                        nsegments=nsegments)
    # fold in: the even rank of each pair sends its partner its whole array, reduced
    for even, odd in survivors.folded_pairs():
        _send_blocks(b, even, odd, range(nblocks), reduce=True)
    b.end_step()
    # lg p' rounds: recursive halving, survivor v ends with block v reduced over all ranks
    _halving_rounds(b, survivors, _survivor_blocks)
    # lg p' rounds: recursive doubling of the reduced blocks among the survivors
    _doubling_rounds(b, survivors, _survivor_blocks)
    # fold out: the partner sends the even rank the whole result
    for even, odd in survivors.folded_pairs():
        _send_blocks(b, odd, even, range(nblocks), reduce=False)
    return b.build()


SCHEDULES: dict[Collective, Callable[..., Schedule]] = {
    Collective.ALLREDUCE: allreduce_rabenseifner,
    Collective.REDUCE_SCATTER: reduce_scatter_halving,
    Collective.ALLGATHER: allgather_doubling,
}
