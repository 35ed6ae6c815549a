"""Tree schedules: binomial trees for the rooted and sharded collectives, a double binary tree
for AllReduce (Sanders, Speck & Traeff 2009, the trees NCCL uses).

``n`` is the size of the whole array in bytes, ``p`` the number of ranks, ``S`` the number of
segments, ``L = ceil(log2 p)``; ``alpha`` is the latency of one message, ``beta`` the time per
byte, ``gamma`` the time per reduced byte. A round is one step of every rank; the transfers a
rank makes to different peers in one round run together (the multi-port model the checker's
rounds count), so a round costs ``alpha + m beta`` for the largest chunk ``m`` on any link.

Every schedule is a timetable: each transfer of segment ``s`` gets the round in which it runs,
and the rounds are emitted in order, each closed with ``end_step``. Up the tree (reduce, gather)
a rank sends segment ``s`` one round after the last of its children sent it; down the tree
(broadcast, scatter) a rank forwards segment ``s`` one round after it received it. Segment
``s`` starts one round after segment ``s-1``, so up to ``S`` segments are in flight. A rank may
work on several segments in one round, never on the same chunk twice: up-the-tree transfers in
round ``t`` carry segments later than ``t - h`` and down-the-tree ones segments up to ``t - h``
(``h`` the height of the tree), so the down phase of a segment overlaps the up phase of later
ones without a hazard.

Binomial tree (``binomial_tree``, MPICH's): with ranks renumbered ``v = rank - root (mod p)``,
the parent of ``v`` is ``v`` with its lowest set bit cleared; its children are ``v + 2^j`` for
``2^j`` below that bit (``j < L`` for the root), and its subtree is the contiguous range
``v .. v + lowbit(v) - 1``. In textbook order the root's child ``2^(L-1)`` is served first.

* :func:`broadcast_binomial_tree` (``nblocks = 1``): a rank forwards segment ``s`` to child
  ``v + 2^j`` in round ``s + L-1-j``: ``L + S - 1`` rounds. A rank sends ``n`` bytes to each of
  its children (the root ``L n``). Cost ``(L+S-1)(alpha + n/S beta)``; ``L(alpha + n beta)``
  for one segment (Thakur, Rabenseifner & Gropp 2005).
* :func:`reduce_binomial_tree` (``nblocks = 1``): the broadcast run backwards: a rank whose
  lowest set bit is ``2^i`` sends its partial sum of segment ``s`` to its parent in round
  ``s + i``, after all its children did: ``L + S - 1`` rounds. Every rank but the root sends
  ``n`` bytes. Cost ``(L+S-1)(alpha + n/S beta + n/S gamma)``.
* :func:`reduce_scatter_binomial_tree` (``nblocks = p``): a binomial reduce of the whole array
  to rank 0, then a binomial scatter: each rank forwards to child ``c`` the blocks of ``c``'s
  subtree, and rank r keeps block r. Segment ``s`` is scattered as soon as it is reduced:
  ``2L + S - 1`` rounds. A rank sends ``n`` bytes up and ``(subtree size - 1) n/p`` down (the
  root ``(p-1)/p n``). Cost, one segment (``p = 2^k``):
  ``2L alpha + L n (beta + gamma) + (p-1)/p n beta``;
  with ``S`` segments ``(2L+S-1)(alpha + n/S beta) + (L+S-1) n/S gamma`` at most.
* :func:`allgather_binomial_tree` (``nblocks = p``): a binomial gather to rank 0, each rank
  forwarding its subtree's blocks, then a binomial broadcast in which a rank sends each child
  every block its subtree does not hold yet: ``2L + S - 1`` rounds. A rank sends its subtree's
  ``(subtree size) n/p`` bytes up and ``(p - subtree size of the child) n/p`` to each child.
  Cost, one segment: ``2L alpha + L n beta`` (``(p-1)/p n`` up, ``L n - (p-1)/p n`` down, for
  ``p = 2^k``); with ``S`` segments ``(2L+S-1)(alpha + n/S beta)`` at most.

Double binary tree (``double_binary_tree``): tree 0 is NCCL's in-order binary tree
(``ncclGetBtree``): a rank's level is its lowest set bit, rank 0 sits on top with one child.
Its interior ranks are the even ones. Tree 1 is tree 0 mirrored (``r -> p-1-r``) when ``p`` is
even, so its interior ranks are the odd ones. For odd ``p`` NCCL shifts tree 0 by one rank, but
then rank 0 is interior in both trees (tree 0 has ``(p+1)/2`` interior ranks: two such sets
must meet), so tree 1 is instead the in-order tree over ``p+1`` ranks without its root, shifted
down by one (``r -> r-1``): a full binary tree whose interior ranks are the odd ones. Either way
every rank is interior in at most one tree.

* :func:`allreduce_double_binary_tree` (``nblocks = 2``): block ``t`` is reduced up tree ``t``
  and broadcast back down it, both trees at once. With ``h(r)`` the height of rank r's subtree,
  ``d(r)`` its depth and ``H`` the tree's height, rank r sends segment ``s`` up in round
  ``s + h(r)`` and receives it back down in round ``s + H + d(r) - 1``: ``2H + S - 1`` rounds
  (``H`` the larger height of the two trees, which is ``L``). A rank that is interior in a
  tree sends ``n/2`` up and ``n/2`` to each child there, and ``n/2`` up in the tree where it is a
  leaf: at most ``2n`` bytes, ``2(p-1)/p n`` on average, as the ring. Cost
  ``(2H+S-1)(alpha + n/(2S) beta) + (H+S-1) n/(2S) gamma`` (``n/(2S)`` per link); with a rank's
  links serialized (up to four chunks sent and two reduced per round)
  ``(2H+S-1)(alpha + 2n/S beta) + (H+S-1) n/S gamma``, about ``S alpha + 2n beta + n gamma``
  for ``S >> H``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import NamedTuple

from pycoll.schedule import Collective, Schedule, ScheduleBuilder


class Tree(NamedTuple):
    """A rooted tree over ranks ``0..p-1``: each rank's parent (None at the root), children."""

    parent: tuple[int | None, ...]
    children: tuple[tuple[int, ...], ...]

    @property
    def root(self) -> int:
        return self.parent.index(None)

    def depths(self) -> list[int]:
        """Edges from the root to each rank."""
        depth = [0] * len(self.parent)
        order = [self.root]
        for rank in order:
            for child in self.children[rank]:
                depth[child] = depth[rank] + 1
                order.append(child)
        return depth

    def heights(self) -> list[int]:
        """Edges from each rank down to the deepest leaf of its subtree."""
        height = [0] * len(self.parent)
        for rank in sorted(range(len(self.parent)), key=self.depths().__getitem__, reverse=True):
            parent = self.parent[rank]
            if parent is not None:
                height[parent] = max(height[parent], height[rank] + 1)
        return height


