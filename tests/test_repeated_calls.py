"""A call repeated with the arguments of an earlier valid one skips the checks that passed
then (pycoll/api.py ``_known``): its results must still match the oracle every time, and any
argument that differs must still get the same clear error as on a first call."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from conftest import exact_input

import pycoll
from pycoll import oracle, select

DTYPES = [np.dtype(np.int32), np.dtype(np.float64), np.dtype(np.uint8)]


def _calls(nranks: int) -> list[tuple]:
    """(collective, op, dtype, rows per rank, algorithm, how out is given)."""
    calls = []
    for i, (name, op, rows) in enumerate([
        ("allreduce", "avg", 7), ("reduce_scatter", "avg", 3 * nranks), ("allgather", None, 5),
        ("broadcast", None, 6), ("reduce", "avg", 4), ("allreduce", "max", 0),
        ("reduce_scatter", "prod", nranks), ("allgather", None, 1), ("reduce", "min", 1),
        ("allreduce", "sum", 1), ("alltoall", None, 2 * nranks), ("alltoall", None, 0),
        # past shared memory's one-shot sizes: its schedules
        ("allreduce", "sum", 5000), ("reduce_scatter", "sum", 8200 * nranks),
        ("allgather", None, 8200), ("broadcast", None, 8200), ("reduce", "max", 8200),
    ]):
        dtype = DTYPES[i % len(DTYPES)]
        for algorithm in ("auto", "ring"):
            for out in ("new", "given", "in place"):
                if out == "in place" and name == "broadcast":  # always in place
                    continue
                calls.append((name, op, dtype, rows, algorithm, out))
    return calls


def _one(name, op, dtype, rows, algorithm, out, nranks, rank, seed):
    x = exact_input(rank, (rows, 2), dtype, op, seed)
    inputs = [exact_input(r, rows * 2, dtype, op, seed) for r in range(nranks)]  # the oracle's
    root = nranks - 1
    if name == "allreduce":
        given = {"new": None, "given": np.empty_like(x), "in place": x}[out]
        got = pycoll.allreduce(x, op, out=given, algorithm=algorithm)
        return got, oracle.allreduce(inputs, op).reshape(rows, 2), given is None or got is given
    if name == "reduce_scatter":
        shard = rows // nranks
        given = {"new": None, "given": np.empty((shard, 2), dtype),
                 "in place": x[rank * shard:(rank + 1) * shard]}[out]  # NCCL's in place
        got = pycoll.reduce_scatter(x, op, out=given, algorithm=algorithm)
        piece = oracle.reduce_scatter(inputs, op)[rank].reshape(-1, 2)
        return got, piece, given is None or got is given
    if name == "allgather":
        given = None if out == "new" else np.empty((rows * nranks, 2), dtype)
        if out == "in place":  # NCCL's: x is this rank's rows of out
            x = given[rank * rows:(rank + 1) * rows]
            x[...] = exact_input(rank, (rows, 2), dtype, op, seed)
        got = pycoll.allgather(x, out=given, algorithm=algorithm)
        return got, oracle.allgather(inputs).reshape(-1, 2), given is None or got is given
    if name == "alltoall":
        given = {"new": None, "given": np.empty_like(x), "in place": x}[out]
        got = pycoll.alltoall(x, out=given)
        return got, oracle.alltoall(inputs)[rank].reshape(rows, 2), given is None or got is given
    if name == "broadcast":
        got = pycoll.broadcast(x, root, algorithm=algorithm)
        return got, inputs[root].reshape(rows, 2), got is x
    given = {"new": None, "given": np.empty_like(x), "in place": x}[out]
    got = pycoll.reduce(x, op, root, out=given, algorithm=algorithm)
    if rank != root:
        return got, None, True
    return got, oracle.reduce(inputs, op, root).reshape(rows, 2), given is None or got is given


@pytest.fixture(params=["auto", "shm"])
def transport(request, monkeypatch):
    """The threads' rendezvous transport, and shared memory (whose small calls go through
    its slots in one shot, and are remembered as such)."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", request.param)


