"""The executor's compiled programs: deferred seeds and fused first reductions."""

from __future__ import annotations

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pycoll import algorithms, execute
from pycoll.execute import compile_program
from pycoll.schedule import Collective, Layout, Recv, Schedule, Send, result_chunks


def program(family, collective, nranks, rank, count=12, root=None):
    schedule = algorithms.build(family, collective, nranks, 1, root)
    layout = Layout.even(count, schedule.nblocks, 1)
    return compile_program(schedule, rank, layout, layout)


def test_one_shot_allreduce_fuses_the_seed_into_the_first_reduction():
    compiled = program("direct", Collective.ALLREDUCE, 3, rank=1)
    assert compiled.seeds == ()  # no copy of the input before the exchange
    (receives, transmits), = compiled.steps
    assert [r.fused for r in receives] == [(0, 12), None]  # the second adds onto the first
    assert all(t.from_input for t in transmits)


def test_ring_allreduce_copies_nothing_of_its_input():
    compiled = program("ring", Collective.ALLREDUCE, 4, rank=0)
    # Rank 0 sends one block raw in round 0, straight from INPUT (the block is overwritten
    # later, so never copied); the other three are first reduced into, fused.
    assert compiled.seeds == ()
    (_, (first,)), *_ = compiled.steps
    assert first.from_input
    fused = [r for receives, _ in compiled.steps for r in receives if r.fused is not None]
    assert len(fused) == 3


def test_a_message_of_unseeded_chunks_goes_from_input_whole():
    # Halving-doubling's first step sends half the array, several chunks in one message.
    compiled = program("halving_doubling", Collective.ALLREDUCE, 4, rank=0, count=40)
    (_, transmits), *_ = compiled.steps
    assert [(t.from_input, t.stop - t.start) for t in transmits] == [(True, 20)]
    assert compiled.seeds == ()


def test_a_one_rank_world_still_copies_its_result():
    compiled = program("ring", Collective.ALLREDUCE, 1, rank=0)
    assert compiled.steps == () and len(compiled.seeds) == 1


def test_a_direct_reduce_scatter_copies_nothing_of_its_input():
    # Rank 1's other blocks go out straight from INPUT and its own block is first reduced
    # into (fused): nothing of INPUT is copied into WORK.
    assert program("direct", Collective.REDUCE_SCATTER, 3, rank=1).seeds == ()


@pytest.mark.parametrize("collective", [Collective.REDUCE_SCATTER, Collective.REDUCE,
                                        Collective.ALLREDUCE, Collective.BROADCAST,
                                        Collective.ALLGATHER, Collective.ALLTOALL])
def test_a_seed_is_either_sent_from_work_or_part_of_the_result(collective):
    # Copies no step reads and no result holds would be memory traffic for nothing.
    for family in algorithms.families_for(collective):
        for nranks in (1, 2, 3, 5):
            schedule = algorithms.build(family, collective, nranks, 1, 0)
            layout = Layout.even(24, schedule.nblocks, 1)
            for rank in range(nranks):
                compiled = compile_program(schedule, rank, layout, layout)
                result = [layout.chunk_range(c) for c in result_chunks(schedule, rank)]
                sent = [(t.start, t.stop) for _, transmits in compiled.steps for t in transmits
                        if not t.from_input]
                for *_, start, stop in compiled.seeds:
                    inside = any(a <= start and stop <= b for a, b in result + sent)
                    assert inside, (family, nranks, rank, (start, stop))


def test_zero_length_chunks_drop_out_on_both_sides():
    compiled = program("ring", Collective.ALLREDUCE, 4, rank=2, count=2)
    sizes = [r.stop - r.start for receives, _ in compiled.steps for r in receives]
    sizes += [t.stop - t.start for _, transmits in compiled.steps for t in transmits]
    assert sizes and all(size > 0 for size in sizes)


def _messages(family, collective, nranks, nsegments, count, root=None):
    """(src, dst) -> sizes of the messages src posts to dst, and those dst posts from src."""
    from pycoll import model

    schedule = algorithms.build(family, collective, nranks, nsegments, root)
    sent, received = {}, {}
    for rank, program in enumerate(model.programs(schedule, count)):
        for receives, transmits in program.steps:
            for t in transmits:
                sent.setdefault((rank, t.peer), []).append(t.stop - t.start)
            for r in receives:
                received.setdefault((r.peer, rank), []).append(r.stop - r.start)
    return sent, received