def _tree_from_parents(parent: list[int | None]) -> Tree:
    children: list[list[int]] = [[] for _ in parent]
    for rank, up in enumerate(parent):
        if up is not None:
            children[up].append(rank)
    return Tree(tuple(parent), tuple(tuple(sorted(c)) for c in children))


def binary_tree(nranks: int) -> Tree:
    """NCCL's in-order binary tree (``ncclGetBtree``): rank 0 on top, levels by lowest set bit.

    For 14 ranks: 0 -> 8 -> (4 -> (2 -> 1, 3), (6 -> 5, 7)), (12 -> (10 -> 9, 11), 13).
    """
    parent: list[int | None] = [None] * nranks
    for rank in range(1, nranks):
        bit = rank & -rank
        # my parent is the next level up: xx01[0] -> xx10[0], or xx00[0] past the last rank
        up = (rank ^ bit) | (bit << 1)
        parent[rank] = up if up < nranks else rank ^ bit
    return _tree_from_parents(parent)


def _relabel(tree: Tree, label: list[int]) -> Tree:
    """The same tree with rank x renamed ``label[x]``."""
    parent: list[int | None] = [None] * len(label)
    for old, up in enumerate(tree.parent):
        parent[label[old]] = None if up is None else label[up]
    return _tree_from_parents(parent)


def double_binary_tree(nranks: int) -> tuple[Tree, Tree]:
    """Two binary trees over all ranks in which each rank is interior in at most one."""
    first = binary_tree(nranks)
    if nranks % 2 == 0:
        # mirror: even ranks (tree 0's interior ones) become odd ones
        return first, _relabel(first, [nranks - 1 - r for r in range(nranks)])
    # odd p: the tree over p+1 ranks without rank 0 on top, shifted down by one: a full binary
    # tree whose interior ranks are odd
    wider = binary_tree(nranks + 1)
    parent = [None if up == 0 else up - 1 for up in wider.parent[1:]]
    return first, _tree_from_parents(parent)


def _binomial_level(virtual: int, nranks: int) -> int:
    """``i`` such that ``2^i`` is the lowest set bit of ``virtual``; ``L`` for the root."""
    return (nranks - 1).bit_length() if virtual == 0 else (virtual & -virtual).bit_length() - 1


def _binomial_parent(virtual: int) -> int:
    return virtual - (virtual & -virtual)


def _binomial_subtree(virtual: int, nranks: int) -> range:
    return range(virtual, min(virtual + (1 << _binomial_level(virtual, nranks)), nranks))


def binomial_tree(nranks: int, root: int = 0) -> Tree:
    """MPICH's binomial tree at ``root``: the parent of ``v = rank - root`` clears its low bit."""
    parent: list[int | None] = [None] * nranks
    for virtual in range(1, nranks):
        parent[(virtual + root) % nranks] = (_binomial_parent(virtual) + root) % nranks
    return _tree_from_parents(parent)


# A timetable entry: (round, src, dst, chunk, reduce).
Timed = tuple[int, int, int, int, bool]