@pytest.mark.parametrize("nranks", [1, 2, 3, 5])
def test_repeated_calls_match_the_oracle_every_time(nranks, transport):
    calls = _calls(nranks)

    def body():
        rank, wrong = pycoll.world().rank, []
        for seed in range(3):  # the same shapes again with new values: remembered calls
            for call in calls:
                got, expected, right_array = _one(*call, nranks, rank, seed)
                if expected is None:
                    ok = got is None
                else:
                    ok = (right_array and got.dtype == expected.dtype
                          and got.shape == expected.shape and np.array_equal(got, expected))
                if not ok:
                    wrong.append((seed, call))
        return wrong

    assert pycoll.run_local(nranks, body) == [[]] * nranks


def _error_of(fn):
    try:
        fn()
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_a_repeated_call_with_one_bad_argument_gets_the_first_calls_error(transport):
    def body():
        x = np.arange(8, dtype=np.float32)
        grid = np.arange(16, dtype=np.float32).reshape(8, 2)
        wide = np.arange(16, dtype=np.float32)
        frozen = x.copy()
        frozen.flags.writeable = False
        good = [
            lambda: pycoll.allreduce(x, out=np.empty_like(x)),
            lambda: pycoll.reduce_scatter(x, out=np.empty(4, np.float32)),
            lambda: pycoll.allgather(x, out=np.empty(16, np.float32)),
            lambda: pycoll.broadcast(x.copy(), 1),
            lambda: pycoll.reduce(x, root=1, out=np.empty_like(x)),
            lambda: pycoll.alltoall(x, out=np.empty_like(x)),
        ]
        for call in good * 2:  # remembered after the first round
            call()
        bad = {
            "strided x": lambda: pycoll.allreduce(grid[:, 0]),
            "strided x (reduce_scatter)": lambda: pycoll.reduce_scatter(grid[:, 0]),
            "strided x (allgather)": lambda: pycoll.allgather(grid[:, 0]),
            "strided x (alltoall)": lambda: pycoll.alltoall(grid[:, 0]),
            "out dtype": lambda: pycoll.allreduce(x, out=np.empty(8, np.float64)),
            "out shape": lambda: pycoll.reduce_scatter(x, out=np.empty(5, np.float32)),
            "out shape (alltoall)": lambda: pycoll.alltoall(x, out=np.empty(5, np.float32)),
            "out holds x": lambda: pycoll.allgather(wide[4:12], out=wide),  # no rank's rows
            "out partly x": lambda: pycoll.allreduce(wide[:8], out=wide[4:12]),
            "read-only out": lambda: pycoll.allreduce(x, out=frozen),
            # off the root, by each rank's own root (the root's x is only read)
            "read-only x": lambda: pycoll.broadcast(frozen, 1 - pycoll.world().rank),
            "root True": lambda: pycoll.broadcast(x.copy(), True),
            "root True (reduce)": lambda: pycoll.reduce(x, root=True),
            "op list": lambda: pycoll.allreduce(x, [1]),
            "algorithm list": lambda: pycoll.allreduce(x, algorithm=["ring"]),
        }
        return {name: _error_of(call) for name, call in bad.items()}

    first = pycoll.run_local(2, lambda: {name: error for name, error in body().items()})
    for rank_errors in first:
        for name, error in rank_errors.items():
            assert error != "no error", name
    expected = {
        "strided x": "not C-contiguous",
        "strided x (reduce_scatter)": "not C-contiguous",
        "strided x (allgather)": "not C-contiguous",
        "strided x (alltoall)": "not C-contiguous",
        "out shape (alltoall)": "out.shape=(5,)",
        "out dtype": "out.dtype=float64",
        "out shape": "out.shape=(5,)",
        "out holds x": "out overlaps x; allowed: separate arrays",
        "out partly x": "out overlaps x; pass out=x exactly",
        "read-only out": "out is read-only",
        "read-only x": "x is read-only",
        "root True": "root=True is not a rank",
        "root True (reduce)": "root=True is not a rank",
        "op list": "[1]",
        "algorithm list": "algorithm=['ring'] is not a name",
    }
    for name, text in expected.items():
        assert text in first[0][name], (name, first[0][name])
    for rank, errors in enumerate(first):  # where each rank's own rows would be
        assert errors.pop("out holds x").endswith(f"x = out[{8 * rank}:{8 * rank + 8}], in place)")
    assert first[0] == first[1]


