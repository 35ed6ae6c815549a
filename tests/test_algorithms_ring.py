"""Ring schedules: the checker accepts them, and their sends and rounds match the textbook."""

from __future__ import annotations

import pytest

from pycoll.algorithms import ring
from pycoll.check import check
from pycoll.schedule import Collective, Recv, Send

NRANKS = range(1, 17)
SEGMENTS = [1, 2, 3, 4]


def test_schedules_cover_the_ring_family():
    assert set(ring.SCHEDULES) == {
        Collective.ALLREDUCE, Collective.REDUCE_SCATTER, Collective.ALLGATHER,
        Collective.BROADCAST, Collective.REDUCE,
    }
    for emit in ring.SCHEDULES.values():
        assert emit.__module__ == ring.__name__


@pytest.mark.parametrize("nsegments", SEGMENTS)
def test_allreduce_ring(nsegments):
    for p in NRANKS:
        schedule = ring.allreduce_ring(p, nsegments)
        report = check(schedule)
        assert (schedule.algorithm, schedule.nblocks) == ("ring", p)
        assert schedule.count(Send) == schedule.count(Recv) == 2 * p * (p - 1) * nsegments
        assert len(report.rounds) == 2 * (p - 1) * nsegments
        # every rank talks only to its ring neighbours
        for rank, steps in enumerate(schedule.steps):
            for step in steps:
                for t in step:
                    expected = (rank + 1) % p if isinstance(t, Send) else (rank - 1) % p
                    assert t.peer == expected


@pytest.mark.parametrize("nsegments", SEGMENTS)
def test_reduce_scatter_ring(nsegments):
    for p in NRANKS:
        schedule = ring.reduce_scatter_ring(p, nsegments)
        report = check(schedule)
        assert schedule.nblocks == p
        assert schedule.count(Send) == p * (p - 1) * nsegments
        assert len(report.rounds) == (p - 1) * nsegments
        # every receive reduces, and every rank sends one block per round
        assert all(t.reduce for rank in schedule.steps for step in rank for t in step
                   if isinstance(t, Recv))
        assert all(len(steps) == (p - 1) * nsegments for steps in schedule.steps)


def test_reduce_scatter_ring_last_round_completes_block_r_at_rank_r():
    p = 5
    report = check(ring.reduce_scatter_ring(p))
    for delivery in report.rounds[-1]:
        assert delivery.dst_chunk == delivery.dst  # block r, segment 0
        assert len(delivery.contents) == p - 1  # the sum of every rank but the receiver


@pytest.mark.parametrize("nsegments", SEGMENTS)
def test_allgather_ring(nsegments):
    for p in NRANKS:
        schedule = ring.allgather_ring(p, nsegments)
        report = check(schedule)
        assert schedule.nblocks == p
        assert schedule.count(Send) == p * (p - 1) * nsegments
        assert len(report.rounds) == (p - 1) * nsegments
        assert not any(t.reduce for rank in schedule.steps for step in rank for t in step
                       if isinstance(t, Recv))


@pytest.mark.parametrize("collective", [Collective.BROADCAST, Collective.REDUCE])
@pytest.mark.parametrize("nsegments", [1, 2, 3, 5, 8])
def test_chain_every_root(collective, nsegments):
    emit = ring.SCHEDULES[collective]
    for p in NRANKS:
        for root in range(p):
            schedule = emit(p, root, nsegments)
            report = check(schedule)
            assert (schedule.root, schedule.nblocks) == (root, 1)
            assert schedule.count(Send) == (p - 1) * nsegments
            # the pipeline: (p-1) hops for the first segment, one more round per segment
            assert len(report.rounds) == (0 if p == 1 else (p - 1) + (nsegments - 1))


@pytest.mark.parametrize("collective", [Collective.BROADCAST, Collective.REDUCE])
def test_chain_forwards_while_it_receives(collective):
    p, root, nsegments = 6, 2, 4
    schedule = ring.SCHEDULES[collective](p, root, nsegments)
    chain = [(root + i) % p for i in range(p)]
    # a middle rank sends one segment and receives the next in the same step
    upstream, middle, downstream = (
        (chain[1], chain[2], chain[3]) if collective is Collective.BROADCAST
        else (chain[3], chain[2], chain[1])
    )
    steps = schedule.steps[middle]
    assert len(steps) == nsegments + 1
    for index, step in enumerate(steps[1:-1], start=1):
        assert sorted(step, key=lambda t: isinstance(t, Send)) == [
            Recv(upstream, index, collective is Collective.REDUCE),
            Send(downstream, index - 1),
        ]
