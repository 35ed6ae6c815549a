"""Verification against the oracle as the program runs (PYCOLL_VERIFY=1, comm.verify): right
results pass, whatever order an algorithm combines floats in; a wrong result on any rank
raises the same VerificationError on every rank, naming that rank; no rank is left waiting."""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np
import pytest
from conftest import exact_input
from fake_device import FakeDevice, device_array, host_array

import pycoll
from pycoll import api, oracle, spaces, verify
from pycoll.algorithms import families_for
from pycoll.schedule import Collective

FAMILIES = {c: [f for f in families_for(c) if not f.startswith("hierarchical")]
            for c in (Collective.ALLREDUCE, Collective.REDUCE_SCATTER, Collective.ALLGATHER,
                      Collective.BROADCAST, Collective.REDUCE)}


@pytest.fixture(autouse=True)
def verifying(monkeypatch):
    monkeypatch.setenv("PYCOLL_VERIFY", "1")
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "auto")  # schedules, not the one-shot


@pytest.fixture(params=["auto", "shm"])
def transport(request, monkeypatch):
    """Both host exchanges: the threads' rendezvous transport and the shared-memory slots
    (whose small calls take the one-shot paths)."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", request.param)


def every_collective(rank: int, nranks: int, count: int, dtype, op: str, algorithm: str
                     ) -> list:
    """Each collective once on this rank's exact input (uneven counts where allowed)."""
    dt = np.dtype(dtype)
    flat = exact_input(rank, count * nranks, dt, op)
    counts = [count + (r % 2) for r in range(nranks)]
    mine = exact_input(rank, counts[rank], dt, op, seed=1)
    whole = exact_input(rank, sum(counts), dt, op, seed=2)
    family = {c: algorithm if algorithm in FAMILIES[c] else "auto" for c in FAMILIES}
    return [
        pycoll.allreduce(flat, op, algorithm=family[Collective.ALLREDUCE]),
        pycoll.reduce_scatter(flat, op, algorithm=family[Collective.REDUCE_SCATTER]),
        pycoll.reduce_scatter(whole, op, counts=counts,
                              algorithm=family[Collective.REDUCE_SCATTER]),
        pycoll.allgather(mine, counts=counts, algorithm=family[Collective.ALLGATHER]),
        pycoll.broadcast(flat.copy(), root=nranks - 1, algorithm=family[Collective.BROADCAST]),
        pycoll.reduce(flat, op, root=nranks // 2, algorithm=family[Collective.REDUCE]),
        pycoll.alltoall(flat),
        pycoll.alltoallv(mine, _split(counts[rank], nranks, rank)),
    ]


def _split(total: int, nranks: int, rank: int) -> list[int]:
    """``total`` rows over ``nranks`` destinations, unevenly (some get none)."""
    counts = [0] * nranks
    for i in range(total):
        counts[(i * (rank + 2)) % nranks] += 1
    return counts


@pytest.mark.parametrize("nranks", [1, 2, 3, 5])
@pytest.mark.parametrize("count", [0, 1, 7])
@pytest.mark.parametrize("algorithm", ["auto", "ring", "tree", "halving_doubling", "direct"])
def test_right_results_pass_on_integer_inputs(transport, nranks, count, algorithm):
    done = pycoll.run_local(nranks, lambda: every_collective(
        pycoll.world().rank, nranks, count, np.int32, "sum", algorithm))
    inputs = [exact_input(r, count * nranks, np.dtype(np.int32), "sum") for r in range(nranks)]
    for rank, results in enumerate(done):  # and the results are the collectives' own
        assert np.array_equal(results[0], oracle.allreduce(inputs, "sum"))
        assert np.array_equal(results[6], oracle.alltoall(inputs)[rank])


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.float64,
                                   np.complex64])
@pytest.mark.parametrize("op", ["sum", "avg", "prod"])
@pytest.mark.parametrize("algorithm", ["ring", "tree", "halving_doubling", "direct",
                                       "two_shot"])
