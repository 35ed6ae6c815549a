"""Every worked number of the seed document, reproduced by the library and the CLI."""

from __future__ import annotations

import numpy as np
import pytest

import pycoll
from pycoll.algorithms import families_for
from pycoll.cli import main
from pycoll.schedule import Collective


def row() -> np.ndarray:
    rank = pycoll.world().rank
    return np.arange(4 * rank + 1, 4 * rank + 5, dtype=np.int64)


@pytest.mark.parametrize("algorithm", families_for(Collective.ALLREDUCE))
def test_allreduce_scene(algorithm):
    for result in pycoll.run_local(4, lambda: pycoll.allreduce(row(), algorithm=algorithm)):
        assert result.tolist() == [28, 32, 36, 40]


@pytest.mark.parametrize("algorithm", families_for(Collective.REDUCE))
def test_reduce_scene(algorithm):
    results = pycoll.run_local(4, lambda: pycoll.reduce(row(), "sum", 0, algorithm=algorithm))
    assert results[0].tolist() == [28, 32, 36, 40]
    assert results[1:] == [None, None, None]


@pytest.mark.parametrize("algorithm", families_for(Collective.BROADCAST))
def test_broadcast_scene(algorithm):
    def body():
        x = row() if pycoll.world().rank == 0 else np.zeros(4, np.int64)
        return pycoll.broadcast(x, 0, algorithm=algorithm)

    for result in pycoll.run_local(4, body):
        assert result.tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("algorithm", families_for(Collective.ALLGATHER))
def test_allgather_scene(algorithm):
    def body():
        rank = pycoll.world().rank
        return pycoll.allgather(row()[rank : rank + 1], algorithm=algorithm)  # A0, B1, C2, D3

    for result in pycoll.run_local(4, body):
        assert result.tolist() == [1, 6, 11, 16]


@pytest.mark.parametrize("algorithm", families_for(Collective.REDUCE_SCATTER))
def test_reduce_scatter_scene(algorithm):
    results = pycoll.run_local(4, lambda: pycoll.reduce_scatter(row(), algorithm=algorithm))
    assert [r.tolist() for r in results] == [[28], [32], [36], [40]]


def test_allgather_after_reduce_scatter_composes_to_allreduce():
    results = pycoll.run_local(4, lambda: pycoll.allgather(pycoll.reduce_scatter(row())))
    assert all(r.tolist() == [28, 32, 36, 40] for r in results)


def test_alltoall_scene():
    results = pycoll.run_local(4, lambda: pycoll.alltoall(row()))
    assert results[2].tolist() == [3, 7, 11, 15]
    assert results[0].tolist() == [1, 5, 9, 13]


def test_send_recv_scene():
    def body():
        rank = pycoll.world().rank
        if rank == 0:
            x = row()
            pycoll.send(x, dst=1)
            return x  # the source keeps its data
        if rank == 1:
            return pycoll.recv(np.zeros(4, np.int64), src=0)
        return None  # ranks 2 and 3 do not participate

    results = pycoll.run_local(4, body)
    assert results[0].tolist() == [1, 2, 3, 4]
    assert results[1].tolist() == [1, 2, 3, 4]
    assert results[2:] == [None, None]


def test_fsdp_scene():
    parameters = np.array([10.0, 20.0, 30.0, 40.0])

    def body():
        rank = pycoll.world().rank
        gradient = pycoll.reduce_scatter(row().astype(np.float64))
        assert gradient.tolist() == [[28.0], [32.0], [36.0], [40.0]][rank]
        shard = parameters[rank : rank + 1] - 0.1 * (gradient / 4)
        return pycoll.allgather(shard)

    for result in pycoll.run_local(4, body):
        np.testing.assert_allclose(result, [9.3, 19.2, 29.1, 39.0], rtol=0, atol=1e-12)


def test_avg_divides_the_sum_by_four():
    for result in pycoll.run_local(4, lambda: pycoll.allreduce(row().astype(np.float32), "avg")):
        assert result.tolist() == [7.0, 8.0, 9.0, 10.0]


def test_demo_prints_the_seed_numbers(capsys):
    assert main(["demo"]) == 0
    printed = capsys.readouterr().out
    assert "[28, 32, 36, 40]" in printed
    assert "[1, 6, 11, 16]" in printed
    assert "[3, 7, 11, 15]" in printed
    assert printed.count("[9.3, 19.2, 29.1, 39.0]") == 5
    assert printed.count("matches the numpy oracle") == 7
    assert "DIFFERS" not in printed


