"""Determinism, as docs/reliability.md states it: for a fixed algorithm and rank count the
bits are the same on every repeat and on every rank; at 2 ranks every family gives the same
bits (a + b = b + a exactly); direct, two_shot and the shared-memory one-shot all add in rank
order, ((x0 + x1) + x2) + ..., so they give the same bits as each other at any rank count."""

from __future__ import annotations

import numpy as np
import pytest

import pycoll
from pycoll import oracle, select
from pycoll.algorithms import families_for
from pycoll.kernels import ReduceOp, reducer
from pycoll.schedule import Collective


def inputs(nranks: int) -> list[np.ndarray]:
    rng = np.random.default_rng(nranks)
    scale = 10.0 ** rng.integers(-3, 4, size=(nranks, 1001))
    return [(rng.standard_normal(1001) * scale[r]).astype(np.float32) for r in range(nranks)]


@pytest.mark.parametrize("transport", ["auto", "shm"])
@pytest.mark.parametrize("nranks", [2, 3, 5])
@pytest.mark.parametrize("algorithm", families_for(Collective.ALLREDUCE) + ["auto"])
def test_allreduce_bits(monkeypatch, transport, nranks, algorithm):
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", transport)
    xs = inputs(nranks)

    def once():
        return pycoll.run_local(
            nranks, lambda: pycoll.allreduce(xs[pycoll.world().rank], algorithm=algorithm))

    first, second = once(), once()
    assert [a.tobytes() for a in first] == [b.tobytes() for b in second]  # repeatable
    assert len({a.tobytes() for a in first}) == 1  # the same on every rank


def in_rank_order(xs: list[np.ndarray]) -> np.ndarray:
    total = xs[0].copy()
    for x in xs[1:]:
        total += x
    return total


@pytest.mark.parametrize("transport", ["auto", "shm"])
@pytest.mark.parametrize("nranks", [3, 4, 5])
# auto: the small size only (shared memory's one-shot, or the family auto picks); the longer
# size goes in pieces over shared memory
@pytest.mark.parametrize(("algorithm", "size"), [("direct", 1001), ("two_shot", 1001),
                                                 ("auto", 1001), ("direct", 700_001),
                                                 ("two_shot", 700_001)])
def test_rank_order_families_give_the_rank_order_sum(monkeypatch, transport, nranks, algorithm,
                                                       size):
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", transport)
    rng = np.random.default_rng(size + nranks)
    xs = [(rng.standard_normal(size) * 10.0 ** rng.integers(-3, 4, size)).astype(np.float32)
          for _ in range(nranks)]
    results = pycoll.run_local(
        nranks, lambda: pycoll.allreduce(xs[pycoll.world().rank], algorithm=algorithm))
    expected = in_rank_order(xs).tobytes()
    assert all(r.tobytes() == expected for r in results)


