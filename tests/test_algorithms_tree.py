"""Tree schedules: valid (double) binary and binomial trees, checked schedules, textbook rounds."""

from __future__ import annotations

import pytest

from pycoll.algorithms import tree
from pycoll.check import check
from pycoll.schedule import Collective, Recv, Send

NRANKS = range(1, 17)
SEGMENTS = [1, 2, 3, 4, 8]


def levels(p: int) -> int:
    """ceil(log2 p)."""
    return (p - 1).bit_length()


def assert_spanning_tree(t: tree.Tree, p: int, max_children: int) -> None:
    assert len(t.parent) == len(t.children) == p
    assert t.parent.count(None) == 1
    for rank in range(p):
        assert len(t.children[rank]) <= max_children
        assert len(set(t.children[rank])) == len(t.children[rank])
        for child in t.children[rank]:
            assert t.parent[child] == rank
        if t.parent[rank] is not None:
            assert rank in t.children[t.parent[rank]]
    reached, frontier = {t.root}, [t.root]
    while frontier:
        frontier = [c for r in frontier for c in t.children[r]]
        assert reached.isdisjoint(frontier)  # no cycles
        reached.update(frontier)
    assert reached == set(range(p))


def interior(t: tree.Tree) -> set[int]:
    return {rank for rank, children in enumerate(t.children) if children}


def test_schedules_cover_the_tree_family():
    assert set(tree.SCHEDULES) == {
        Collective.ALLREDUCE, Collective.REDUCE_SCATTER, Collective.ALLGATHER,
        Collective.BROADCAST, Collective.REDUCE,
    }


def test_binary_tree_is_nccls():
    # the illustration in NCCL's trees.cc, 14 ranks
    t = tree.binary_tree(14)
    assert t.root == 0
    assert t.children[0] == (8,)
    assert t.children[8] == (4, 12)
    assert t.children[4] == (2, 6)
    assert t.children[12] == (10, 13)
    assert t.children[10] == (9, 11)
    assert all(not t.children[r] for r in range(1, 14, 2))
    # 8 ranks: 0 -> 4 -> (2 -> 1, 3), (6 -> 5, 7)
    assert tree.binary_tree(8).children[:7] == ((4,), (), (1, 3), (), (2, 6), (), (5, 7))


def test_double_binary_tree_mirrors_for_even_p():
    first, second = tree.double_binary_tree(8)
    assert first == tree.binary_tree(8)
    assert second.root == 7
    assert second.children[7] == (3,)
    assert second.children[3] == (1, 5)
    assert interior(first) == {0, 2, 4, 6} and interior(second) == {1, 3, 5, 7}


@pytest.mark.parametrize("p", range(1, 65))
def test_double_binary_tree_is_two_spanning_trees_sharing_no_interior_rank(p):
    first, second = tree.double_binary_tree(p)
    assert first == tree.binary_tree(p)
    assert_spanning_tree(first, p, max_children=2)
    assert_spanning_tree(second, p, max_children=2)
    assert interior(first).isdisjoint(interior(second))
    # both trees are as shallow as a binary tree can be with NCCL's extra top rank
    assert max(first.heights()) == levels(p)
    assert max(second.heights()) <= levels(p)


@pytest.mark.parametrize("p", range(1, 65))
def test_binomial_tree(p):
    for root in {0, p // 2, p - 1}:
        t = tree.binomial_tree(p, root)
        assert t.root == root
        assert_spanning_tree(t, p, max_children=levels(p))
        # the height is the most set bits of any v < p: log2 p for a power of two
        assert max(t.heights()) == max(v.bit_count() for v in range(p))


@pytest.mark.parametrize("nsegments", [1, 2, 4, 8])
def test_allreduce_double_binary_tree(nsegments):
    for p in NRANKS:
        schedule = tree.allreduce_double_binary_tree(p, nsegments)
        report = check(schedule)
        assert (schedule.algorithm, schedule.nblocks) == ("tree", 2)
        # each block goes up and down its tree: 2(p-1) transfers per block and segment
        assert schedule.count(Send) == schedule.count(Recv) == 4 * (p - 1) * nsegments
        height = max(max(t.heights()) for t in tree.double_binary_tree(p))
        assert len(report.rounds) == (0 if p == 1 else 2 * height + nsegments - 1)


def test_allreduce_double_binary_tree_rounds_at_8_ranks():
    assert len(check(tree.allreduce_double_binary_tree(8, 1)).rounds) == 6
    # pipelined: 8 segments cost 7 rounds more, not 8 times as many
    assert len(check(tree.allreduce_double_binary_tree(8, 8)).rounds) == 13


def test_allreduce_double_binary_tree_moves_block_t_over_tree_t():
    p, nsegments = 7, 3
    schedule = tree.allreduce_double_binary_tree(p, nsegments)
    trees = tree.double_binary_tree(p)
    for rank, steps in enumerate(schedule.steps):
        for step in steps:
            for t in step:
                edge = trees[schedule.block_of(t.chunk)]
                assert t.peer == edge.parent[rank] or t.peer in edge.children[rank]


def test_allreduce_double_binary_tree_overlaps_up_and_down():
    # some round carries a segment down while a later one still goes up
    report = check(tree.allreduce_double_binary_tree(8, 4))
    assert any({d.reduce for d in deliveries} == {True, False} for deliveries in report.rounds)


@pytest.mark.parametrize("collective", [Collective.BROADCAST, Collective.REDUCE])
@pytest.mark.parametrize("nsegments", SEGMENTS)
def test_binomial_rooted_every_root(collective, nsegments):
    emit = tree.SCHEDULES[collective]
    for p in NRANKS:
        for root in range(p):
            schedule = emit(p, root, nsegments)
            report = check(schedule)
            assert (schedule.root, schedule.nblocks) == (root, 1)
            assert schedule.count(Send) == (p - 1) * nsegments
            assert len(report.rounds) == (0 if p == 1 else levels(p) + nsegments - 1)


def test_binomial_broadcast_one_segment_sends_once_per_round():
    schedule = tree.broadcast_binomial_tree(16, 5)
    for steps in schedule.steps:
        assert all(sum(isinstance(t, Send) for t in step) <= 1 for step in steps)


@pytest.mark.parametrize("collective", [Collective.REDUCE_SCATTER, Collective.ALLGATHER])
@pytest.mark.parametrize("nsegments", SEGMENTS)
def test_binomial_sharded(collective, nsegments):
    emit = tree.SCHEDULES[collective]
    for p in NRANKS:
        schedule = emit(p, nsegments)
        report = check(schedule)
        assert schedule.nblocks == p
        assert len(report.rounds) == (0 if p == 1 else 2 * levels(p) + nsegments - 1)


def test_reduce_scatter_binomial_tree_bytes():
    p, nsegments = 8, 2
    schedule = tree.reduce_scatter_binomial_tree(p, nsegments)
    # up: every rank but 0 sends the whole array; down: every rank but 0 gets its subtree
    subtree = [8, 1, 2, 1, 4, 1, 2, 1]
    assert schedule.count(Send) == ((p - 1) * p + sum(subtree[1:])) * nsegments


def test_allgather_binomial_tree_bytes():
    p = 8
    schedule = tree.allgather_binomial_tree(p)
    # up: each rank forwards its subtree; down: each child gets what its subtree lacks
    subtree = [8, 1, 2, 1, 4, 1, 2, 1]
    assert schedule.count(Send) == sum(subtree[1:]) + sum(p - s for s in subtree[1:])