def test_floats_combined_in_any_order_pass(dtype, op, algorithm):
    """Random, non-integer floats: each algorithm rounds in its own order, and the rounding
    it may do is allowed (the oracle combines in rank order)."""
    nranks, count = 7, 300

    def body():
        rank = pycoll.world().rank
        rng = np.random.default_rng(rank)
        values = rng.normal(size=count * nranks) * (1 if op != "prod" else 0.5) + (
            1.0 if op == "prod" else 0.0)
        x = values.astype(np.float64)
        if np.dtype(dtype).kind == "c":
            x = x + 1j * rng.normal(size=x.size)
        x = x.astype(dtype)
        collectives = [(pycoll.allreduce, FAMILIES[Collective.ALLREDUCE] + ["two_shot"]),
                       (pycoll.reduce_scatter, FAMILIES[Collective.REDUCE_SCATTER]),
                       (pycoll.reduce, FAMILIES[Collective.REDUCE])]
        for collective, families in collectives:
            if algorithm in families:
                collective(x, op, algorithm=algorithm)
        return True

    assert pycoll.run_local(nranks, body) == [True] * nranks


def after_each_run(monkeypatch, then) -> None:
    """``then(comm, call, x, work)`` after each run of a prepared call (api._execute: the
    schedule's executor, whichever player runs it), before the result is read."""
    real_execute = api._execute

    def execute(comm, call, x, work, *args, **kwargs):
        real_execute(comm, call, x, work, *args, **kwargs)
        then(comm, call, x, work)

    monkeypatch.setattr(api, "_execute", execute)


def corrupt_after_run(monkeypatch, bad_rank: int, first: int | None = None, times: int = 1,
                      dtype=None):
    """The executor's next ``times`` runs on ``bad_rank`` (of ``dtype`` arrays, if given)
    leave WORK wrong in its lowest bit (one ulp of a float, one of an integer), in every
    element or in element ``first``; later runs are left alone."""
    left = {"runs": times}

    def corrupt(comm, call, x, work):
        # the communicator's rank: an async call runs on a worker thread, where
        # pycoll.world() is not the rank's communicator
        if comm.rank == bad_rank and left["runs"] > 0 and dtype in (None, work.dtype):
            left["runs"] -= 1
            flat = work.reshape(-1)
            lowest_bytes = flat.view(np.uint8).reshape(flat.size, flat.itemsize)[:, 0]
            lowest_bytes[slice(None) if first is None else slice(first, first + 1)] ^= 1

    after_each_run(monkeypatch, corrupt)


def errors_on_every_rank(nranks: int, fn) -> list[str]:
    def body():
        try:
            fn(pycoll.world().rank)
        except pycoll.VerificationError as error:
            return str(error)
        return "no error"

    return pycoll.run_local(nranks, body)


def test_one_wrong_element_is_named_on_every_rank(monkeypatch):
    corrupt_after_run(monkeypatch, bad_rank=1, first=3)
    said = errors_on_every_rank(3, lambda rank: pycoll.allreduce(
        np.arange(10, dtype=np.int64) * (rank + 1), algorithm="ring"))
    for rank, text in enumerate(said):
        assert text.startswith("allreduce (op=sum, int64, algorithm='ring', 3 ranks): the "
                               "result differs from the numpy oracle: rank 1: 1 of 10 elements "
                               "differ, the first at index 3"), text
        assert ("here (rank 1): index 3: got 19, expected 18" in text) == (rank == 1), text


@pytest.mark.parametrize("name", ["allreduce", "reduce_scatter", "allgather", "broadcast",
                                  "reduce", "alltoall", "alltoallv"])
def test_a_wrong_result_of_any_collective_raises_everywhere(monkeypatch, name):
    corrupt_after_run(monkeypatch, bad_rank=1, dtype=np.int32)  # not AllToAllv's int64 counts
    calls = {
        "allreduce": lambda x: pycoll.allreduce(x),
        "reduce_scatter": lambda x: pycoll.reduce_scatter(x),
        "allgather": lambda x: pycoll.allgather(x),
        "broadcast": lambda x: pycoll.broadcast(x, root=0),
        "reduce": lambda x: pycoll.reduce(x, root=1),
        "alltoall": lambda x: pycoll.alltoall(x),
        "alltoallv": lambda x: pycoll.alltoallv(x, [1, 2, 3]),
    }
    said = errors_on_every_rank(3, lambda rank: calls[name](
        np.arange(6, dtype=np.int32) + 10 * rank))
    assert all(text.startswith(f"{name} (") and "rank 1: " in text for text in said), said
    assert all("rank 0:" not in text and "rank 2:" not in text for text in said), said


