"""Hierarchical schedules over simulated nodes (PYCOLL_RANKS_PER_NODE): the checker proves
them, every collective equals the oracle at 4, 6 and 8 ranks as 2 to 4 nodes, the counted
inter-node bytes equal the model's, and auto picks them where the network is slow."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import pycoll
from pycoll import algorithms, model, oracle, scaling, select
from pycoll.algorithms import hierarchical
from pycoll.check import check
from pycoll.schedule import ROOTED, Collective

# (ranks, ranks per node): 2, 2, 3, 2 and 4 nodes
NODES = [(4, 2), (6, 3), (6, 2), (8, 4), (8, 2)]
DTYPES = [np.int32, np.int8, np.uint16, np.int64, np.float16, np.float32, np.float64,
          ml_dtypes.bfloat16]
OPS = ["sum", "prod", "min", "max", "avg"]


@pytest.mark.parametrize("collective", list(hierarchical.SCHEDULES))
def test_the_checker_proves_every_node_layout(collective):
    for nranks, per_node in [(1, 1), (2, 1), (3, 3), (5, 1), (9, 3), (12, 4), *NODES]:
        for nsegments in (1, 2):
            for root in range(nranks) if collective in ROOTED else [None]:
                check(algorithms.build("hierarchical", collective, nranks, nsegments, root,
                                       ranks_per_node=per_node))


def test_the_checker_proves_the_tree_variant():
    for nranks, per_node in [(1, 1), (2, 1), (5, 1), (9, 3), (10, 2), (12, 4), *NODES]:
        for nsegments in (1, 2):
            check(algorithms.build("hierarchical_tree", Collective.ALLREDUCE, nranks,
                                   nsegments, ranks_per_node=per_node))


def test_a_layout_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match=r"ranks_per_node=4 does not divide the 6 ranks"):
        algorithms.build("hierarchical", Collective.ALLREDUCE, 6, ranks_per_node=4)


def inputs(nranks: int, count: int, dtype, op: str, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    values = rng.choice([1, 2] if op == "prod" else [0, 1, 2, 3], size=(nranks, count))
    return [values[r].astype(dtype) for r in range(nranks)]


def call(collective: Collective, x: np.ndarray, op: str, root: int, counts: list[int],
         algorithm: str = "hierarchical"):
    if collective is Collective.ALLREDUCE:
        return pycoll.allreduce(x, op, algorithm=algorithm)
    if collective is Collective.REDUCE_SCATTER:
        return pycoll.reduce_scatter(x, op, counts=counts, algorithm="hierarchical")
    if collective is Collective.ALLGATHER:
        return pycoll.allgather(x, counts=counts, algorithm="hierarchical")
    if collective is Collective.BROADCAST:
        return pycoll.broadcast(x.copy(), root, algorithm="hierarchical")
    return pycoll.reduce(x, op, root, algorithm="hierarchical")


def expected(collective, xs, op, root, counts, rank):
    if collective is Collective.ALLREDUCE:
        return oracle.allreduce(xs, op)
    if collective is Collective.REDUCE_SCATTER:
        return oracle.reduce_scatter(xs, op, counts)[rank]
    if collective is Collective.ALLGATHER:
        return oracle.allgather(xs)
    if collective is Collective.BROADCAST:
        return oracle.broadcast(xs, root)
    return oracle.reduce(xs, op, root) if rank == root else None


@pytest.mark.parametrize("collective,algorithm", [
    *[(c, "hierarchical") for c in hierarchical.SCHEDULES],
    (Collective.ALLREDUCE, "hierarchical_tree"),
])
@pytest.mark.parametrize("nranks,per_node", NODES)
def test_every_collective_equals_the_oracle_on_simulated_nodes(monkeypatch, nranks, per_node,
                                                                collective, algorithm):
    monkeypatch.setenv("PYCOLL_RANKS_PER_NODE", str(per_node))
    cases = []
    for index, count in enumerate([0, 1, nranks + 1, 97]):
        for op in OPS if collective in {Collective.ALLREDUCE, Collective.REDUCE_SCATTER,
                                        Collective.REDUCE} else ["sum"]:
            dtype = DTYPES[(index + OPS.index(op)) % len(DTYPES)]
            root = (index * 3 + 1) % nranks
            counts = [count // nranks + (r < count % nranks) for r in range(nranks)]
            if collective is Collective.ALLGATHER:
                shards = inputs(nranks, count, dtype, op, index)
                xs = [shards[r][: counts[r]] for r in range(nranks)]
            else:
                xs = inputs(nranks, count, dtype, op, index)
            cases.append((op, dtype, root, counts, xs))

    def every_case():
        rank = pycoll.world().rank
        assert pycoll.world().ranks_per_node == per_node
        return [call(collective, xs[rank], op, root, counts, algorithm)
                for op, _, root, counts, xs in cases]

    results = pycoll.run_local(nranks, every_case)
    for rank, got in enumerate(results):
        for (op, dtype, root, counts, xs), value in zip(cases, got):
            want = expected(collective, xs, op, root, counts, rank)
            name = f"rank {rank} {op} {np.dtype(dtype)} count {sum(len(x) for x in xs)}"
            if want is None:
                assert value is None, name
            else:
                assert value.dtype == want.dtype and np.array_equal(value, want), name


def closed_form_inter(collective: Collective, nbytes: int, nranks: int, per_node: int) -> float:
    """Bytes per rank between nodes (docstring of pycoll/algorithms/hierarchical.py)."""
    nodes = nranks // per_node
    rounds = 2 if collective is Collective.ALLREDUCE else 1
    return rounds * (nodes - 1) / nodes * nbytes / per_node


@pytest.mark.parametrize("collective", [Collective.ALLREDUCE, Collective.REDUCE_SCATTER,
                                        Collective.ALLGATHER])
@pytest.mark.parametrize("nranks,per_node", NODES)
def test_counted_inter_node_bytes_equal_the_model(monkeypatch, nranks, per_node, collective):
    monkeypatch.setenv("PYCOLL_RANKS_PER_NODE", str(per_node))
    count = 24 * nranks  # divides evenly, so the closed form is exact
    x = np.ones(count, np.float32)
    shard = np.ones(count // nranks, np.float32)

    def counted():
        comm = pycoll.world()
        comm.traffic.reset()
        if collective is Collective.ALLREDUCE:
            pycoll.allreduce(x, algorithm="hierarchical")
        elif collective is Collective.REDUCE_SCATTER:
            pycoll.reduce_scatter(x, algorithm="hierarchical")
        else:
            pycoll.allgather(shard, algorithm="hierarchical")
        return dict(comm.traffic.bytes)

    measured = pycoll.run_local(nranks, counted)
    schedule = algorithms.build("hierarchical", collective, nranks, ranks_per_node=per_node)
    predicted = model.traffic(schedule, count, per_node, itemsize=4)
    assert measured == predicted
    form = closed_form_inter(collective, x.nbytes, nranks, per_node)
    assert all(m["inter"] == form for m in measured)
    flat = model.traffic(algorithms.build("ring", collective, nranks), count, per_node, 4)
    # the point of it: a flat ring's node-boundary ranks carry far more across the network
    assert max(h["inter"] for h in predicted) < max(f["inter"] for f in flat)


@pytest.mark.parametrize("nranks,per_node", NODES)
def test_the_tree_variant_trades_bytes_between_nodes_for_rounds(monkeypatch, nranks, per_node):
    monkeypatch.setenv("PYCOLL_RANKS_PER_NODE", str(per_node))
    count = 24 * nranks
    x = np.ones(count, np.float32)

    def counted():
        comm = pycoll.world()
        comm.traffic.reset()
        pycoll.allreduce(x, algorithm="hierarchical_tree")
        return dict(comm.traffic.bytes)

    measured = pycoll.run_local(nranks, counted)
    schedule = algorithms.build("hierarchical_tree", Collective.ALLREDUCE, nranks,
                                ranks_per_node=per_node)
    assert measured == model.traffic(schedule, count, per_node, itemsize=4)
    nodes = nranks // per_node
    depth = (nodes - 1).bit_length()  # ceil(log2 N)
    assert max(m["inter"] for m in measured) <= depth * x.nbytes / per_node
    assert len(check(schedule).rounds) == 2 * (per_node - 1) + 2 * depth


def test_the_model_prices_the_tree_variants_fewer_rounds_and_more_bytes():
    nvlink_ib = scaling.topology_named("nvlink-ib")  # 8 nodes of 8

    def seconds(family: str, nbytes: int) -> float:
        schedule = algorithms.build(family, Collective.ALLREDUCE, 64, ranks_per_node=8)
        return model.predict(schedule, nbytes, nvlink_ib, itemsize=4).seconds

    assert seconds("hierarchical_tree", 1 << 10) < seconds("hierarchical", 1 << 10)
    assert seconds("hierarchical", 256 << 20) < seconds("hierarchical_tree", 256 << 20)


def test_traffic_counts_messages_and_link_classes(monkeypatch):
    monkeypatch.setenv("PYCOLL_RANKS_PER_NODE", "2")

    def counted():
        comm = pycoll.world()
        comm.traffic.reset()
        pycoll.broadcast(np.arange(10.0), root=0, algorithm="hierarchical")
        return comm.traffic.messages, comm.traffic.bytes

    results = pycoll.run_local(4, counted)
    # root 0 sends to rank 2 (the other node) then to rank 1; rank 2 sends to rank 3
    assert results[0] == ({"intra": 1, "inter": 1}, {"intra": 80, "inter": 80})
    assert results[2] == ({"intra": 1, "inter": 0}, {"intra": 80, "inter": 0})
    assert results[1][0] == results[3][0] == {"intra": 0, "inter": 0}


def test_nodes_of_the_in_process_world(monkeypatch):
    monkeypatch.setenv("PYCOLL_RANKS_PER_NODE", "2")
    assert pycoll.run_local(6, lambda: pycoll.world().nodes()) == [[0, 0, 1, 1, 2, 2]] * 6
    assert set(pycoll.run_local(6, lambda: pycoll.world().ranks_per_node)) == {2}
    assert set(pycoll.run_local(5, lambda: pycoll.world().ranks_per_node)) == {0}  # unequal
    monkeypatch.setenv("PYCOLL_RANKS_PER_NODE", " 2 ")  # spaces, as PYCOLL_SEGMENTS takes them
    assert pycoll.run_local(4, lambda: pycoll.world().nodes()) == [[0, 0, 1, 1]] * 4
    monkeypatch.setenv("PYCOLL_RANKS_PER_NODE", " ")
    assert set(pycoll.run_local(4, lambda: pycoll.world().ranks_per_node)) == {0}  # one node
    monkeypatch.delenv("PYCOLL_RANKS_PER_NODE")
    assert set(pycoll.run_local(4, lambda: pycoll.world().ranks_per_node)) == {0}  # one node


def test_uneven_nodes_are_priced_with_their_links_between_nodes(monkeypatch):
    """5 ranks as nodes of 2, 2 and 1: no ranks_per_node, yet the costs auto uses know which
    links cross nodes (they took every link as within one node)."""
    monkeypatch.setenv("PYCOLL_RANKS_PER_NODE", "2")

    def costs():
        comm = pycoll.world()
        topology = select.topology_for(comm, pycoll.spaces.HOST)
        return topology.nodes, topology.same_node(1, 2), topology.same_node(2, 3)

    assert pycoll.run_local(5, costs) == [((0, 0, 1, 1, 2), False, True)] * 5
    assert pycoll.run_local(4, costs)[0][0] == ()  # regular: ranks_per_node says it

    count = 40
    for family in ("ring", "tree", "direct"):
        def counted(family=family):
            comm = pycoll.world()
            comm.traffic.reset()
            pycoll.allreduce(np.ones(count, np.float32), algorithm=family)
            return dict(comm.traffic.bytes)

        schedule = algorithms.build(family, Collective.ALLREDUCE, 5)
        assert pycoll.run_local(5, counted) == model.traffic(
            schedule, count, 0, itemsize=4, nodes=(0, 0, 1, 1, 2)), family


def test_auto_prices_two_link_classes_and_picks_hierarchical_where_the_network_is_slow():
    nvlink_ib = scaling.topology_named("nvlink-ib")  # 8 ranks per node, 9x slower between
    plan = select.plan_for(Collective.ALLREDUCE, 256 << 20, 16, topology=nvlink_ib, itemsize=4)
    assert plan.algorithm == "hierarchical", plan.describe()
    one_node = select.plan_for(Collective.ALLREDUCE, 256 << 20, 8, topology=nvlink_ib,
                               itemsize=4)
    assert "hierarchical" not in {c.algorithm for c in one_node.candidates}
    # the same schedule costs more when its inter-node links are slower
    schedule = algorithms.build("hierarchical", Collective.ALLREDUCE, 16, ranks_per_node=8)
    slower = model.Topology(**{**nvlink_ib.__dict__, "inter": model.Link(8e-6, 1e-10)})
    assert model.predict(schedule, 1 << 26, slower).seconds > model.predict(
        schedule, 1 << 26, nvlink_ib).seconds


def test_auto_may_choose_hierarchical_in_a_run(monkeypatch, tmp_path):
    monkeypatch.setenv("PYCOLL_RANKS_PER_NODE", "2")
    monkeypatch.setenv(model.TUNING_ENV, str(tmp_path / "none.json"))  # the defaults only
    monkeypatch.setitem(select.DEFAULTS, "local", model.Topology(
        name="slow network", intra=model.Link(1e-6, 1e-11), inter=model.Link(1e-4, 1e-8)))
    xs = [np.full(4096, r, np.int64) for r in range(8)]

    def run():
        comm = pycoll.world()
        comm.topologies.clear()
        return (pycoll.plan("allreduce", xs[0].nbytes).algorithm,
                pycoll.allreduce(xs[comm.rank]))

    results = pycoll.run_local(8, run)
    assert {algorithm for algorithm, _ in results} == {"hierarchical"}
    assert all(np.array_equal(total, sum(xs)) for _, total in results)


@pytest.mark.parametrize("nranks,per_node", [(4, 2), (6, 3)])
def test_device_arrays_over_peer_memory_within_and_staged_messages_between(
        monkeypatch, nranks, per_node):
    """On the stand-in device (tests/fake_device.py): peer memory within a simulated node,
    staged MPI between, under every hierarchical collective."""
    from fake_device import FakeDevice, device_array, host_array

    from pycoll import spaces

    monkeypatch.setenv("PYCOLL_RANKS_PER_NODE", str(per_node))
    fake = FakeDevice(seed=nranks)
    spaces.register(fake)
    try:
        xs = inputs(nranks, 2 * nranks + 1, np.float32, "sum", 3)
        counts = [len(xs[0]) // nranks + (r < len(xs[0]) % nranks) for r in range(nranks)]

        shards = [xs[r][: counts[r]] for r in range(nranks)]

        def every_collective():
            rank = pycoll.world().rank
            got = [call(c, device_array(shards[rank] if c is Collective.ALLGATHER
                                        else xs[rank]), "sum", 1, counts)
                   for c in hierarchical.SCHEDULES]
            fake.synchronize()
            return [None if g is None else host_array(g) for g in got]

        results = pycoll.run_local(nranks, every_collective)
    finally:
        spaces.unregister(fake)
    for rank, got in enumerate(results):
        for collective, value in zip(hierarchical.SCHEDULES, got):
            given = shards if collective is Collective.ALLGATHER else xs
            want = expected(collective, given, "sum", 1, counts, rank)
            assert (value is None) if want is None else np.array_equal(value, want), collective
