"""The two-shot AllReduce: the checker accepts it; two rounds; each rank reduces only its
block and sends 2 (p-1)/p of the array."""

from __future__ import annotations

import pytest

from pycoll.algorithms import two_shot
from pycoll.check import check
from pycoll.schedule import Buffer, Recv, Send


@pytest.mark.parametrize("nsegments", [1, 2, 3])
def test_allreduce_two_shot(nsegments):
    for p in range(1, 17):
        schedule = two_shot.allreduce_two_shot(p, nsegments)
        report = check(schedule)
        assert (schedule.algorithm, schedule.nblocks) == ("two_shot", p)
        assert len(report.rounds) == (0 if p == 1 else 2)
        for rank, steps in enumerate(schedule.steps):
            if p == 1:
                assert steps == ()
                continue
            scatter, gather = steps
            # round 1: INPUT block j to rank j; every receive reduces into my block
            assert {(t.peer, t.buffer) for t in scatter if isinstance(t, Send)} == {
                (q, Buffer.INPUT) for q in range(p) if q != rank}
            received = [t for t in scatter if isinstance(t, Recv)]
            assert all(t.reduce for t in received)
            assert {t.chunk // nsegments for t in received} == {rank}
            # round 2: my reduced block (WORK) to everyone; copies of the others' blocks
            assert all(t.buffer is Buffer.WORK for t in gather if isinstance(t, Send))
            assert {t.chunk // nsegments for t in gather if isinstance(t, Send)} == {rank}
            assert not any(t.reduce for t in gather if isinstance(t, Recv))
        assert schedule.count(Send) == 2 * p * (p - 1) * nsegments