def test_floats_wrong_by_more_than_rounding_allows_are_caught(monkeypatch):
    """One ulp off in a sum of 3 exact values is inside what rounding allows (and passes);
    the same ulp in a copy (AllGather) is not."""
    corrupt_after_run(monkeypatch, bad_rank=2, first=0)
    said = errors_on_every_rank(3, lambda rank: pycoll.allreduce(
        np.full(4, 1.5, np.float32), algorithm="ring"))
    assert said == ["no error"] * 3
    corrupt_after_run(monkeypatch, bad_rank=2, first=0)
    said = errors_on_every_rank(3, lambda rank: pycoll.allgather(
        np.full(4, 1.5, np.float32), algorithm="ring"))
    assert all("rank 2: 1 of 12 elements differ, the first at index 0" in t for t in said), said


def test_a_sum_far_off_is_caught_with_what_rounding_allows(monkeypatch):
    done = []

    def off(comm, call, x, work):
        if comm.rank == 0 and not done:
            done.append(True)
            work.reshape(-1)[1] += 0.25

    after_each_run(monkeypatch, off)
    said = errors_on_every_rank(2, lambda rank: pycoll.allreduce(
        np.array([1.0, 2.0, 3.0], np.float64), algorithm="tree"))
    assert "here (rank 0): index 1: got 4.25, expected 4.0 (rounding allows 1.78e-15)" in (
        said[0]), said[0]


def test_async_calls_are_verified_at_wait(monkeypatch):
    corrupt_after_run(monkeypatch, bad_rank=0, first=0)
    said = errors_on_every_rank(2, lambda rank: pycoll.allreduce(
        np.arange(5), algorithm="ring", async_op=True).wait())
    assert all("rank 0: 1 of 5 elements differ" in t for t in said), said


def test_verification_is_per_communicator_and_checked(monkeypatch):
    monkeypatch.setenv("PYCOLL_VERIFY", "0")
    corrupt_after_run(monkeypatch, bad_rank=1, first=0, times=2)

    def body():
        comm = pycoll.world()
        assert comm.verify is False
        unchecked = pycoll.allreduce(np.arange(3), algorithm="ring")  # wrong on rank 1
        with pytest.raises(TypeError, match=r"verify=1 is invalid; allowed: True or False"):
            comm.verify = 1
        comm.verify = True
        try:
            pycoll.allreduce(np.arange(3), algorithm="ring")
        except pycoll.VerificationError as error:
            return unchecked.tolist(), str(error).split(": the result")[0]
        return unchecked.tolist(), "no error"

    said = "allreduce (op=sum, int64, algorithm='ring', 2 ranks)"
    assert pycoll.run_local(2, body) == [([0, 2, 4], said), ([1, 2, 4], said)]


def test_a_bad_setting_is_named(monkeypatch):
    monkeypatch.setenv("PYCOLL_VERIFY", "yes")
    with pytest.raises(ValueError, match=r"PYCOLL_VERIFY='yes' is invalid; allowed: 0 or 1"):
        pycoll.run_local(1, lambda: None)


def test_bad_arguments_still_get_the_call_s_own_error():
    def body():
        with pytest.raises(ValueError, match="root=5 is not a rank"):
            pycoll.broadcast(np.zeros(3), root=5)
        with pytest.raises(TypeError, match="comm="):
            pycoll.allreduce(np.zeros(3), comm="world")
        return pycoll.allreduce(np.ones(2))

    assert [r.tolist() for r in pycoll.run_local(2, body)] == [[2.0, 2.0]] * 2


def test_device_arrays_are_verified_on_the_host(monkeypatch):
    """On the stand-in device (lazy streams in random order): the snapshot and the result are
    read after the call's stream work, on its stream."""
    fake = FakeDevice(seed=3)
    spaces.register(fake)
    try:
        def body():
            rank = pycoll.world().rank
            x = device_array(np.arange(9, dtype=np.float32) + rank)
            total = pycoll.allreduce(x, algorithm="ring")
            y = device_array(np.arange(9, dtype=np.int16) * (rank + 1))
            pycoll.broadcast(y, root=2)
            fake.synchronize()
            return host_array(total), host_array(y)

        done = pycoll.run_local(3, body)
        inputs = [np.arange(9, dtype=np.float32) + r for r in range(3)]
        for total, y in done:
            assert np.array_equal(total, oracle.allreduce(inputs, "sum"))
            assert np.array_equal(y, np.arange(9, dtype=np.int16) * 3)
    finally:
        spaces.unregister(fake)


