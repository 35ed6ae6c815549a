"""The executor's compiled programs: deferred seeds and fused first reductions."""

from __future__ import annotations

from pycoll import algorithms
from pycoll.execute import compile_program
from pycoll.schedule import Collective, Layout


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


def test_ring_allreduce_copies_only_the_chunk_it_sends_first():
    compiled = program("ring", Collective.ALLREDUCE, 4, rank=0)
    # Rank 0 sends one block raw in round 0; the other three are first reduced into, fused.
    assert len(compiled.seeds) == 1
    fused = [r for receives, _ in compiled.steps for r in receives if r.fused is not None]
    assert len(fused) == 3


def test_a_one_rank_world_still_copies_its_result():
    compiled = program("ring", Collective.ALLREDUCE, 1, rank=0)
    assert compiled.steps == () and len(compiled.seeds) == 1


def test_zero_length_chunks_drop_out_on_both_sides():
    compiled = program("ring", Collective.ALLREDUCE, 4, rank=2, count=2)
    sizes = [r.stop - r.start for receives, _ in compiled.steps for r in receives]
    sizes += [t.stop - t.start for _, transmits in compiled.steps for t in transmits]
    assert sizes and all(size > 0 for size in sizes)