def test_a_disagreement_after_remembered_calls_is_still_named(monkeypatch):
    monkeypatch.setenv("PYCOLL_CHECK", "1")

    def body():
        rank = pycoll.world().rank
        x = np.arange(6, dtype=np.int64)
        for _ in range(2):
            pycoll.allreduce(x)
        try:
            pycoll.allreduce(x, "max" if rank == 1 else "sum")  # rank 0 repeats a known call
        except pycoll.CollectiveMismatch as error:
            return str(error)
        return "no error"

    errors = pycoll.run_local(3, body)
    assert all("op" in e and "max" in e for e in errors), errors


def test_a_forced_segment_count_reaches_a_remembered_call(monkeypatch, caplog):
    monkeypatch.setattr(select, "DEBUG", True)
    monkeypatch.setattr(select, "FORCED_SEGMENTS", None)  # restored after the test
    x = np.arange(4000, dtype=np.float32)

    def body():
        first = [pycoll.allreduce(x, algorithm="ring") for _ in range(2)]  # remembered
        pycoll.barrier()
        if pycoll.world().rank == 0:
            select.FORCED_SEGMENTS = 3
        pycoll.barrier()
        return [*first, pycoll.allreduce(x, algorithm="ring")]

    with caplog.at_level(logging.WARNING, logger=select.log.name):
        results = pycoll.run_local(2, body)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("ring x1 segments" in line for line in lines) == 4, lines
    assert sum("ring x3 segments" in line for line in lines) == 2, lines
    assert all(np.array_equal(r, 2 * x) for rank in results for r in rank)


def test_a_kept_call_holds_its_own_scratch_only_when_small():
    """A repeated host call keeps how it runs after its first (api._player): small calls
    their own scratch too, larger ones borrow the communicator's buffer on each call, so that
    a sweep of sizes holds at most PREPARED_CALLS small scratches. Both stay right over new
    values, interleaved, the large one's borrowed buffer reused by another call between."""
    from pycoll.api import KEPT_SCRATCH_BYTES, PreparedCall

    small_rows, large_rows = 5, KEPT_SCRATCH_BYTES // 4  # float64 pairs: x of 4 x the bytes

    def body():
        comm, rank, wrong = pycoll.world(), pycoll.world().rank, []
        for seed in range(3):
            for rows, algorithm in ((small_rows, "ring"), (large_rows, "ring"),
                                    (large_rows, "tree"), (small_rows, "tree")):
                x = exact_input(rank, (rows, 2), np.dtype(np.float64), "sum", seed)
                inputs = [exact_input(r, rows * 2, np.dtype(np.float64), "sum", seed)
                          for r in range(2)]
                got = pycoll.allreduce(x, algorithm=algorithm)
                wrong += [] if np.array_equal(got.reshape(-1), oracle.allreduce(inputs, "sum")) \
                    else [(seed, rows, algorithm)]
        kept = {call.program.scratch_elements * 8: call.kept for call in comm.prepared.values()
                if isinstance(call, PreparedCall) and call.program.scratch_elements}
        return wrong, {nbytes: (play is not None, scratch is not None)
                       for nbytes, (play, scratch, _) in kept.items()}

    for wrong, kept in pycoll.run_local(2, body):
        assert wrong == []
        assert kept and all(play for play, _ in kept.values())
        assert all(own == (nbytes <= KEPT_SCRATCH_BYTES) for nbytes, (_, own) in kept.items())
        assert any(not own for _, own in kept.values()) and any(own for _, own in kept.values())