@pytest.mark.parametrize("nranks", [5, 6, 8])
@pytest.mark.parametrize("algorithm", ["direct", "two_shot"])
@pytest.mark.parametrize("size", [1001, 70_001])
def test_rank_order_holds_across_simulated_nodes(monkeypatch, nranks, algorithm, size):
    """Nodes of 2 (3+ of them): a step's reductions arrive through shared memory (this
    node) and messages (the others), yet run in rank order, as listed."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    monkeypatch.setenv("PYCOLL_RANKS_PER_NODE", "2")
    rng = np.random.default_rng(size + nranks)
    xs = [(rng.standard_normal(size) * 10.0 ** rng.integers(-3, 4, size)).astype(np.float32)
          for _ in range(nranks)]
    results = pycoll.run_local(
        nranks, lambda: pycoll.allreduce(xs[pycoll.world().rank], algorithm=algorithm))
    expected = in_rank_order(xs).tobytes()
    assert all(r.tobytes() == expected for r in results)


@pytest.mark.parametrize("nranks", [3, 4])
@pytest.mark.parametrize("segments", [1, 3])
def test_direct_in_place_and_segmented_keep_rank_order(monkeypatch, nranks, segments):
    monkeypatch.setattr(select, "FORCED_SEGMENTS", segments)
    xs = inputs(nranks)

    def in_place():
        x = xs[pycoll.world().rank].copy()
        return pycoll.allreduce(x, out=x, algorithm="direct")

    expected = in_rank_order(xs).tobytes()
    assert all(r.tobytes() == expected for r in pycoll.run_local(nranks, in_place))


def test_at_two_ranks_every_family_gives_the_same_bits():
    xs = inputs(2)
    bits = {
        algorithm: pycoll.run_local(
            2, lambda a=algorithm: pycoll.allreduce(xs[pycoll.world().rank], algorithm=a)
        )[0].tobytes()
        for algorithm in families_for(Collective.ALLREDUCE)
    }
    assert len(set(bits.values())) == 1


@pytest.mark.parametrize("transport", ["auto", "mpi"])
def test_rank_order_holds_at_two_ranks_for_complex_prod(monkeypatch, transport):
    """Complex prod, whose operands numpy's multiply does not commute bitwise: at 2 ranks a
    rank's block receives from one peer only, and rank 1 put its own array first (x1 * x0)
    instead of in rank order, so direct and two_shot differed from the one-shot."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", transport)
    rng = np.random.default_rng(7)
    size = 20_000  # past shared memory's one-shot, whose slots are combined in rank order
    xs = [(rng.standard_normal(size) + 1j * rng.standard_normal(size)).astype(np.complex64)
          for _ in range(2)]
    want = xs[0] * xs[1]
    if not (xs[1] * xs[0] != want).any():  # the case this checks
        pytest.skip("this numpy multiplies complex64 alike in either order (numpy 1.x)")

    def body():
        rank = pycoll.world().rank
        scattered = pycoll.reduce_scatter(xs[rank], "prod", algorithm="direct")
        return scattered, [pycoll.allreduce(xs[rank], "prod", algorithm=algorithm)
                           for algorithm in ("direct", "two_shot")]

    for rank, (scattered, reduced) in enumerate(pycoll.run_local(2, body)):
        half = size // 2
        assert scattered.tobytes() == want[rank * half:(rank + 1) * half].tobytes(), rank
        assert [r.tobytes() for r in reduced] == [want.tobytes()] * 2, rank


@pytest.mark.parametrize("nranks", [3, 4, 5])
@pytest.mark.parametrize(("algorithm", "size"), [("direct", 1), ("two_shot", 3),
                                                 ("two_shot", 6), ("auto", 1)])
def test_complex_prod_in_blocks_of_one_element_keeps_rank_order(nranks, algorithm, size):
    """numpy multiplies one complex element written over an operand in a loop of its own
    (without the fused multiply-add of longer arrays): a block of one element came out
    unlike the rank-order product, and ranks reducing it alike but for aliasing disagreed."""
    rng = np.random.default_rng(nranks * 10 + size)
    for trial in range(8):
        xs = [(rng.standard_normal(size) + 1j * rng.standard_normal(size)).astype(np.complex64)
              for _ in range(nranks)]
        want = oracle.allreduce(xs, "prod").tobytes()
        results = pycoll.run_local(nranks, lambda xs=xs: pycoll.allreduce(
            xs[pycoll.world().rank], "prod", algorithm=algorithm))
        assert [r.tobytes() for r in results] == [want] * nranks, trial


def test_complex_product_of_one_element_is_the_product_in_a_longer_array():
    rng = np.random.default_rng(3)
    for dtype in (np.complex64, np.complex128):
        multiply = reducer(ReduceOp.PROD, np.dtype(dtype))
        a, b = (rng.standard_normal((2, 500)) + 1j * rng.standard_normal((2, 500))).astype(dtype)
        want = a * b
        for i in range(a.size):
            into, alone = a[i:i + 1].copy(), b[i:i + 1].copy()
            multiply(into, alone)
            other = b[i:i + 1].copy()
            multiply(other, other.copy(), a[i:i + 1])
            assert into.tobytes() == other.tobytes() == want[i:i + 1].tobytes(), (dtype, i)


@pytest.mark.parametrize("nranks", [2, 3])
@pytest.mark.parametrize("op", ["min", "max"])
def test_rank_order_families_keep_the_sign_of_a_zero_min_or_max(nranks, op):
    """+0 and -0 compare equal and numpy's minimum and maximum return the second operand:
    the families that keep rank order give the oracle's zero; ring, tree and halving-doubling
    may give the other (docs/reliability.md)."""
    zeros = np.array([-0.0, 0.0, 0.0, -0.0, -0.0, 0.0], np.float32)
    xs = [np.roll(zeros, r) for r in range(nranks)]
    want = oracle.allreduce(xs, op).tobytes()
    for algorithm in ("direct", "two_shot", "auto"):
        results = pycoll.run_local(nranks, lambda a=algorithm: pycoll.allreduce(
            xs[pycoll.world().rank], op, algorithm=a))
        assert [r.tobytes() for r in results] == [want] * nranks, algorithm
