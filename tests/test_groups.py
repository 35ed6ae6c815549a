"""Sub-communicators in-process: split, new_group, and collectives on several interleaved."""

from __future__ import annotations

import numpy as np
import pytest

import pycoll


def test_split_orders_by_key_then_rank():
    def body():
        world = pycoll.world()
        halves = world.split(world.rank % 2, key=-world.rank)  # reverse order inside a half
        return halves.rank, halves.size, pycoll.allreduce(np.array([world.rank]), comm=halves)

    results = pycoll.run_local(5, body)
    assert [r[:2] for r in results] == [(2, 3), (1, 2), (1, 3), (0, 2), (0, 3)]
    assert [int(r[2][0]) for r in results] == [6, 4, 6, 4, 6]


def test_collectives_on_interleaved_communicators_never_mix():
    def body():
        world = pycoll.world()
        pair = world.split(world.rank // 2)
        out = []
        for i in range(4):  # alternate world and pair collectives of the same shape
            out.append(pycoll.allreduce(np.full(3, world.rank + i), comm=world, algorithm="ring"))
            out.append(pycoll.allreduce(np.full(3, world.rank * i), comm=pair, algorithm="ring"))
        return out

    results = pycoll.run_local(4, body)
    for rank, out in enumerate(results):
        partner = rank ^ 1
        for i in range(4):
            assert out[2 * i].tolist() == [6 + 4 * i] * 3
            assert out[2 * i + 1].tolist() == [(rank + partner) * i] * 3


def test_new_group_gives_members_a_communicator_and_others_none():
    def body():
        group = pycoll.new_group([3, 1])
        if group is None:
            return None
        return group.rank, pycoll.allgather(np.array([pycoll.world().rank]), comm=group).tolist()

    assert pycoll.run_local(4, body) == [None, (1, [3, 1]), None, (0, [3, 1])]


def test_numpy_integers_serve_as_ranks_colors_and_keys():
    """As in mpi4py's Split, and as roots and peers are taken."""
    def body():
        rank = pycoll.world().rank
        group = pycoll.new_group(np.array([3, 1]))
        half = pycoll.world().split(np.int64(rank % 2), key=np.int32(-rank))
        return (None if group is None else group.rank), half.rank

    assert pycoll.run_local(4, body) == [(None, 1), (1, 1), (None, 0), (0, 0)]


def test_send_and_recv_inside_a_sub_communicator_use_its_rank_numbers():
    def body():
        world = pycoll.world()
        odd = world.split(world.rank % 2)
        got = np.zeros(1, np.int64)
        if odd.rank == 0:
            pycoll.send(np.array([world.rank]), dst=1, comm=odd)
        else:
            pycoll.recv(got, src=0, comm=odd)
        return int(got[0])

    assert pycoll.run_local(4, body) == [0, 0, 0, 1]


@pytest.mark.parametrize("color", [-1, 1.5, True, "a", np.bool_(True), np.int64(-2), 2**31])
def test_split_rejects_bad_colors(color):
    def body():
        pycoll.world().split(color)

    with pytest.raises(ValueError,
                       match=r"color=.* is invalid; allowed: an int in 0\.\.2147483647, or None"):
        pycoll.run_local(2, body)


@pytest.mark.parametrize("key", [2**31, -2**31 - 1, 1.5])
def test_split_rejects_keys_mpi_cannot_take(key):
    """MPI_Comm_split takes C ints: 2**63 raised OverflowError naming no argument."""
    with pytest.raises(ValueError, match=r"key=.* is invalid; allowed: an int in "
                                         r"-2147483648\.\.2147483647"):
        pycoll.run_local(2, lambda: pycoll.world().split(0, key))


@pytest.mark.parametrize("ranks", [[], [0, 0], [5], [True], [np.int64(0), 0], 5, None])
def test_new_group_rejects_bad_rank_lists(ranks):
    with pytest.raises(ValueError, match="new_group: ranks=.* is invalid"):
        pycoll.run_local(2, lambda: pycoll.new_group(ranks))


def test_new_group_names_a_comm_that_is_not_a_communicator():
    with pytest.raises(TypeError, match="new_group: comm='world' is not a pycoll.Communicator"):
        pycoll.new_group([0], comm="world")


def test_new_group_with_lists_that_differ_between_ranks_fails_on_every_rank():
    """Rank 0 asked for [0, 1], ranks 1 and 2 for [1, 2]: all three got one group of three."""

    def body():
        rank = pycoll.world().rank
        try:
            pycoll.new_group([0, 1] if rank == 0 else [1, 2])
        except ValueError as error:
            return str(error)
        return "no error"

    assert pycoll.run_local(3, body) == [
        "new_group: ranks=[0, 1] here, but rank(s) [1, 2] passed other ranks; every rank of "
        "the communicator must pass the same ranks",
        "new_group: ranks=[1, 2] here, but rank(s) [0] passed other ranks; every rank of the "
        "communicator must pass the same ranks",
        "new_group: ranks=[1, 2] here, but rank(s) [0] passed other ranks; every rank of the "
        "communicator must pass the same ranks",
    ]


def test_sub_communicators_keep_the_parents_nodes(monkeypatch):
    """With simulated nodes (PYCOLL_RANKS_PER_NODE=2 over 4 ranks: {0, 1}, {2, 3}), a
    sub-communicator's ranks stay on their nodes, renumbered in order of first rank."""
    monkeypatch.setenv("PYCOLL_RANKS_PER_NODE", "2")

    def body():
        rank = pycoll.world().rank
        middle = pycoll.new_group([1, 2])
        parity = pycoll.world().split(rank % 2)
        pairs = pycoll.world().split(rank // 2)
        return (None if middle is None else middle.nodes(), parity.nodes(), pairs.nodes(),
                pairs.ranks_per_node)

    results = pycoll.run_local(4, body)
    assert results[1][0] == results[2][0] == [0, 1]
    assert all(parity == [0, 1] for _, parity, _, _ in results)
    assert all(pairs == [0, 0] and k == 0 for _, _, pairs, k in results)  # one node each


def test_a_sub_communicator_starts_with_its_parents_settings(monkeypatch):
    """timeout, check and verify, as an MPI communicator inherits its error handler."""
    monkeypatch.delenv("PYCOLL_CHECK", raising=False)
    monkeypatch.delenv("PYCOLL_TIMEOUT", raising=False)

    def body():
        world = pycoll.world()
        plain = world.split(0)
        world.timeout, world.check, world.verify = 7.0, True, True
        half = world.split(world.rank % 2)
        group = pycoll.new_group([1, 0])
        got = pycoll.allreduce(np.array([world.rank]), comm=half)  # checked and verified
        return ((plain.timeout, plain.check, plain.verify), (half.timeout, half.check,
                half.verify), (group.timeout, group.check, group.verify), half.agreements,
                int(got[0]))

    for rank, (plain, half, group, agreements, got) in enumerate(pycoll.run_local(2, body)):
        assert plain == (None, False, False)
        assert half == group == (7.0, True, True)
        assert agreements >= 1 and got == rank


def test_a_thread_a_rank_starts_has_no_default_communicator():
    """In-process ranks are threads: a worker thread of a rank fell back to a world of one
    rank and 'reduced' its own array alone (a silent wrong result); now it is named."""
    from concurrent.futures import ThreadPoolExecutor

    def rank_body():
        x = np.array([pycoll.world().rank + 1.0])
        with ThreadPoolExecutor(1) as pool:
            with pytest.raises(RuntimeError, match="not a rank of the running pycoll.run_local"):
                pool.submit(pycoll.allreduce, x).result()
            comm = pycoll.world()  # taken on the rank's thread, then passed: right
            return pool.submit(lambda: pycoll.allreduce(x, comm=comm)).result()

    assert [r.tolist() for r in pycoll.run_local(3, rank_body)] == [[6.0]] * 3
    assert pycoll.world().size == 1  # outside run_local: a world of one rank, as before


def test_a_thread_there_before_run_local_keeps_its_world_of_one():
    """Only threads started while ranks run are refused: the main thread, calling while a
    run_local goes on in the background, still has its world of one rank."""
    import threading

    inside, release = threading.Event(), threading.Event()

    def rank_body():
        inside.set()
        release.wait(30)

    background = threading.Thread(target=pycoll.run_local, args=(2, rank_body))
    background.start()
    try:
        assert inside.wait(30)
        assert pycoll.allreduce(np.ones(2)).tolist() == [1.0, 1.0]
    finally:
        release.set()
        background.join(30)



def test_freed_sub_communicators_leave_nothing_in_the_in_process_world(monkeypatch):
    """Each split-and-freed communicator of a run_local kept its async worker (with its
    executor) and its shared-memory entries in the world until run_local returned: about
    10 KB each, without bound in a long run."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")

    def body():
        world = pycoll.world()
        held = []
        for _ in range(20):
            sub = world.split(0)
            pycoll.allreduce(np.ones(4), comm=sub, async_op=True).wait()
            pycoll.allreduce(pycoll.empty(4, comm=sub), comm=sub)
            sub.free()
            pycoll.barrier()  # every rank's free done
            local = world.transport.world
            held.append((len(local._queues[world.rank]), len(local.shared)))
        return held

    for held in pycoll.run_local(2, body):
        assert held[-1] == held[5], held  # (the world makes its own on first use)