def test_off_by_default_and_nothing_checked_then(monkeypatch):
    monkeypatch.delenv("PYCOLL_VERIFY")
    called = []
    monkeypatch.setattr(verify, "_verify", lambda *a: called.append(a))
    monkeypatch.setattr(verify, "active", False)
    pycoll.run_local(2, lambda: pycoll.allreduce(np.ones(3)))
    assert called == [] and verify.active is False
    monkeypatch.setattr(verify, "active", True)  # another communicator verifies; these do not
    assert pycoll.run_local(2, lambda: pycoll.world().verify) == [False, False]
    pycoll.run_local(2, lambda: pycoll.allreduce(np.ones(3)))
    assert called == []


def test_a_blocking_call_after_async_ones_is_verified_too(monkeypatch):
    """The blocking call waits for the async ones queued before it, and is checked itself
    (not mistaken for a call inside the worker's verification)."""
    checked = []
    real_check = verify._check
    monkeypatch.setattr(verify, "_check", lambda name, comm, *rest: (
        checked.append((comm.rank, name)), real_check(name, comm, *rest)))
    real_execute = api._execute
    slow = set()

    def execute(comm, *args, **kwargs):
        if comm.rank not in slow:  # the async call's run: the worker is busy
            slow.add(comm.rank)
            time.sleep(0.2)
        real_execute(comm, *args, **kwargs)

    monkeypatch.setattr(api, "_execute", execute)

    def body():
        queued = pycoll.allreduce(np.arange(4), algorithm="ring", async_op=True)
        time.sleep(0.05)  # the worker is inside the async call now
        pycoll.allgather(np.arange(2), algorithm="ring")
        queued.wait()

    pycoll.run_local(2, body)
    assert sorted(checked) == [(0, "allgather"), (0, "allreduce"), (1, "allgather"),
                               (1, "allreduce")]


def test_the_inputs_reach_the_check_outside_the_schedules(monkeypatch):
    """A bug in the direct AllGather's schedule cannot copy itself into the check's inputs."""
    def off_by_one(comm, call, x, work):
        if call.what == "allgather (direct)" and work.size:
            work.reshape(-1)[0] += 1

    after_each_run(monkeypatch, off_by_one)
    said = errors_on_every_rank(3, lambda rank: pycoll.allgather(
        np.full(2, rank, np.float32), algorithm="direct"))
    assert all("rank 0: 1 of 6 elements differ, the first at index 0" in t for t in said), said


def set_result_after_run(monkeypatch, rank: int, value) -> None:
    """Rank ``rank``'s next run leaves element 0 of its WORK equal to ``value``."""
    left = {"runs": 1}

    def set_first(comm, call, x, work):
        if comm.rank == rank and left["runs"]:
            left["runs"] = 0
            work.reshape(-1)[0] = value

    after_each_run(monkeypatch, set_first)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # overflow, inf * 0: the inputs
@pytest.mark.parametrize("op,dtype,values,wrong,also_right", [
    ("prod", np.float32, [0.0, 2.0, 3.0], 1000, [0.0, -0.0]),  # a zero factor is no underflow
    ("prod", np.float16, [0.03, 0.03, 0.03], 1000, [2.7e-5]),  # underflows gradually
    ("sum", np.float16, [3e4, 3e4, 3e4], 1000, [np.inf]),  # overflows in every order
    ("sum", np.float16, [3e4, 3e4, -3e4], 1000, [3e4]),  # in no order
    ("sum", np.float16, [6e4, 6e4, -6e4], 1000, [6e4, np.inf]),  # in some orders only
    ("prod", np.float16, [300.0, 300.0, 1 / 300], 1000, [300.0, np.inf]),  # likewise
    ("sum", np.float16, [3e4, 3e4, 3e4], -np.inf, []),  # only upwards
    ("sum", np.float16, [6e4, 6e4, -6e4], np.nan, []),  # never down: no inf - inf
    ("sum", np.float32, [np.inf, 1.0, 2.0], 0.0, [np.inf]),  # an infinite input
    ("prod", np.float32, [np.inf, 2.0, 3.0], -7.0, [np.inf]),
    ("prod", np.float32, [np.inf, -2.0, 3.0], np.inf, [-np.inf]),  # the sign holds
    ("prod", np.float32, [np.inf, 0.0, 3.0], np.inf, [np.nan]),  # inf * 0 in every order
    ("prod", np.float64, [1e200, 1e200, 1e-300], 1e150, [1e100]),  # bounds past float64
    ("prod", np.float32, [3686565376.0, 4312102400.0, 3832046336.0, 5585957888.0], 1000,
     [np.inf, 3.4028233e38]),  # the exact product just under the largest float32
    # 0 * inf: NaN (1000 would pass: underflow's allowance, n·subnormal·1e60, is 5.6e15)
    ("prod", np.float32, [1e-30, 1e-30, 1e30, 1e30], 1e20, [np.nan, 0.0, np.inf, 1.0]),
    ("prod", np.float64, [1e300] * 17 + [0.0], 1.0, [0.0, np.nan]),  # 0, or inf * 0
    ("sum", np.float32, [np.nan, np.inf, 1.0], np.inf, [np.nan]),
    ("sum", np.float32, [np.inf, -np.inf, 1.0], np.inf, [np.nan]),
    ("sum", np.float32, [np.inf, -3e38, -3e38], -np.inf, [np.inf, np.nan]),
    ("sum", np.complex64, [np.inf + 1j, -np.inf + 2j, 1 + 3j], complex(np.nan, 999),
     [complex(np.nan, 6)]),  # each part on its own
    ("sum", np.float32, [3.4028235e38, -1.7014117e38, 0.0], np.inf, [1.7014117e38]),  # one
    ("prod", np.float16, [65504.0, 0.5, 0.5], np.inf, [16376.0]),  # term at the largest value
])
def test_what_passes_where_some_order_may_overflow_or_underflow(monkeypatch, op, dtype, values,
                                                                wrong, also_right):
    def reduce(rank):
        return pycoll.reduce(np.array([values[rank]], dtype), op, root=0, algorithm="ring")

    for value, passes in [(wrong, False), *((v, True) for v in also_right)]:
        set_result_after_run(monkeypatch, 0, value)
        said = errors_on_every_rank(len(values), reduce)
        assert (said == ["no error"] * len(values)) == passes, (value, said)


