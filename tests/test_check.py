"""The checker accepts every shipped schedule and rejects broken ones, naming rank, step, chunk."""

from __future__ import annotations

import pytest

from pycoll import algorithms
from pycoll.check import ScheduleError, check
from pycoll.schedule import (
    ROOTED,
    Buffer,
    Collective,
    Layout,
    Recv,
    Schedule,
    ScheduleBuilder,
    Send,
    split,
)

SHIPPED = [
    (family, collective)
    for collective in Collective
    for family in algorithms.families_for(collective)
]


@pytest.mark.parametrize("family,collective", SHIPPED, ids=[f"{f}-{c.value}" for f, c in SHIPPED])
@pytest.mark.parametrize("nsegments", [1, 2, 3])
def test_every_shipped_schedule_meets_its_contract(family, collective, nsegments):
    for nranks in range(1, 17):
        if collective in ROOTED:
            roots = range(nranks) if nsegments == 1 else {0, nranks // 2, nranks - 1}
            for root in roots:
                check(algorithms.build(family, collective, nranks, nsegments, root))
        elif collective is Collective.SENDRECV:
            for src, dst in {(0, nranks - 1), (nranks - 1, 0), (nranks // 2, 0)}:
                if src != dst:
                    check(algorithms.build(family, collective, nranks, nsegments, src, dst))
        else:
            check(algorithms.build(family, collective, nranks, nsegments))


def _ring_allreduce_with(mutate) -> ScheduleBuilder:
    nranks = 3
    b = ScheduleBuilder(Collective.ALLREDUCE, "broken", nranks, nblocks=nranks)
    for k in range(nranks - 1):
        for r in range(nranks):
            mutate(b, "reduce", k, r)
        b.end_step()
    for k in range(nranks - 1):
        for r in range(nranks):
            mutate(b, "gather", k, r)
        b.end_step()
    return b


def _correct(b, phase, k, r):
    n = b.nranks
    if phase == "reduce":
        b.transfer(r, (r + 1) % n, (r - k) % n, reduce=True)
    else:
        b.transfer(r, (r + 1) % n, (r + 1 - k) % n)


def test_the_unbroken_version_passes():
    check(_ring_allreduce_with(_correct).build())


def test_a_doubled_contribution_is_rejected_though_a_sum_would_hide_it():
    def doubled(b, phase, k, r):
        _correct(b, phase, k, r)
        if phase == "reduce" and k == 1 and r == 0:
            b.transfer(0, 1, (0 - k) % 3, reduce=True)  # rank 0 sends its partial sum twice

    with pytest.raises(
        ScheduleError,
        match=r"rank 1 step \d+ reduces chunk 2 from rank 0 and "
        r"would count .* twice",
    ):
        check(_ring_allreduce_with(doubled).build())


def test_a_send_without_a_receive_is_rejected():
    b = _ring_allreduce_with(_correct)
    b.add(2, Send(0, 1))
    with pytest.raises(
        ScheduleError,
        match=r"rank 2 step 4 sends chunk 1 to rank 0, which has "
        r"no receive left for it",
    ):
        check(b.build())


def test_a_receive_without_a_send_is_rejected():
    b = _ring_allreduce_with(_correct)
    b.add(1, Recv(2, 0, reduce=False))
    with pytest.raises(
        ScheduleError,
        match=r"rank 1 step 4 receives chunk 0 from rank 2, which "
        r"never sends it",
    ):
        check(b.build())


def test_a_missing_chunk_is_rejected():
    def skip_last(b, phase, k, r):
        if not (phase == "gather" and k == 1 and r == 2):
            _correct(b, phase, k, r)

    with pytest.raises(
        ScheduleError,
        match=r"rank 0 ends with chunk 2 wrong: missing "
        r"contributions \[\(1, 2\)\]",
    ):
        check(_ring_allreduce_with(skip_last).build())


def test_a_cyclic_wait_is_rejected():
    b = ScheduleBuilder(Collective.ALLREDUCE, "broken", 2, nblocks=1)
    for r in (0, 1):  # both ranks receive before they send: each waits for the other
        b.add(r, Recv(1 - r, 0, reduce=True))
        b.end_step(r)
        b.add(r, Send(1 - r, 0))
    with pytest.raises(
        ScheduleError,
        match=r"deadlock: rank 0 at step 0 waits for ranks \[1\]; "
        r"rank 1 at step 0 waits for ranks \[0\]",
    ):
        check(b.build())


def test_sending_undefined_data_is_rejected():
    b = ScheduleBuilder(Collective.ALLGATHER, "broken", 2, nblocks=2)
    b.transfer(0, 1, 1)  # rank 0 does not hold block 1 yet
    with pytest.raises(
        ScheduleError,
        match=r"rank 0 step 0 sends chunk 1 to rank 1 before it "
        r"holds any data",
    ):
        check(b.build())


def test_a_step_that_races_on_a_chunk_is_rejected():
    # The builder would split these into two steps; written by hand they share one.
    together = (Send(1, 0), Recv(1, 0, reduce=True))
    schedule = Schedule(Collective.ALLREDUCE, "broken", 2, 1, 1, steps=((together,), (together,)))
    with pytest.raises(
        ScheduleError,
        match=r"rank 0 step 0 receives into chunk 0 while the "
        r"same step sends it",
    ):
        check(schedule)


def test_a_receive_into_the_wrong_chunk_is_rejected():
    b = ScheduleBuilder(Collective.ALLREDUCE, "broken", 2, nblocks=2)
    b.add(0, Send(1, 0))
    b.add(1, Recv(0, 1, reduce=True))
    with pytest.raises(ScheduleError, match=r"must land in chunk 0"):
        check(b.build())


def test_alltoall_input_pieces_land_in_the_source_block():
    b = ScheduleBuilder(Collective.ALLTOALL, "broken", 2, nblocks=2)
    b.transfer(0, 1, 1, dst_chunk=0, buffer=Buffer.INPUT)
    b.transfer(1, 0, 0, dst_chunk=1, buffer=Buffer.INPUT)
    check(b.build())


@pytest.mark.parametrize("count,parts", [(0, 3), (1, 3), (7, 3), (9, 3), (100_003, 7)])
def test_split_and_layout_cover_every_element_once(count, parts):
    shares = split(count, parts)
    assert sum(shares) == count and max(shares) - min(shares) <= 1
    layout = Layout.even(count, parts, nsegments=4)
    ranges = [layout.chunk_range(c) for c in range(parts * 4)]
    assert ranges[0][0] == 0 and ranges[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(stop >= start for start, stop in ranges)
