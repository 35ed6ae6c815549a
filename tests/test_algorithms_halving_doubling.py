"""Halving-doubling schedules: the checker accepts them; rounds and bytes match the textbook."""

from __future__ import annotations

import pytest

from pycoll.algorithms import halving_doubling as hd
from pycoll.check import check
from pycoll.schedule import Collective, Recv, Send

NRANKS = [*range(1, 17), 24, 31]
SEGMENTS = [1, 2, 3]


def log2_floor(p: int) -> int:
    return p.bit_length() - 1


def is_power_of_two(p: int) -> bool:
    return p & (p - 1) == 0


def sends_per_rank(schedule) -> list[int]:
    return [sum(isinstance(t, Send) for step in steps for t in step) for steps in schedule.steps]


def receives(schedule):
    return [t for steps in schedule.steps for step in steps for t in step if isinstance(t, Recv)]


def test_schedules_cover_the_halving_doubling_family():
    assert set(hd.SCHEDULES) == {
        Collective.ALLREDUCE, Collective.REDUCE_SCATTER, Collective.ALLGATHER,
    }
    for emit in hd.SCHEDULES.values():
        assert emit.__module__ == hd.__name__


@pytest.mark.parametrize("p", range(1, 40))
def test_survivors_fold_pairs_and_own_contiguous_blocks(p):
    survivors = hd.Survivors(p)
    power, extra = survivors.power_of_two, survivors.extra
    assert is_power_of_two(power) and power <= p < 2 * power
    ranks = [survivors.rank(v) for v in range(power)]
    folded = [even for even, _ in survivors.folded_pairs()]
    # the survivors and the ranks that step aside are every rank, once
    assert sorted(ranks + folded) == list(range(p))
    # survivor v owns its rank's block and its folded partner's; together, every block once
    owned = [list(survivors.rank_blocks(v, v + 1)) for v in range(power)]
    assert [block for blocks in owned for block in blocks] == list(range(p))
    for v, blocks in enumerate(owned):
        assert blocks == ([ranks[v] - 1, ranks[v]] if v < extra else [ranks[v]])


@pytest.mark.parametrize("nsegments", SEGMENTS)
def test_reduce_scatter_halving(nsegments):
    for p in NRANKS:
        schedule = hd.reduce_scatter_halving(p, nsegments)
        report = check(schedule)
        assert (schedule.algorithm, schedule.nblocks) == ("halving_doubling", p)
        lg = log2_floor(p)
        assert len(report.rounds) == (lg if is_power_of_two(p) else lg + 2)
        # every rank sends every block but its own exactly once: (p-1)/p n bytes
        assert sends_per_rank(schedule) == [(p - 1) * nsegments] * p
        assert all(t.reduce for t in receives(schedule))


@pytest.mark.parametrize("nsegments", SEGMENTS)
def test_allgather_doubling(nsegments):
    for p in NRANKS:
        schedule = hd.allgather_doubling(p, nsegments)
        report = check(schedule)
        assert (schedule.algorithm, schedule.nblocks) == ("halving_doubling", p)
        lg = log2_floor(p)
        assert len(report.rounds) == (lg if is_power_of_two(p) else lg + 2)
        assert not any(t.reduce for t in receives(schedule))
        if is_power_of_two(p):
            assert sends_per_rank(schedule) == [(p - 1) * nsegments] * p
        # every rank receives every block but its own exactly once
        assert schedule.count(Recv) == p * (p - 1) * nsegments