@pytest.mark.parametrize("counts", [np.array([1, 2, 0]), (c for c in [1, 2, 0])],
                         ids=["numpy", "generator"])
def test_counts_of_any_kind_the_call_takes(counts):
    listed = [1, 2, 0]

    def body():
        rank = pycoll.world().rank
        given = np.array(listed) if isinstance(counts, np.ndarray) else (c for c in listed)
        scattered = pycoll.reduce_scatter(np.arange(3.0), counts=given)
        given = np.array(listed) if isinstance(counts, np.ndarray) else (c for c in listed)
        gathered = pycoll.allgather(np.ones(listed[rank]), counts=given)
        given = np.array(listed) if isinstance(counts, np.ndarray) else (c for c in listed)
        exchanged = pycoll.alltoallv(np.arange(3.0), given)
        return scattered.tolist(), gathered.size, exchanged.tolist()

    done = pycoll.run_local(3, body)
    assert [d[0] for d in done] == [[0.0], [3.0, 6.0], []]
    assert [d[1] for d in done] == [3, 3, 3]
    assert [d[2] for d in done] == [[0.0, 0.0, 0.0], [1.0, 2.0, 1.0, 2.0, 1.0, 2.0], []]


def test_turning_verification_off_waits_for_the_async_calls_before(monkeypatch):
    """Every rank makes the same calls; only timing differs. The async calls queued before
    ``comm.verify = False`` run verified on every rank, not on some."""
    monkeypatch.setenv("PYCOLL_TIMEOUT", "10")

    def body():
        comm = pycoll.world()
        first = pycoll.allreduce(np.arange(4.0), async_op=True)
        second = pycoll.allreduce(np.arange(4.0), async_op=True)
        if comm.rank == 0:
            time.sleep(0.3)
        comm.verify = False
        return first.wait().tolist(), second.wait().tolist()

    assert pycoll.run_local(2, body) == [([0.0, 2.0, 4.0, 6.0],) * 2] * 2


def test_a_call_that_writes_its_input_is_caught(monkeypatch):
    real_execute = api._execute

    def write_input(comm, call, x, work):
        if comm.rank == 2 and x is not work:
            x.reshape(-1)[4] = -1

    after_each_run(monkeypatch, write_input)
    said = errors_on_every_rank(3, lambda rank: pycoll.allreduce(
        np.arange(6, dtype=np.int64), algorithm="ring"))
    assert all("rank 2 changed 1 elements of its input x, the first at index 4" in t
               for t in said), said
    assert "here (rank 2): the call changed its input x (not given in place): index 4 was 4, " \
           "is -1" in said[2]
    monkeypatch.setattr(api, "_execute", real_execute)

    def in_place(rank):  # writing x is the point here
        x = np.arange(6, dtype=np.int64)
        return pycoll.allreduce(x, out=x, algorithm="ring")

    assert errors_on_every_rank(3, in_place) == ["no error"] * 3


