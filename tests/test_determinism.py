"""Determinism, as docs/reliability.md states it: for a fixed algorithm and rank count the
bits are the same on every repeat; on every rank too, except the direct (one-shot schedule)
AllReduce at 3 ranks or more, where each rank adds in its own order; and at 2 ranks every
family gives the same bits (a + b = b + a exactly)."""

from __future__ import annotations

import numpy as np
import pytest

import pycoll
from pycoll.algorithms import families_for
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
    same_everywhere = len({a.tobytes() for a in first}) == 1
    chosen = algorithm
    if algorithm == "auto":  # the family auto picks, unless shared memory's one-shot serves it
        chosen = pycoll.run_local(nranks, lambda: "one-shot" if pycoll.world().one_shot()
                                  else pycoll.plan("allreduce", xs[0].nbytes).algorithm)[0]
    assert same_everywhere or (chosen == "direct" and nranks >= 3)


def test_at_two_ranks_every_family_gives_the_same_bits():
    xs = inputs(2)
    bits = {
        algorithm: pycoll.run_local(
            2, lambda a=algorithm: pycoll.allreduce(xs[pycoll.world().rank], algorithm=a)
        )[0].tobytes()
        for algorithm in families_for(Collective.ALLREDUCE)
    }
    assert len(set(bits.values())) == 1
