"""Selection: auto takes the model's fastest candidate; PYCOLL_ALGO, algorithm=, plan(),
PYCOLL_DEBUG and tuning files."""

from __future__ import annotations

import logging
import os
import re
import subprocess

import numpy as np
import pytest
from conftest import PYTHON

import pycoll
from pycoll import model, select
from pycoll.schedule import Collective


@pytest.fixture(autouse=True)
def no_tuning_file(monkeypatch, tmp_path):
    monkeypatch.setenv(model.TUNING_ENV, str(tmp_path / "none.json"))
    monkeypatch.delenv(select.ALGO_ENV, raising=False)


def plan_on(nranks, *args, **kwargs):
    return pycoll.run_local(nranks, lambda: pycoll.plan(*args, **kwargs))[0]


def test_plan_names_the_choice_and_every_candidate_fastest_first():
    plan = plan_on(4, "allreduce", 1 << 20)
    assert plan.reason == "lowest predicted time"
    times = [c.seconds for c in plan.candidates]
    assert times == sorted(times) and plan.predicted == times[0]
    assert (plan.algorithm, plan.nsegments) == (
        plan.candidates[0].algorithm, plan.candidates[0].nsegments
    )
    assert {c.algorithm for c in plan.candidates} == {
        "ring", "tree", "halving_doubling", "direct", "two_shot"}
    assert "allreduce 1048576 B on 4 ranks" in plan.describe()


def test_latency_picks_few_messages_and_bandwidth_picks_the_ring(monkeypatch, tmp_path):
    path = tmp_path / "tuning.json"
    monkeypatch.setenv(model.TUNING_ENV, str(path))
    slow_start = model.Topology(intra=model.Link(1e-3, 1e-10), gamma=1e-11, delta=0.0)
    model.save_tuning([("local", slow_start)], path)
    small = plan_on(8, "allreduce", 64)
    large = plan_on(8, "allreduce", 64 << 20)
    assert small.algorithm in ("halving_doubling", "tree") and small.nsegments == 1
    assert large.algorithm in ("ring", "halving_doubling")
    assert str(path) in small.topology or small.topology == slow_start.name


@pytest.mark.parametrize("nranks,per_node,flat", [(3, None, True), (5, "2", True),
                                                   (4, "2", False), (6, "3", False)])
def test_plan_says_where_a_node_aware_family_runs_as_its_flat_schedule(
        monkeypatch, nranks, per_node, flat):
    """Asked for on one node or on nodes of unequal size, hierarchical runs its flat ring
    (as explain said); plan and PYCOLL_DEBUG named it without saying so."""
    if per_node is None:
        monkeypatch.delenv("PYCOLL_RANKS_PER_NODE", raising=False)
    else:
        monkeypatch.setenv("PYCOLL_RANKS_PER_NODE", per_node)
    for family in ("hierarchical", "hierarchical_tree"):
        plan = plan_on(nranks, "allreduce", 800, algorithm=family)
        assert plan.algorithm == family
        assert ("run as its flat schedule" in plan.reason) == flat, plan.reason
    assert "flat" not in plan_on(nranks, "allreduce", 800, algorithm="ring").reason


def test_pycoll_algo_forces_a_family_globally_or_per_collective(monkeypatch):
    monkeypatch.setenv(select.ALGO_ENV, "tree")
    assert plan_on(4, "allreduce", 1 << 20).algorithm == "tree"
    monkeypatch.setenv(select.ALGO_ENV, "allreduce:direct, reduce_scatter:ring")
    forced = plan_on(4, "allreduce", 1 << 20)
    assert forced.algorithm == "direct" and forced.reason == "forced by PYCOLL_ALGO"
    assert plan_on(4, "reduce_scatter", 64).algorithm == "ring"
    assert plan_on(4, "broadcast", 64).reason == "lowest predicted time"