def test_an_in_place_reduce_scatter_writing_other_rows_of_x_is_caught(monkeypatch):
    """In place, out is this rank's rows of x and the rest of x must be left as it was: the
    check compares those rows (it skipped every row of an in-place call)."""
    real = api._reduce_scatter

    def write_other_rows(comm, x, out, *args, **kwargs):
        how = real(comm, x, out, *args, **kwargs)
        if comm.rank == 2:
            x.reshape(-1)[0] = -1  # rank 2's own rows are 4:6
        return how

    def in_place(rank):
        x = np.arange(6, dtype=np.int64)
        return pycoll.reduce_scatter(x, out=x[2 * rank:2 * rank + 2], algorithm="ring")

    assert errors_on_every_rank(3, in_place) == ["no error"] * 3
    monkeypatch.setattr(api, "_reduce_scatter", write_other_rows)
    said = errors_on_every_rank(3, in_place)
    assert all("rank 2 changed 1 elements of its input x, the first at index 0" in t
               for t in said), said


def test_a_check_that_fails_is_said_as_such_on_every_rank(monkeypatch):
    real_compare = verify._compare

    def compare(name, comm, *rest):
        if comm.rank == 1:
            raise RuntimeError("boom")
        return real_compare(name, comm, *rest)

    monkeypatch.setattr(verify, "_compare", compare)
    said = errors_on_every_rank(3, lambda rank: pycoll.allreduce(np.arange(3)))
    assert all(t.startswith("allreduce (op=sum, int64, algorithm='auto', 3 ranks): the result "
                            "could not be verified on rank(s) 1") for t in said), said
    assert said[1].endswith("| here (rank 1): RuntimeError: boom")


def test_a_failure_of_the_input_check_is_said_too(monkeypatch):
    def broken(*args):
        raise RuntimeError("input check broke")

    monkeypatch.setattr(verify, "_written_input", broken)
    said = errors_on_every_rank(2, lambda rank: pycoll.allreduce(np.arange(3)))
    assert all("could not be verified on rank(s) 0, 1" in t for t in said), said


def test_ranks_that_differ_on_verifying_are_named_by_the_agreement_check(monkeypatch):
    monkeypatch.setenv("PYCOLL_CHECK", "1")

    def body():
        comm = pycoll.world()
        comm.verify = comm.rank != 1
        try:
            pycoll.allreduce(np.arange(3))
        except pycoll.CollectiveMismatch as error:
            return str(error).split(": ", 1)[1]
        return "no error"

    said = pycoll.run_local(3, body)
    assert all("verify: true on ranks 0, 2; false on rank 1" in t for t in said), said


@pytest.mark.parametrize("transport_name", ["auto", "shm"])
@pytest.mark.parametrize("case, call, says", [
    ("op", lambda rank: pycoll.allreduce(np.arange(4.0) + rank, "max" if rank == 0 else "sum",
                                         algorithm="direct"),
     'op: "max" on rank 0; "sum" on ranks 1, 2'),
    ("dtype", lambda rank: pycoll.allreduce(
        np.arange(4, dtype=np.float32 if rank == 0 else np.int32), algorithm="direct"),
     'dtype: "float32" on rank 0; "int32" on ranks 1, 2'),
    ("op of reduce_scatter", lambda rank: pycoll.reduce_scatter(
        np.arange(6), "avg" if rank == 2 else "sum", algorithm="direct"),
     'op: "sum" on ranks 0, 1; "avg" on rank 2'),
    ("alike", lambda rank: pycoll.allgather(np.arange(2 if rank else 1), counts=[1, 2, 2]),
     None),  # verified, no error
])
def test_ranks_whose_calls_differ_are_named_not_each_checked_alone(monkeypatch, transport_name,
                                                                   case, call, says):
    """Rank 0 asking for max and its peers for sum (or float32 against int32): under a
    direct schedule every rank reduced all inputs itself and matched its own reading of the
    call, so the ranks ended with different results and verification said nothing."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", transport_name)
    said = errors_on_every_rank(3, call)
    for text in said:
        if says is None:
            assert text == "no error", said
        else:
            assert text.startswith(f"{call.__code__.co_names[1]}: the ranks' calls differ, "
                                   f"so no result can be verified: {says} (PYCOLL_CHECK=1 "
                                   "stops such calls before they run)"), said
