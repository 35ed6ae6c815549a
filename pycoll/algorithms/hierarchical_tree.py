"""Hierarchical AllReduce with trees between nodes: for small arrays across many nodes.

The layout and the intra-node phases are :mod:`pycoll.algorithms.hierarchical`'s (N nodes of
k consecutive ranks; an intra-node ring ReduceScatter of the k parts, then an intra-node ring
AllGather); between nodes, part i is reduced up a binomial tree over the N ranks of local
index i (rooted on node 0) and broadcast back down it, instead of ring rounds. That takes
``2 ceil(log2 N)`` inter-node rounds instead of ``2(N-1)``, at the price of up to
``ceil(log2 N) n/k`` bytes per rank between nodes instead of ``2(N-1)/N n/k``: the choice for
small arrays over many nodes (the model decides where).

* :func:`allreduce_hierarchical_tree` (``nblocks = p``): rounds ``2(k-1) + 2 ceil(log2 N)``.
"""

from __future__ import annotations

from collections.abc import Callable

from pycoll.algorithms.hierarchical import _binomial, allreduce_two_level
from pycoll.schedule import Collective, Schedule, ScheduleBuilder

NODE_AWARE = True  # the emitters take ranks_per_node (see algorithms.build)


def allreduce_hierarchical_tree(nranks: int, nsegments: int = 1, ranks_per_node: int = 0
                                ) -> Schedule:
    def trees(b: ScheduleBuilder, across: list[list[int]], nodes: int) -> None:
        def part(i: int) -> range:
            return range(i * nodes, (i + 1) * nodes)

        _binomial(b, across, reduce=True, blocks=part)  # part i summed over all, on node 0
        _binomial(b, across, reduce=False, blocks=part)  # and back to every node

    return allreduce_two_level("hierarchical_tree", nranks, nsegments, ranks_per_node, trees)


SCHEDULES: dict[Collective, Callable[..., Schedule]] = {
    Collective.ALLREDUCE: allreduce_hierarchical_tree,
}