def test_explain_ring_allreduce_ends_with_the_seed_sum(capsys):
    assert main(["explain", "allreduce", "--ranks", "4", "--algorithm", "ring"]) == 0
    printed = capsys.readouterr().out
    results = printed.split("results (run on in-process ranks)")[1]
    assert results.count("[28, 32, 36, 40]") == 4
    assert "rank 0 sends chunk 3 ([4]) to rank 1" in printed
    assert "rank 1 adds it into chunk 3 (element 3): [8] -> [12]" in printed


@pytest.mark.parametrize(
    "collective", ["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall"]
)
@pytest.mark.parametrize("nranks", [1, 3, 4])
def test_explain_every_collective(collective, nranks, capsys):
    for algorithm in families_for(Collective(collective)):
        assert (
            main(
                [
                    "explain",
                    collective,
                    "--ranks",
                    str(nranks),
                    "--algorithm",
                    algorithm,
                    "--root",
                    str(nranks - 1),
                    "--segments",
                    "2",
                ]
            )
            == 0
        )
        assert capsys.readouterr().out.rstrip().endswith("matches the numpy oracle")


def test_explain_says_how_many_messages_its_sends_travel_in(capsys):
    """explain printed one send per chunk, 6 by each rank, where the run sent 2: the chunks to
    one peer in one step that lie side by side travel as one message."""
    assert main(["explain", "allreduce", "--ranks", "3", "--algorithm", "direct",
                 "--segments", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("rank 0 sends its input") == 6
    assert ("messages the run sent (the sends above to one peer in one step whose chunks lie "
            "side by side travel as one; chunks of no elements are not sent): rank 0: 2 for 6 "
            "sends, rank 1: 2 for 6 sends, rank 2: 2 for 6 sends") in out
    assert main(["explain", "allreduce", "--ranks", "4", "--algorithm", "ring"]) == 0
    assert "messages the run sent" not in capsys.readouterr().out  # one send, one message


def test_explain_names_a_chunk_without_elements(capsys):
    """More chunks than elements: some are empty (it printed "elements 2..1"). More segments
    than elements are cut to one per element, as a run cuts them (it printed a schedule that
    did not run)."""
    assert main(["explain", "allreduce", "--ranks", "2", "--segments", "3"]) == 0
    out = capsys.readouterr().out
    assert "--segments=3: at most one per element, as a run makes them: 2" in out
    assert "2 segment(s), 4 chunks" in out
    assert "(no elements): [] -> []" in out and "2..1" not in out
    assert out.rstrip().endswith("matches the numpy oracle")


def test_explain_rejects_a_family_without_the_schedule(capsys):
    assert main(["explain", "alltoall", "--algorithm", "ring"]) == 2
    assert "has no alltoall schedule" in capsys.readouterr().err


@pytest.mark.parametrize("per_node,nranks,told", [
    ("", 3, "hierarchical on one node runs as its flat schedule"),
    ("2", 5, "hierarchical on nodes of unequal size (PYCOLL_RANKS_PER_NODE does not divide 5) "
             "runs as its flat schedule"),
    ("2", 4, None),
])
def test_explain_says_when_a_node_aware_family_runs_flat(monkeypatch, capsys, per_node, nranks,
                                                         told):
    """It printed "hierarchical allreduce" over the flat ring's steps without a word."""
    monkeypatch.setenv("PYCOLL_RANKS_PER_NODE", per_node)
    assert main(["explain", "allreduce", "--ranks", str(nranks), "--algorithm",
                 "hierarchical"]) == 0
    out = capsys.readouterr().out
    assert (told in out) if told else "flat schedule" not in out
    assert out.rstrip().endswith("matches the numpy oracle")


def test_explain_broadcast_shows_the_other_ranks_x_as_written_over(capsys):
    """The header said every rank holds [4r+1, ...], the listing showed zeros off the root
    and the stores said "(undefined)": three things for one x, which broadcast writes over."""
    assert main(["explain", "broadcast", "--ranks", "4", "--algorithm", "tree", "--root", "2"]) == 0
    out = capsys.readouterr().out
    assert "the root (r = 2) holds [4r+1, ..., 4r+4]; the others' x is written over (-)" in out
    assert "  rank 0: -\n  rank 1: -\n  rank 2: [9, 10, 11, 12]\n  rank 3: -\n" in out
    assert "rank 0 stores it as chunk 0 (elements 0..3): - -> [9, 10, 11, 12]" in out
    assert "undefined" not in out and "[0, 0, 0, 0]" not in out