def test_consecutive_chunks_to_one_peer_travel_as_one_message():
    """Recursive halving sends half its blocks to one partner per round: one message each."""
    sent, received = _messages("halving_doubling", Collective.REDUCE_SCATTER, 8, 1, 8 * 10)
    assert sent == received
    assert sent[(0, 4)] == [40] and sent[(0, 2)] == [20] and sent[(0, 1)] == [10]


@pytest.mark.parametrize("family", ["ring", "tree", "halving_doubling", "direct"])
@pytest.mark.parametrize("nranks", [1, 2, 3, 5, 6, 8])
def test_both_ends_agree_on_every_message(family, nranks):
    for collective in algorithms.FAMILIES[family].SCHEDULES:
        if collective is Collective.SENDRECV:
            continue
        rooted = collective in (Collective.BROADCAST, Collective.REDUCE)
        for nsegments in (1, 3):
            for count in (0, 1, nranks + 1, 97):
                sent, received = _messages(
                    family, collective, nranks, nsegments, count, nranks - 1 if rooted else None
                )
                assert sent == received, (family, collective, nranks, nsegments, count)


def test_the_ring_forwards_each_chunk_it_receives_to_the_step_that_sends_it():
    compiled = program("ring", Collective.ALLREDUCE, 4, rank=1)
    # 3 ReduceScatter steps, each reducing the chunk the next step sends (the third's goes
    # out in AllGather's first step), then 3 AllGather steps, each copying the chunk the next
    # sends on, but the last
    assert compiled.forwards == (((0, 0),),) * 5 + ((),)
    for (receives, _), (_, following) in zip(compiled.steps, compiled.steps[1:]):
        assert (receives[0].start, receives[0].stop) == (following[0].start, following[0].stop)
    assert [r.scratch >= 0 for receives, _ in compiled.steps for r in receives] == [
        True] * 3 + [False] * 3  # reductions, then copies
    assert compiled.posts_ahead


@pytest.mark.parametrize("family,collective,expected", [
    ("ring", Collective.ALLREDUCE, True),
    ("ring", Collective.REDUCE_SCATTER, True),
    ("tree", Collective.REDUCE, True),
    ("ring", Collective.ALLGATHER, True),  # receive-copy-send
    ("tree", Collective.BROADCAST, True),
    ("direct", Collective.ALLREDUCE, False),  # one step: nothing follows a reduction
    ("two_shot", Collective.ALLREDUCE, False),  # pieces folded after all arrive, then sent
    ("direct", Collective.ALLGATHER, False),
])
def test_every_rank_reads_whether_to_post_ahead_from_the_whole_schedule(family, collective,
                                                                        expected):
    schedule = algorithms.build(family, collective, 5, 1, 0)
    assert schedule.receives_then_sends is expected
    layout = Layout.even(20, schedule.nblocks, 1)
    assert {compile_program(schedule, r, layout, layout).posts_ahead for r in range(5)} == {
        expected}


def _two_ranks(steps_of_0, steps_of_1):
    return Schedule(Collective.ALLREDUCE, "test", 2, 2, 1, (steps_of_0, steps_of_1))


def test_no_forward_across_a_step_left_empty_or_to_a_peer_with_two_messages():
    layout = Layout.even(8, 2, 1)
    # rank 0 reduces chunk 0 in step 0 and sends it in step 2: its peer posts one step ahead
    # only, so the send is not made early
    gap = _two_ranks(((Recv(1, 0, True),), (), (Send(1, 0),)),
                     ((Send(0, 0),), (), (Recv(0, 0, False),)))
    assert compile_program(gap, 0, layout, layout).forwards == ((), ())
    # the next step sends two messages to that peer: the forwarded one would overtake
    two = _two_ranks(((Recv(1, 0, True),), (Send(1, 1), Send(1, 0))),
                     ((Send(0, 0),), (Recv(0, 1, False), Recv(0, 0, False))))
    assert compile_program(two, 0, layout, layout).forwards == ((), ())
    one = _two_ranks(((Recv(1, 0, True),), (Send(1, 0),)),
                     ((Send(0, 0),), (Recv(0, 0, False),)))
    assert compile_program(one, 0, layout, layout).forwards == (((0, 0),), ())


@pytest.mark.parametrize("collective", [Collective.ALLREDUCE, Collective.REDUCE_SCATTER,
                                        Collective.REDUCE, Collective.ALLGATHER,
                                        Collective.BROADCAST])
