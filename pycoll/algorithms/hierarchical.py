"""Hierarchical schedules: the node boundary inside the schedule.

The ``p = N k`` ranks sit in ``N`` nodes of ``k`` consecutive ranks (``ranks_per_node``):
rank ``r = n k + i`` is local rank ``i`` of node ``n``. Links within a node (shared memory,
NVLink) are much faster than links between nodes (the network), so these schedules move as
few bytes as possible between nodes: the data is first reduced or spread within each node,
and only one k-th of it crosses the network per rank, between the ranks of the same local
index ``i`` (one "rail" per local index, as NCCL's and Horovod's hierarchical AllReduce do).
The inner pieces are ring rounds (intra-node and inter-node groups run theirs at the same
time) and binomial trees. ``n`` is the array's size in bytes.

* :func:`allreduce_hierarchical` (``nblocks = p``, block ``i N + m`` is piece m of part i):
  intra-node ring ReduceScatter of the k parts (local rank i gets part i summed over its
  node); inter-node ring ReduceScatter and ring AllGather of part i among the N ranks of
  local index i; intra-node ring AllGather of the parts. Per rank: ``2(k-1)/k n`` bytes
  within the node, ``2(N-1)/N n/k`` between nodes (a flat ring sends ``2(p-1)/p n``, most of
  it across the network when each node's ring links leave it).
* :func:`reduce_scatter_hierarchical` (``nblocks = p``, block r for rank r): intra-node ring
  ReduceScatter of the parts (part i: blocks ``m k + i`` of every node m), then inter-node
  ring ReduceScatter among the ranks of local index i. ``(k-1)/k n`` within,
  ``(N-1)/N n/k`` between. A part's blocks are not adjacent, so an intra-node message is one
  per block (N per ring step).
* :func:`allgather_hierarchical` (``nblocks = p``): inter-node ring AllGather among the ranks
  of local index i (rank r's block r), then intra-node ring AllGather of the parts.
  ``(N-1)/N n/k`` between, ``(k-1)/k n`` within.
* :func:`broadcast_hierarchical` (``nblocks = 1``): a binomial tree between nodes over the
  root's local-index peers, then a binomial tree within every node from that rank:
  ``ceil(log2 N)`` inter-node rounds, then ``ceil(log2 k)`` intra-node rounds, each of
  ``alpha + n beta``.
* :func:`reduce_hierarchical` (``nblocks = 1``): the mirror image: binomial trees within every
  node to the rank of the root's local index, then between nodes to the root.

With ``k = p`` (one node) they are the flat ring and binomial schedules; with ``k = 1`` every
rank is its own node.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pycoll.schedule import Collective, Schedule, ScheduleBuilder

NODE_AWARE = True  # the emitters take ranks_per_node (see algorithms.build)


def _nodes(name: str, nranks: int, ranks_per_node: int) -> tuple[int, int]:
    """(nodes, ranks per node); ``ranks_per_node`` 0 means one node."""
    k = ranks_per_node or nranks
    if k < 1 or nranks % k:
        raise ValueError(
            f"hierarchical {name}: ranks_per_node={ranks_per_node} does not divide the "
            f"{nranks} ranks into equal nodes; allowed: a divisor of {nranks}"
        )
    return nranks // k, k


def _groups(nodes: int, k: int) -> tuple[list[list[int]], list[list[int]]]:
    """The ranks of every node (by local index), and of every local index (by node)."""
    within = [[n * k + i for i in range(k)] for n in range(nodes)]
    across = [[n * k + i for n in range(nodes)] for i in range(k)]
    return within, across


def _ring_rounds(b: ScheduleBuilder, groups: list[list[int]],
                 part: Callable[[int, int], Iterable[int]], reduce: bool) -> None:
    """Ring rounds within every group at once. ``part(group, position)``: the blocks of the
    part that the member at ``position`` ends with (reducing: ReduceScatter) or starts with
    (copying: AllGather)."""
    size = len(groups[0])
    # the ring links that touch a rank being built (all of them, unless costing at scale)
    links = [(g, members, [j for j in range(size)
                           if b.wants(members[j]) or b.wants(members[(j + 1) % size])])
             for g, members in enumerate(groups)]
    for k in range(size - 1):
        for g, members, positions in links:
            for j in positions:
                sent = (j - k - 1) % size if reduce else (j - k) % size
                for block in part(g, sent):
                    for chunk in b.chunks_of_block(block):
                        b.transfer(members[j], members[(j + 1) % size], chunk, reduce=reduce)
        b.end_step()


def _binomial(b: ScheduleBuilder, groups: list[list[int]], reduce: bool,
              blocks: Callable[[int], Iterable[int]] = lambda group: (0,)) -> None:
    """Binomial trees within every group at once, rooted at each group's first member,
    carrying ``blocks(group)``: towards the root when reducing, from it otherwise."""
    size = len(groups[0])
    distances = []
    d = 1
    while d < size:
        distances.append(d)
        d *= 2
    active = [(g, members) for g, members in enumerate(groups)
              if any(b.wants(m) for m in members)]
    for d in distances if reduce else reversed(distances):
        for g, members in active:
            for i in range(0, size - d, 2 * d):
                near, far = members[i], members[i + d]
                if not (b.wants(near) or b.wants(far)):  # dropped anyway: skip the loop
                    continue
                for chunk in (c for block in blocks(g) for c in b.chunks_of_block(block)):
                    if reduce:
                        b.transfer(far, near, chunk, reduce=True)
                    else:
                        b.transfer(near, far, chunk)
        b.end_step()


def allreduce_two_level(family: str, nranks: int, nsegments: int, ranks_per_node: int,
                        between: Callable[[ScheduleBuilder, list[list[int]], int], None]
                        ) -> Schedule:
    """An AllReduce over nodes: an intra-node ring ReduceScatter of the k parts (part i: the
    N adjacent blocks iN..iN+N-1, to local rank i), then ``between(b, across, N)``, which must
    leave every rank of local index i with part i summed over all ranks, then an intra-node
    ring AllGather of the parts."""
    nodes, k = _nodes("allreduce", nranks, ranks_per_node)
    b = ScheduleBuilder(Collective.ALLREDUCE, family, nranks, nblocks=nranks,
                        nsegments=nsegments)
    within, across = _groups(nodes, k)

    def part(node: int, i: int) -> range:
        return range(i * nodes, (i + 1) * nodes)

    _ring_rounds(b, within, part, reduce=True)  # local rank i: part i summed over the node
    between(b, across, nodes)
    _ring_rounds(b, within, part, reduce=False)  # every rank: every part
    return b.build()


def allreduce_hierarchical(nranks: int, nsegments: int = 1, ranks_per_node: int = 0
                           ) -> Schedule:
    def rings(b: ScheduleBuilder, across: list[list[int]], nodes: int) -> None:
        def piece(i: int, m: int) -> tuple[int]:  # piece m of part i
            return (i * nodes + m,)

        _ring_rounds(b, across, piece, reduce=True)  # rank (m, i): piece m, over all
        _ring_rounds(b, across, piece, reduce=False)  # rank (m, i): all of part i

    return allreduce_two_level("hierarchical", nranks, nsegments, ranks_per_node, rings)


def reduce_scatter_hierarchical(nranks: int, nsegments: int = 1, ranks_per_node: int = 0
                                ) -> Schedule:
    nodes, k = _nodes("reduce_scatter", nranks, ranks_per_node)
    b = ScheduleBuilder(Collective.REDUCE_SCATTER, "hierarchical", nranks, nblocks=nranks,
                        nsegments=nsegments)
    within, across = _groups(nodes, k)
    # local rank i: the blocks of every node's local rank i, summed over its node
    _ring_rounds(b, within, lambda node, i: range(i, nranks, k), reduce=True)
    # rank (m, i): its own block, summed over the nodes
    _ring_rounds(b, across, lambda i, m: (m * k + i,), reduce=True)
    return b.build()


def allgather_hierarchical(nranks: int, nsegments: int = 1, ranks_per_node: int = 0
                           ) -> Schedule:
    nodes, k = _nodes("allgather", nranks, ranks_per_node)
    b = ScheduleBuilder(Collective.ALLGATHER, "hierarchical", nranks, nblocks=nranks,
                        nsegments=nsegments)
    within, across = _groups(nodes, k)
    # rank (m, i): the blocks of every node's local rank i
    _ring_rounds(b, across, lambda i, m: (m * k + i,), reduce=False)
    _ring_rounds(b, within, lambda node, i: range(i, nranks, k), reduce=False)
    return b.build()


def _rooted_groups(nranks: int, root: int, k: int) -> tuple[list[list[int]], list[list[int]]]:
    """The root's local-index peers on every node (root first), and every node's ranks from
    its rank of that local index on."""
    nodes, (root_node, root_local) = nranks // k, divmod(root, k)
    leaders = [((root_node + t) % nodes) * k + root_local for t in range(nodes)]
    within = [[n * k + (root_local + t) % k for t in range(k)] for n in range(nodes)]
    return [leaders], within


def broadcast_hierarchical(nranks: int, root: int, nsegments: int = 1,
                           ranks_per_node: int = 0) -> Schedule:
    _, k = _nodes("broadcast", nranks, ranks_per_node)
    b = ScheduleBuilder(Collective.BROADCAST, "hierarchical", nranks, nblocks=1,
                        nsegments=nsegments, root=root)
    leaders, within = _rooted_groups(nranks, root, k)
    _binomial(b, leaders, reduce=False)  # between nodes: to one rank per node
    _binomial(b, within, reduce=False)  # within every node, from that rank
    return b.build()


def reduce_hierarchical(nranks: int, root: int, nsegments: int = 1,
                        ranks_per_node: int = 0) -> Schedule:
    _, k = _nodes("reduce", nranks, ranks_per_node)
    b = ScheduleBuilder(Collective.REDUCE, "hierarchical", nranks, nblocks=1,
                        nsegments=nsegments, root=root)
    leaders, within = _rooted_groups(nranks, root, k)
    _binomial(b, within, reduce=True)  # within every node, to the root's local index
    _binomial(b, leaders, reduce=True)  # between nodes, to the root
    return b.build()


SCHEDULES: dict[Collective, Callable[..., Schedule]] = {
    Collective.ALLREDUCE: allreduce_hierarchical,
    Collective.REDUCE_SCATTER: reduce_scatter_hierarchical,
    Collective.ALLGATHER: allgather_hierarchical,
    Collective.BROADCAST: broadcast_hierarchical,
    Collective.REDUCE: reduce_hierarchical,
}