@pytest.mark.parametrize("nsegments", SEGMENTS)
def test_allreduce_rabenseifner(nsegments):
    for p in NRANKS:
        schedule = hd.allreduce_rabenseifner(p, nsegments)
        report = check(schedule)
        power = 1 << log2_floor(p)
        assert (schedule.algorithm, schedule.nblocks) == ("halving_doubling", power)
        lg = log2_floor(p)
        assert len(report.rounds) == (2 * lg if is_power_of_two(p) else 2 * lg + 2)
        # survivors send 2(p'-1)/p' n; a folded pair adds n each way
        survivors = hd.Survivors(p)
        expected = [2 * (power - 1) * nsegments] * p
        for even, odd in survivors.folded_pairs():
            expected[even] = power * nsegments
            expected[odd] += power * nsegments
        assert sends_per_rank(schedule) == expected


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_power_of_two_partners_are_xor_distances(p):
    lg = log2_floor(p)
    halving = [p >> (k + 1) for k in range(lg)]
    doubling = [1 << k for k in range(lg)]
    cases = [
        (hd.reduce_scatter_halving(p, 2), halving),
        (hd.allgather_doubling(p, 2), doubling),
        (hd.allreduce_rabenseifner(p, 2), halving + doubling),
    ]
    for schedule, distances in cases:
        for rank, steps in enumerate(schedule.steps):
            assert len(steps) == len(distances)
            for step, distance in zip(steps, distances):
                assert {t.peer for t in step} == {rank ^ distance}
                # d blocks travel each way, one transfer per chunk, in one step
                sends = [t for t in step if isinstance(t, Send)]
                assert len(sends) == len(step) - len(sends) == distance * 2


def test_round_volumes_halve_then_double():
    p, nsegments = 16, 3
    report = check(hd.allreduce_rabenseifner(p, nsegments))
    per_rank = [len(deliveries) // p for deliveries in report.rounds]
    # chunks each rank sends per round: p/2, p/4, ..., 1 blocks, then back up
    assert per_rank == [b * nsegments for b in (8, 4, 2, 1, 1, 2, 4, 8)]


def test_reduce_scatter_last_halving_round_completes_block_r_at_rank_r():
    p = 8
    report = check(hd.reduce_scatter_halving(p))
    for delivery in report.rounds[-1]:
        assert delivery.dst_chunk == delivery.dst
        assert len(delivery.contents) == p // 2  # the partner's half of the ranks


@pytest.mark.parametrize("p", [3, 6, 7, 12])
def test_non_power_of_two_folds_in_first_and_out_last(p):
    survivors = hd.Survivors(p)
    for emit in hd.SCHEDULES.values():
        schedule = emit(p, 2)
        report = check(schedule)
        pairs = set(survivors.folded_pairs())
        # the folded pairs meet in the first round and the last (survivors that were not
        # folded may start their power-of-two rounds early)
        for index, deliveries in enumerate(report.rounds):
            for d in deliveries:
                if (d.src, d.dst) in pairs:
                    assert index == 0
                if (d.dst, d.src) in pairs:
                    assert index == len(report.rounds) - 1
        assert pairs <= {(d.src, d.dst) for d in report.rounds[0]}
        assert {(odd, even) for even, odd in pairs} == {(d.src, d.dst) for d in report.rounds[-1]}
        # the ranks that step aside talk only to their partner, in two steps
        for even, odd in pairs:
            assert len(schedule.steps[even]) == 2
            assert {t.peer for step in schedule.steps[even] for t in step} == {odd}


def test_reduce_scatter_fold_out_adds_the_even_ranks_own_contribution():
    p = 6
    report = check(hd.reduce_scatter_halving(p))
    for delivery in report.rounds[-1]:
        assert delivery.reduce and delivery.dst_chunk == delivery.dst
        # everyone's contribution to the block except the receiver's own
        assert {rank for rank, _ in delivery.contents} == set(range(p)) - {delivery.dst}


def test_one_rank_has_no_steps():
    for emit in hd.SCHEDULES.values():
        for nsegments in SEGMENTS:
            schedule = emit(1, nsegments)
            assert schedule.steps == ((),)
            check(schedule)


@pytest.mark.parametrize("p", [3, 5, 6, 7, 12, 24, 31])
def test_non_power_of_two_halving_rounds_are_uneven_as_documented(p):
    nsegments = 2
    survivors = hd.Survivors(p)
    schedule = hd.reduce_scatter_halving(p, nsegments)
    lg, extra = log2_floor(p), survivors.extra
    busiest = [0] * lg
    for v in range(survivors.power_of_two):
        steps = schedule.steps[survivors.rank(v)]
        halving = steps[1:1 + lg] if v < extra else steps[:lg]
        for k, step in enumerate(halving):
            busiest[k] = max(busiest[k], sum(isinstance(t, Send) for t in step))
    # the round with distance d moves at most d + min(d, rem) blocks on one link
    distances = [survivors.power_of_two >> (k + 1) for k in range(lg)]
    assert busiest == [(d + min(d, extra)) * nsegments for d in distances]