def test_a_rank_forwards_only_where_every_rank_posts_ahead(collective):
    """Posting ahead is read from the schedule, forwarding from one rank's program with its
    sizes: wherever some rank forwards, the schedule must say so, or its peer would not have
    posted the credit the forward waits for."""
    from pycoll import model

    checked = 0
    for family in algorithms.families_for(collective):
        for nranks in range(1, 10):
            for nsegments in (1, 2, 3):
                schedule = algorithms.build(family, collective, nranks, nsegments, nranks - 1)
                for count in (0, 1, nranks - 1, 2 * nranks + 1, 97):
                    programs = model.programs(schedule, count)
                    if any(any(p.forwards) for p in programs):
                        assert schedule.receives_then_sends, (family, nranks, nsegments, count)
                        checked += 1
    assert checked > 100


@pytest.mark.parametrize("collective", [Collective.ALLREDUCE, Collective.REDUCE_SCATTER,
                                        Collective.REDUCE, Collective.ALLGATHER,
                                        Collective.BROADCAST])
def test_whether_any_rank_forwards_is_read_from_work_sizes_alone(collective):
    """Every rank decides from WORK's layout (which all ranks know) whether some rank
    forwards; INPUT's layout (a rank's own block in AllGather, uneven here) never changes a
    program's forwards, so the answer is each rank's real one."""
    from pycoll.execute import some_rank_forwards

    for family in algorithms.families_for(collective):
        for nranks in (1, 2, 3, 5, 8):
            for nsegments in (1, 3):
                schedule = algorithms.build(family, collective, nranks, nsegments, 0)
                for blocks in ([3] * schedule.nblocks,
                               [(7 * b) % 5 for b in range(schedule.nblocks)]):
                    work = Layout(blocks, nsegments)
                    real = [compile_program(schedule, r, Layout([blocks[r % len(blocks)]],
                                                                nsegments)
                                            if collective is Collective.ALLGATHER else work,
                                            work)
                            for r in range(nranks)]
                    alone = [compile_program(schedule, r, work, work) for r in range(nranks)]
                    assert [p.forwards for p in real] == [p.forwards for p in alone]
                    assert some_rank_forwards(schedule, work) == any(
                        any(p.forwards) for p in real)


def test_halving_doubling_allgather_posts_nothing_ahead_as_it_never_forwards():
    """Its received message (the blocks gathered so far) is never what it sends next (twice
    that): posting ahead would only hold a second step of inbox."""
    from pycoll.execute import some_rank_forwards

    schedule = algorithms.build("halving_doubling", Collective.ALLGATHER, 8, 1, None)
    assert schedule.receives_then_sends  # chunk by chunk, it could
    assert not some_rank_forwards(schedule, Layout.even(8 * 1000, 8, 1))
    ring = algorithms.build("ring", Collective.ALLGATHER, 8, 1, None)
    assert some_rank_forwards(ring, Layout.even(8 * 1000, 8, 1))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 5)), max_size=10))
def test_the_overlap_test_agrees_with_testing_every_pair(spans):
    """Forwarding needs a receive alone on its range; testing each against every other took
    seconds to compile a 64-rank tree AllGather (its root receives from every rank at once)."""
    ranges = [types.SimpleNamespace(start=a, stop=a + n) for a, n in spans]
    shares_range = execute._overlap_test(ranges)
    for i, r in enumerate(ranges):
        assert shares_range(i) == any(k != i and o.start < r.stop and r.start < o.stop
                                      for k, o in enumerate(ranges))


def test_the_host_spaces_overlap_test_is_exact_where_it_skips_numpys():
    """A call that runs in place copies INPUT first where its schedule reads INPUT late; the
    test skips numpy's (0.5 us of a 4 us call) for two arrays that each own their memory."""
    import numpy as np

    from pycoll.spaces import HOST

    x, y = np.arange(8.0), np.arange(8.0)
    grid = np.arange(16.0).reshape(4, 4)
    pairs = [(x, y, False), (x, x, True), (x, x[3:], True), (x[:4], x[4:], False),
             (x, grid.reshape(-1), False), (grid, grid[1], True), (grid.reshape(-1), grid, True),
             (x[::2], x[1::2], False), (np.empty(0), np.empty(0), False)]
    for a, b, shared in pairs:
        assert HOST.shares_memory(a, b) is shared and HOST.shares_memory(b, a) is shared
        assert HOST.shares_memory(a, b) == np.shares_memory(a, b)
