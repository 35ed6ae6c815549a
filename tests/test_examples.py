"""The training-pattern examples (examples/): each passes its own checks against the
single-process computation in-process at several rank counts and under mpiexec, and the
seed's points that they make hold on their own."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_mpi import launch

import pycoll

EXAMPLES = Path(__file__).parent.parent / "examples"
NAMES = ["ddp", "fsdp", "moe", "pipeline", "evaluation", "tensor_parallel"]


@pytest.fixture(scope="module", autouse=True)
def examples_importable():
    sys.path.insert(0, str(EXAMPLES))
    yield
    sys.path.remove(str(EXAMPLES))


def example(name: str):
    return importlib.import_module(name)


@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("name", NAMES)
def test_example_in_process(name, nranks, capsys):
    module = example(name)
    passed = module.main(name, module.on_rank, module.parser(name), ["--ranks", str(nranks)])
    output = capsys.readouterr().out
    assert passed, output
    assert f"{name} on {nranks} ranks:" in output and "0 failed: PASSED" in output


# 4 processes over shared memory (the default on one node); 3 over MPI messages with the
# agreement check on (every collective's arguments agree across ranks, alltoallv's too)
@pytest.mark.parametrize("nranks,settings", [
    (4, {}), (3, {"PYCOLL_HOST_TRANSPORT": "mpi", "PYCOLL_CHECK": "1"}),
])
@pytest.mark.parametrize("name", NAMES)
def test_example_under_mpiexec(name, nranks, settings):
    done = launch(nranks, str(EXAMPLES / f"{name}.py"), timeout=120, **settings)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert f"{name} on {nranks} ranks:" in output and "0 failed: PASSED" in output


@pytest.mark.parametrize("flags", [[], ["-OO"]])  # -OO: no docstrings (their --help's line)
def test_example_as_a_script_in_process(flags):
    done = subprocess.run([sys.executable, *flags, str(EXAMPLES / "evaluation.py"), "--ranks",
                           "4"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    # rank 0's 4 and the other ranks' 2 each (no result off the root): it said "4 per rank"
    assert "evaluation on 4 ranks: 10 checks in all, 0 failed: PASSED" in done.stdout


def test_a_failed_check_on_one_rank_fails_every_rank(monkeypatch, capsys):
    evaluation = example("evaluation")
    honest = evaluation.global_mean

    def off_by_one_on_rank_0(losses):
        mean = honest(losses)
        return None if mean is None else mean + 1

    monkeypatch.setattr(evaluation, "global_mean", off_by_one_on_rank_0)
    results = pycoll.run_local(3, lambda: evaluation.on_rank(None).checks)
    assert not all(results[0].values()) and all(all(r.values()) for r in results[1:])
    passed = evaluation.main("evaluation", evaluation.on_rank, evaluation.parser(""),
                             ["--ranks", "3"])
    output = capsys.readouterr().out
    assert not passed
    assert "rank 0: FAILED" in output and "FAILED" in output.splitlines()[-1]


def test_averaging_per_rank_means_is_wrong_when_counts_differ():
    evaluation = example("evaluation")

    def both(equal: bool):
        losses = evaluation.token_losses(pycoll.world().rank, equal)
        return evaluation.global_mean(losses), evaluation.mean_of_means(losses)

    for equal in (False, True):
        everything = np.concatenate([evaluation.token_losses(r, equal) for r in range(4)])
        (right, wrong), *others = pycoll.run_local(4, both, equal)
        assert right == everything.mean()
        assert (wrong == pytest.approx(right)) is equal
        assert all(o == (None, None) for o in others)


@pytest.mark.parametrize("nranks", [1, 3, 4, 5])
def test_fsdp_reproduces_the_seed_step_exactly(nranks):
    results = pycoll.run_local(nranks, example("fsdp").seed_step)
    assert all(r.tolist() == [9.3, 19.2, 29.1, 39.0] for r in results)


def test_ddp_unequal_batches_need_the_weighting_rule():
    ddp = example("ddp")
    sizes = ddp.batch_sizes(3, equal=False)
    expected = ddp.single_process(sizes)
    right = pycoll.run_local(3, ddp.train, sizes, "sum")
    wrong = pycoll.run_local(3, ddp.train, sizes, "avg")
    assert all(np.allclose(r, expected, rtol=1e-10, atol=1e-12) for r in right)
    assert all(np.max(np.abs(w - expected)) > 1e-6 for w in wrong)


def test_tensor_parallel_partial_sums_rebuild_the_layer():
    """The row-split partials are addends: their AllReduce is Y, their ReduceScatter Y's rows
    in rank order, one share each."""
    tp = example("tensor_parallel")
    launch_ = example("launch")
    x, a, b = tp.weights()
    expected = np.maximum(x @ a, 0) @ b

    def layer():
        comm = pycoll.world()
        start, stop = launch_.offsets(launch_.shares(tp.HIDDEN, comm.size))[comm.rank:][:2]
        partial = np.maximum(x @ a[:, start:stop], 0) @ b[start:stop]
        rows = launch_.shares(tp.BATCH, comm.size)
        return pycoll.allreduce(partial), pycoll.reduce_scatter(partial, counts=rows)

    for nranks in (2, 3, 5):
        results = pycoll.run_local(nranks, layer)
        assert all(np.array_equal(y, expected) for y, _ in results)
        shares = [rows for _, rows in results]
        assert [len(s) for s in shares] == launch_.shares(tp.BATCH, nranks)
        assert np.array_equal(np.concatenate(shares), expected)