def test_a_forced_family_that_cannot_serve_the_call_names_the_variable(monkeypatch):
    monkeypatch.setenv(select.ALGO_ENV, "halving_doubling")
    with pytest.raises(ValueError, match="PYCOLL_ALGO forces 'halving_doubling' for broadcast"):
        pycoll.run_local(2, lambda: pycoll.broadcast(np.zeros(4)))
    monkeypatch.setenv(select.ALGO_ENV, "allgatherr:ring")
    with pytest.raises(ValueError, match="PYCOLL_ALGO='allgatherr:ring': 'allgatherr' is not"):
        plan_on(2, "allgather", 64)
    # AllToAll has one family: the bare form leaves it be, naming it is an error (was ignored)
    monkeypatch.setenv(select.ALGO_ENV, "tree")
    assert pycoll.run_local(2, lambda: pycoll.alltoall(np.arange(4)).tolist()) == [[0, 1, 0, 1],
                                                                                  [2, 3, 2, 3]]
    for call in (lambda: pycoll.alltoall(np.arange(4)),
                 lambda: pycoll.alltoallv(np.arange(4), [2, 2])):
        monkeypatch.setenv(select.ALGO_ENV, "alltoall:ring")
        with pytest.raises(ValueError, match="PYCOLL_ALGO='alltoall:ring' forces 'ring' for "
                                             "alltoall, which it cannot serve; allowed for "
                                             "alltoall: direct"):
            pycoll.run_local(2, call)


@pytest.mark.parametrize("value,message", [
    ("bogus", "'bogus' is not an algorithm family; allowed: ring, tree"),
    ("allreduce:ring,allreduce:tree", "names allreduce twice; allowed: once"),
    ("ring,tree", "names the default twice"),
])
def test_pycoll_algo_names_a_typo_or_a_repeat_for_every_collective(monkeypatch, value, message):
    """AllToAll, which has one family, ignored a bare typo that every other collective
    refused; of two entries for one collective the first silently won."""
    monkeypatch.setenv(select.ALGO_ENV, value)
    for call in (lambda: pycoll.alltoall(np.arange(4)), lambda: pycoll.allreduce(np.arange(4))):
        with pytest.raises(ValueError, match=message):
            pycoll.run_local(2, call)


def test_calls_run_what_the_plan_says(monkeypatch, caplog):
    monkeypatch.setattr(select, "DEBUG", True)
    monkeypatch.setenv(select.ALGO_ENV, "allreduce:tree")
    with caplog.at_level(logging.WARNING, logger="pycoll"):
        results = pycoll.run_local(3, lambda: pycoll.allreduce(np.arange(10) + pycoll.world().rank))
    np.testing.assert_array_equal(results[0], 3 * np.arange(10) + 3)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all("allreduce 80 B on 3 ranks: tree" in line for line in lines)
    assert all("forced by PYCOLL_ALGO" in line for line in lines)


def test_plan_and_debug_name_the_one_shot_where_it_serves_the_call(monkeypatch, caplog):
    """Over shared memory small calls take the one-shot, not a schedule: plan named the
    schedule auto would not run, and PYCOLL_DEBUG said nothing for them."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    monkeypatch.setattr(select, "DEBUG", True)

    def body():
        plans = [pycoll.plan("allreduce", 8), pycoll.plan("allgather", 4 * 3),
                 pycoll.plan("reduce", 1 << 10, root=2), pycoll.plan("allreduce", 64 << 20),
                 pycoll.plan("allreduce", 8, algorithm="ring"),
                 pycoll.plan("allgather", 3 * (1 << 20))]
        pycoll.allreduce(np.ones(2, np.float32))
        return [p.algorithm for p in plans], plans[0]

    with caplog.at_level(logging.WARNING, logger="pycoll"):
        (names, small), *_ = pycoll.run_local(3, body)
    assert names[:3] == [select.ONE_SHOT] * 3
    assert select.ONE_SHOT not in names[3:] and names[4] == "ring"
    assert np.isnan(small.predicted) and small.candidates  # what a schedule would cost
    assert "one_shot" in small.describe()
    lines = [r.getMessage() for r in caplog.records]
    assert sorted(line.split(" allreduce")[0] for line in lines) == [
        f"pycoll: rank {r}" for r in range(3)]
    assert all("allreduce 8 B on 3 ranks: one_shot (every rank on one node" in line
               for line in lines)


def test_debug_names_an_allgather_by_its_output_on_every_path(monkeypatch, caplog):
    """A one-shot AllGather of 100 float32 on 3 ranks logged 400 B (its input), the same call
    on the ring 1200 B (its output, as plan("allgather", 1200) reads it)."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    monkeypatch.setattr(select, "DEBUG", True)
    with caplog.at_level(logging.WARNING, logger="pycoll"):
        pycoll.run_local(3, lambda: [pycoll.allgather(np.ones(100, np.float32), algorithm=a)
                                     for a in ("auto", "ring")])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 6 and all(" allgather 1200 B on 3 ranks: " in line for line in lines)
    assert sum(": one_shot (" in line for line in lines) == 3, lines


