"""Direct schedules: the checker accepts them; one round each (AllToAll p-1), textbook sends."""

from __future__ import annotations

import pytest

from pycoll.algorithms import direct
from pycoll.check import check
from pycoll.schedule import Buffer, Collective, Recv, Send

NRANKS = range(1, 17)
SEGMENTS = [1, 2, 3]


def transfers(schedule, kind):
    return [t for steps in schedule.steps for step in steps for t in step if isinstance(t, kind)]


def test_schedules_cover_the_direct_family():
    assert set(direct.SCHEDULES) == {
        Collective.ALLREDUCE, Collective.REDUCE_SCATTER, Collective.ALLGATHER,
        Collective.ALLTOALL, Collective.SENDRECV,
    }
    for emit in direct.SCHEDULES.values():
        assert emit.__module__ == direct.__name__


@pytest.mark.parametrize("nsegments", SEGMENTS)
def test_allreduce_one_shot(nsegments):
    for p in NRANKS:
        schedule = direct.allreduce_one_shot(p, nsegments)
        report = check(schedule)
        assert (schedule.algorithm, schedule.nblocks) == ("direct", 1)
        assert len(report.rounds) == (0 if p == 1 else 1)
        assert schedule.count(Send) == schedule.count(Recv) == p * (p - 1) * nsegments
        # sends read INPUT, since the same step reduces into every WORK chunk
        assert all(t.buffer is Buffer.INPUT for t in transfers(schedule, Send))
        assert schedule.input_read_late == frozenset(range(p) if p > 1 else ())
        for rank, steps in enumerate(schedule.steps):
            if p == 1:
                assert steps == ()
                continue
            (step,) = steps
            sends = [t for t in step if isinstance(t, Send)]
            recvs = [t for t in step if isinstance(t, Recv)]
            assert len(sends) == len(recvs) == (p - 1) * nsegments
            assert all(t.reduce for t in recvs)
            assert {t.peer for t in step} == set(range(p)) - {rank}


def test_allreduce_one_shot_reduces_in_rank_order():
    # each rank adds the others' arrays in rank order after its own: the order differs between
    # ranks, which is why float results may differ in the last bits (documented)
    p = 5
    schedule = direct.allreduce_one_shot(p)
    for rank, (step,) in enumerate(schedule.steps):
        assert [t.peer for t in step if isinstance(t, Recv)] == [q for q in range(p) if q != rank]


@pytest.mark.parametrize("nsegments", SEGMENTS)
def test_reduce_scatter_direct(nsegments):
    for p in NRANKS:
        schedule = direct.reduce_scatter_direct(p, nsegments)
        report = check(schedule)
        assert schedule.nblocks == p
        assert len(report.rounds) == (0 if p == 1 else 1)
        # every rank sends (p-1)/p n: one block to each peer
        assert schedule.count(Send) == p * (p - 1) * nsegments
        for rank, steps in enumerate(schedule.steps):
            for step in steps:
                for t in step:
                    if isinstance(t, Send):
                        assert schedule.block_of(t.chunk) == t.peer
                        assert t.buffer is Buffer.INPUT
                    else:
                        assert t.reduce and schedule.block_of(t.chunk) == rank


@pytest.mark.parametrize("nsegments", SEGMENTS)
def test_allgather_direct(nsegments):
    for p in NRANKS:
        schedule = direct.allgather_direct(p, nsegments)
        report = check(schedule)
        assert schedule.nblocks == p
        assert len(report.rounds) == (0 if p == 1 else 1)
        assert schedule.count(Send) == p * (p - 1) * nsegments
        assert not schedule.input_read_late
        for rank, steps in enumerate(schedule.steps):
            for step in steps:
                for t in step:
                    if isinstance(t, Send):  # only my own block, which I never receive into
                        assert schedule.block_of(t.chunk) == rank
                    else:
                        assert not t.reduce and schedule.block_of(t.chunk) == t.peer


@pytest.mark.parametrize("nsegments", SEGMENTS)
def test_alltoall_pairwise(nsegments):
    for p in NRANKS:
        schedule = direct.alltoall_pairwise(p, nsegments)
        report = check(schedule)
        assert schedule.nblocks == p
        assert len(report.rounds) == p - 1
        assert schedule.count(Send) == p * (p - 1) * nsegments
        for rank, steps in enumerate(schedule.steps):
            assert len(steps) == p - 1
            for k, step in enumerate(steps, start=1):
                # round k: my piece for rank r+k goes out, rank r-k's piece for me comes in
                to, frm = (rank + k) % p, (rank - k) % p
                for t in step:
                    if isinstance(t, Send):
                        assert t.peer == to and t.buffer is Buffer.INPUT
                        assert schedule.block_of(t.chunk) == to
                    else:
                        assert t.peer == frm and not t.reduce
                        assert schedule.block_of(t.chunk) == frm
                assert len(step) == 2 * nsegments


@pytest.mark.parametrize("nsegments", SEGMENTS)
def test_sendrecv_every_pair(nsegments):
    for p in range(2, 9):
        for src in range(p):
            for dst in range(p):
                if src == dst:
                    continue
                schedule = direct.sendrecv(p, src, dst, nsegments)
                report = check(schedule)
                assert (schedule.root, schedule.peer, schedule.nblocks) == (src, dst, 1)
                assert len(report.rounds) == 1
                assert schedule.count(Send) == nsegments
                # only src and dst have steps, one each
                for rank, steps in enumerate(schedule.steps):
                    assert len(steps) == (1 if rank in (src, dst) else 0)
                assert all(t.buffer is Buffer.INPUT for t in transfers(schedule, Send))
                assert not any(t.reduce for t in transfers(schedule, Recv))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((4, 2, 2), r"src=2 and dst=2 must be different"),
        ((4, 4, 1), r"src=4 is not a rank; allowed: 0..3"),
        ((4, -1, 1), r"src=-1 is not a rank"),
        ((4, 0, 7), r"dst=7 is not a rank; allowed: 0..3"),
        ((1, 0, 0), r"src=0 and dst=0 must be different"),
    ],
)
def test_sendrecv_rejects_bad_ranks(args, message):
    with pytest.raises(ValueError, match=message):
        direct.sendrecv(*args)


def test_one_rank_has_no_steps():
    for collective, emit in direct.SCHEDULES.items():
        if collective is Collective.SENDRECV:
            continue
        for nsegments in SEGMENTS:
            schedule = emit(1, nsegments)
            assert schedule.steps == ((),)
            check(schedule)