def _emit(b: ScheduleBuilder, timetable: Iterable[Timed]) -> Schedule:
    """Add the transfers round by round, closing every rank's step after each round."""
    by_round: dict[int, list[Timed]] = defaultdict(list)
    for entry in timetable:
        by_round[entry[0]].append(entry)
    for round_ in sorted(by_round):
        for _, src, dst, chunk, reduce in by_round[round_]:
            b.transfer(src, dst, chunk, reduce=reduce)
        b.end_step()
    return b.build()


def allreduce_double_binary_tree(nranks: int, nsegments: int = 1) -> Schedule:
    b = ScheduleBuilder(Collective.ALLREDUCE, "tree", nranks, nblocks=2, nsegments=nsegments)
    timetable: list[Timed] = []
    for block, tree in enumerate(double_binary_tree(nranks)):
        depth, height = tree.depths(), tree.heights()
        top = height[tree.root]
        for segment in range(nsegments):
            chunk = b.chunk(block, segment)
            for rank, parent in enumerate(tree.parent):
                if parent is None:
                    continue
                # up: once all my children added theirs, send my partial sum to my parent
                timetable.append((segment + height[rank], rank, parent, chunk, True))
                # down: the parent passes the full sum on, one hop per round from the root
                timetable.append((segment + top + depth[rank] - 1, parent, rank, chunk, False))
    return _emit(b, timetable)


def broadcast_binomial_tree(nranks: int, root: int, nsegments: int = 1) -> Schedule:
    b = ScheduleBuilder(Collective.BROADCAST, "tree", nranks, nblocks=1, nsegments=nsegments,
                        root=root)
    levels = _binomial_level(0, nranks)
    timetable: list[Timed] = []
    for virtual in range(1, nranks):
        src = (_binomial_parent(virtual) + root) % nranks
        dst = (virtual + root) % nranks
        for segment in range(nsegments):
            # down: the parent forwards the segment to its farthest child first
            when = segment + levels - 1 - _binomial_level(virtual, nranks)
            timetable.append((when, src, dst, b.chunk(0, segment), False))
    return _emit(b, timetable)


def reduce_binomial_tree(nranks: int, root: int, nsegments: int = 1) -> Schedule:
    b = ScheduleBuilder(Collective.REDUCE, "tree", nranks, nblocks=1, nsegments=nsegments,
                        root=root)
    timetable: list[Timed] = []
    for virtual in range(1, nranks):
        src = (virtual + root) % nranks
        dst = (_binomial_parent(virtual) + root) % nranks
        for segment in range(nsegments):
            # up: once my children added theirs, send my partial sum to my parent
            when = segment + _binomial_level(virtual, nranks)
            timetable.append((when, src, dst, b.chunk(0, segment), True))
    return _emit(b, timetable)


def reduce_scatter_binomial_tree(nranks: int, nsegments: int = 1) -> Schedule:
    b = ScheduleBuilder(Collective.REDUCE_SCATTER, "tree", nranks, nblocks=nranks,
                        nsegments=nsegments)
    levels = _binomial_level(0, nranks)
    timetable: list[Timed] = []
    for rank in range(1, nranks):
        parent, level = _binomial_parent(rank), _binomial_level(rank, nranks)
        for segment in range(nsegments):
            # up: send the partial sum of the whole segment (every block) to my parent
            for block in range(nranks):
                when = segment + level
                timetable.append((when, rank, parent, b.chunk(block, segment), True))
            # down: once rank 0 holds the segment reduced, scatter each subtree's blocks to it
            for block in _binomial_subtree(rank, nranks):
                when = levels + segment + levels - 1 - level
                timetable.append((when, parent, rank, b.chunk(block, segment), False))
    return _emit(b, timetable)


def allgather_binomial_tree(nranks: int, nsegments: int = 1) -> Schedule:
    b = ScheduleBuilder(Collective.ALLGATHER, "tree", nranks, nblocks=nranks,
                        nsegments=nsegments)
    levels = _binomial_level(0, nranks)
    timetable: list[Timed] = []
    for rank in range(1, nranks):
        parent, level = _binomial_parent(rank), _binomial_level(rank, nranks)
        subtree = _binomial_subtree(rank, nranks)
        for segment in range(nsegments):
            # up: forward my subtree's blocks to my parent, gathering everything at rank 0
            for block in subtree:
                when = segment + level
                timetable.append((when, rank, parent, b.chunk(block, segment), False))
            # down: broadcast back every block the child's subtree does not hold yet
            for block in range(nranks):
                if block not in subtree:
                    when = levels + segment + levels - 1 - level
                    timetable.append((when, parent, rank, b.chunk(block, segment), False))
    return _emit(b, timetable)


SCHEDULES: dict[Collective, Callable[..., Schedule]] = {
    Collective.ALLREDUCE: allreduce_double_binary_tree,
    Collective.BROADCAST: broadcast_binomial_tree,
    Collective.REDUCE: reduce_binomial_tree,
    Collective.REDUCE_SCATTER: reduce_scatter_binomial_tree,
    Collective.ALLGATHER: allgather_binomial_tree,
}