def test_plan_on_one_rank_alone_names_the_one_shot_without_a_collective(monkeypatch):
    """plan may be asked on one rank alone: it reads the one-shot off the layout instead of
    making the shared-memory transport (every rank together) before the first collective."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    monkeypatch.setenv("PYCOLL_TIMEOUT", "20")  # a regression fails, not hangs

    def body():
        if pycoll.world().rank != 0:
            return None  # no collective at all
        return [pycoll.plan("allreduce", 8).algorithm,
                pycoll.plan("allgather", 3 * (64 << 10)).algorithm,
                pycoll.plan("allgather", 3 * (64 << 10) + 12).algorithm]

    names = pycoll.run_local(3, body)[0]
    assert names[:2] == [select.ONE_SHOT] * 2 and names[2] != select.ONE_SHOT


def test_algorithm_argument_lets_the_model_pick_only_the_segments():
    plan = plan_on(4, "broadcast", 32 << 20, algorithm="ring")
    assert plan.algorithm == "ring" and {c.algorithm for c in plan.candidates} == {"ring"}
    assert plan.nsegments > 1  # a pipelined chain, for a large message


@pytest.mark.parametrize("args,message", [
    (("allreducee", 8), "plan: collective='allreducee' is unknown"),
    (("allreduce", -1), "plan: nbytes=-1 is invalid"),
    (("allreduce", 6), "plan: nbytes=6 is no whole number of float32 elements; allowed: a "
                       "multiple of 4"),
    (("alltoall", 12), "plan: nbytes=12 is 3 float32 elements, which do not divide into 2 "
                       "equal pieces"),
    (("broadcast", 8), "plan: root=9 is not a rank"),
    (("reduce", 8), "plan: device='no' is invalid; allowed: True or False"),  # planned CUDA
])
def test_plan_rejects_bad_arguments(args, message):
    kwargs = {"broadcast": {"root": 9}, "reduce": {"device": "no"}}.get(args[0], {})
    with pytest.raises(ValueError, match=message):
        plan_on(2, *args, **kwargs)


@pytest.mark.parametrize("kwargs,kind,message", [
    ({"dtype": "bool"}, TypeError, "plan: dtype='bool' is not supported; allowed: int8, "),
    ({"algorithm": "bogus"}, ValueError, "plan: algorithm='bogus' is not an algorithm family"),
    ({"algorithm": None}, TypeError, "plan: algorithm=None is not a name; allowed: 'auto' or "),
])
def test_plan_names_itself_in_its_dtype_and_algorithm_errors(kwargs, kind, message):
    """These said neither "plan:" nor, for algorithm=None, the TypeError a call raises."""
    with pytest.raises(kind, match=f"^{re.escape(message)}"):
        plan_on(2, "allreduce", 64, **kwargs)


def test_the_estimate_between_powers_of_two_matches_an_exact_play():
    topology = select.DEFAULTS["mpi"]
    for family in ("ring", "tree", "halving_doubling", "direct"):
        for count in (7 * 4096 * 64, 123_457 * 8):
            fast = select.estimate(Collective.ALLREDUCE, family, 7, 2, None, topology, 4, count)
            schedule = pycoll.algorithms.build(family, Collective.ALLREDUCE, 7, 2)
            exact = model.play(model.programs(schedule, count), topology, 4).seconds
            assert fast == pytest.approx(exact, rel=1e-2)


@pytest.mark.parametrize("name, good", [
    ("PYCOLL_SEGMENTS", 3), ("PYCOLL_SHM_RING_BYTES", 16384),
    ("PYCOLL_SHM_ONE_SHOT_BYTES", 16384), ("PYCOLL_RANKS_PER_NODE", 3),
])
def test_every_integer_setting_reads_alike(monkeypatch, name, good):
    """PYCOLL_SEGMENTS=+3 was taken and PYCOLL_SHM_RING_BYTES=+16384 refused: each setting
    had its own reader."""
    from pycoll import comm
    from pycoll.bindings import shm

    readers = {
        "PYCOLL_SEGMENTS": select._segments_from_env,
        "PYCOLL_SHM_RING_BYTES": shm.ring_bytes_from_env,
        "PYCOLL_SHM_ONE_SHOT_BYTES": shm.small_bytes_from_env,
        "PYCOLL_RANKS_PER_NODE": lambda: comm._ranks_per_node(99),
    }
    for text in (str(good), f" +{good} ", f"{good:_}"):
        monkeypatch.setenv(name, text)
        assert readers[name]() == good, text
    for text in ("x", "-1", "0", "3.0", "\u0663", "\u00b2"):
        monkeypatch.setenv(name, text)
        with pytest.raises(ValueError, match=f"^{name}={text!r} is invalid; allowed: an int "):
            readers[name]()


@pytest.mark.parametrize("value", ["0", "-1", "x", "1025", "99999999", "\u0663"])
def test_a_segment_count_out_of_range_is_refused(monkeypatch, value):
    """PYCOLL_SEGMENTS=-1 gave the ring an empty schedule (AllReduce returned zeros), 0 a
    ZeroDivisionError, x a bare int() error at import; 99999999 took 32 s to plan a
    4000-element AllReduce (its one segment per element, every family priced)."""
    monkeypatch.setenv("PYCOLL_SEGMENTS", value)
    with pytest.raises(ValueError, match=f"PYCOLL_SEGMENTS='{value}' is invalid; allowed: an "
                                         "int in 1..1024, or unset"):
        select._segments_from_env()
    monkeypatch.setenv("PYCOLL_SEGMENTS", " 3 ")
    assert select._segments_from_env() == 3
    from pycoll.algorithms import build

    with pytest.raises(ValueError, match="nsegments=-1 is invalid; allowed: an int >= 1"):
        build("ring", Collective.ALLREDUCE, 3, -1)


@pytest.mark.parametrize("name, value, allowed", [
    ("PYCOLL_SEGMENTS", "x", "an int in 1..1024, or unset"), ("PYCOLL_DEBUG", "yes", "0 or 1")])
def test_a_bad_setting_read_at_import_is_raised_where_a_communicator_is_made(
        name, value, allowed):
    """PYCOLL_SEGMENTS=x raised inside `import pycoll`: every `pycoll` command, --help too,
    ended in a traceback. Now the import stands, and making a communicator raises the error."""
    env = {**os.environ, name: value}
    code = ("import pycoll\n"
            "try:\n    pycoll.run_local(2, lambda: None)\n"
            "except ValueError as error:\n    print(error)")
    run = subprocess.run([*PYTHON, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"{name}={value!r} is invalid; allowed: {allowed}"
    cli = [*PYTHON, "-m", "pycoll"]
    run = subprocess.run([*cli, "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "usage: pycoll" in run.stdout, run.stderr
    for command in (["bench", "-e", "8"], ["demo"]):
        run = subprocess.run([*cli, *command], env=env, capture_output=True, text=True,
                             timeout=120)
        assert (run.returncode, run.stderr) == (
            2, f"pycoll {command[0]}: {name}={value!r} is invalid; allowed: {allowed}\n")


def test_an_on_off_setting_takes_0_or_1_and_names_anything_else(monkeypatch):
    """PYCOLL_DEBUG=false turned logging on; PYCOLL_MPI=yes was read as unset."""
    from pycoll.settings import switch

    name = "PYCOLL_DEBUG"

    for text, expected in [("1", True), (" 0 ", False), ("", None)]:
        monkeypatch.setenv(name, text)
        assert switch(name, None) is expected
    monkeypatch.delenv(name)
    assert switch(name, True) is True
    for text in ["false", "yes", "2"]:
        monkeypatch.setenv(name, text)
        with pytest.raises(ValueError, match=f"{name}='{text}' is invalid; allowed: 0 or 1"):
            switch(name, None)


def test_each_on_off_setting_is_read_through_the_switch(monkeypatch):
    from pycoll import agree, api, verify
    from pycoll.bindings import mpi, shm, staged

    readers = {"PYCOLL_FORWARD": api._forwarding, "PYCOLL_MPI": mpi.launched_by_mpi,
               "PYCOLL_CHECK": agree.enabled_by_default,
               "PYCOLL_VERIFY": verify.enabled_by_default, "PYCOLL_SHM_CMA": shm._cma_enabled,
               "PYCOLL_CUDA_AWARE_MPI": lambda: staged.cuda_aware_mpi(None)}
    for name, read in readers.items():
        monkeypatch.setenv(name, "yes")
        with pytest.raises(ValueError, match=f"{name}='yes'"):
            read()
        monkeypatch.delenv(name)


def test_forced_segments_stop_at_one_per_element(segments):
    """PYCOLL_SEGMENTS=100000 on an 8-element ring AllReduce played 100 000 empty segments
    (a minute): at most one segment per element."""
    segments(100000)
    plan = select.plan_for(Collective.ALLREDUCE, 64, 2, "ring", itemsize=8)
    assert plan.nsegments == 8
    assert "PYCOLL_SEGMENTS=100000 (at most one per element: 8)" in plan.reason
    assert pycoll.run_local(2, lambda: pycoll.allreduce(np.ones(8), algorithm="ring").tolist()
                            ) == [[2.0] * 8] * 2
    segments(3)
    assert select.plan_for(Collective.ALLREDUCE, 64, 2, "ring", itemsize=8).nsegments == 3


def test_a_new_small_size_reuses_the_plays_around_it():
    """Up to 64 elements per chunk the model played every rank's program of every family and
    segment count for each new size (41 ms per size at 5 ranks, 314 at 16: the first call
    of each size paid it); now sizes between two multiples of a schedule's chunk count share
    those two plays, within rounding of an exact play."""
    topology = select.DEFAULTS["mpi"]
    select.plan_for(Collective.ALLREDUCE, 1000 * 8, 8, "auto", topology, 8)
    before = select._exact.cache_info().misses
    for count in range(1001, 1031):
        select.plan_for(Collective.ALLREDUCE, count * 8, 8, "auto", topology, 8)
    assert select._exact.cache_info().misses - before <= 40  # one play per candidate: 435
    for family in ("ring", "tree", "halving_doubling", "direct"):
        for count in (1001, 1019, 2047):
            fast = select.estimate(Collective.ALLREDUCE, family, 8, 16, None, topology, 8, count)
            schedule = pycoll.algorithms.build(family, Collective.ALLREDUCE, 8, 16)
            exact = model.play(model.programs(schedule, count), topology, 8).seconds
            assert fast == pytest.approx(exact, rel=1e-2), (family, count)


def test_algo_settings_that_mean_the_same_agree_between_ranks(monkeypatch):
    """Ranks with PYCOLL_ALGO="tree,allreduce:ring" and "allreduce:ring, tree" force the
    same families, yet making their communicator was refused: the text was compared."""
    from pycoll import comm

    tables = []
    for text in ("tree,allreduce:ring", " allreduce:ring , tree",
                 "allreduce:ring,reduce_scatter:tree,allgather:tree,broadcast:tree,reduce:tree"):
        monkeypatch.setenv("PYCOLL_ALGO", text)
        tables.append(comm.shared_settings())
    assert comm.settings_disagreement(tables) is None
    monkeypatch.setenv("PYCOLL_ALGO", "alltoall:direct")  # its only family: as unset
    unset = comm.shared_settings()
    monkeypatch.delenv("PYCOLL_ALGO")
    assert comm.settings_disagreement([unset, comm.shared_settings()]) is None
    assert comm.settings_disagreement([tables[0], unset]) == (
        "the ranks' settings differ: PYCOLL_ALGO 'allreduce:ring,reduce_scatter:tree,"
        "allgather:tree,broadcast:tree,reduce:tree' on rank 0, 'unset' on rank 1; allowed: "
        "the same on every rank (they decide which messages each sends)")


def test_a_plan_lists_each_family_once_per_distinct_time(monkeypatch):
    """Families whose segments do not pipeline (halving_doubling, direct, two_shot, the
    hierarchical ones) were listed once per segment count, every one at the same time."""
    monkeypatch.setenv("PYCOLL_RANKS_PER_NODE", "2")
    plan = plan_on(4, "allreduce", 64 << 20)
    times = [(c.algorithm, c.seconds) for c in plan.candidates]
    assert len(times) == len(set(times)), times
    assert {c.algorithm for c in plan.candidates} >= {"hierarchical", "halving_doubling"}
    assert [c.nsegments for c in plan.candidates if c.algorithm == "halving_doubling"] == [1]
    assert len([c for c in plan.candidates if c.algorithm == "ring"]) > 1  # it pipelines


def test_in_process_ranks_price_a_call_once_between_them(monkeypatch):
    """Every in-process rank prices its first call of a shape at once, each its own pricing
    racing the others' before the cache held any (a plan at 33 ranks took 15 s, not 1 s):
    they take turns, and each price is computed once."""
    priced = []
    real = model.seconds

    def seconds(*args, **kwargs):
        priced.append(repr(args))
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "seconds", seconds)
    select._exact.cache_clear()
    choices = pycoll.run_local(
        6, lambda: pycoll.plan("allreduce", 6 * 8 * 1000, dtype="float64").algorithm)
    assert len(set(choices)) == 1
    assert priced and len(priced) == len(set(priced)), len(priced) - len(set(priced))
