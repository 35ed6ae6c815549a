"""The cost model, played from the schedules' own steps, against the textbook formulas.

alpha, beta and gamma are chosen far apart (1, 1e-3, 1e-4 per message, byte, reduced byte)
so that a wrong count of rounds, bytes or reductions cannot hide in another term; sizes divide
evenly so the formulas are exact.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from pycoll import algorithms, model, scaling
from pycoll.schedule import Collective

A, B, G = 1.0, 1e-3, 1e-4
SINGLE = model.Topology(intra=model.Link(A, B), inter=model.Link(A, B), gamma=G, delta=0.0)
MULTI = model.Topology(
    intra=model.Link(A, B), inter=model.Link(A, B), gamma=G, delta=0.0, ports="multi"
)
RANKS = list(range(2, 65))
SOME = [2, 3, 4, 5, 7, 8, 11, 13, 16, 17, 24, 31, 32, 33, 47, 63, 64]  # every kind of p
POWERS = [2, 4, 8, 16, 32, 64]


def seconds(family, collective, p, n, topology=SINGLE, segments=1, root=0):
    rooted = collective in (Collective.BROADCAST, Collective.REDUCE)
    schedule = algorithms.build(family, collective, p, segments, root if rooted else None)
    return model.predict(schedule, n, topology).seconds


def size(p, segments=1):
    return p * segments * 240  # divides into every block and segment


@pytest.mark.parametrize("p", RANKS)
def test_ring_allreduce(p):
    n = size(p)
    want = 2 * (p - 1) * A + 2 * (p - 1) / p * n * B + (p - 1) / p * n * G
    assert seconds("ring", Collective.ALLREDUCE, p, n) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("p", SOME)
@pytest.mark.parametrize("segments", [1, 4])
def test_ring_reduce_scatter_and_allgather(p, segments):
    n = size(p, segments)
    rs = segments * (p - 1) * A + (p - 1) / p * n * (B + G)
    ag = segments * (p - 1) * A + (p - 1) / p * n * B
    got_rs = seconds("ring", Collective.REDUCE_SCATTER, p, n, segments=segments)
    got_ag = seconds("ring", Collective.ALLGATHER, p, n, segments=segments)
    assert got_rs == pytest.approx(rs, rel=1e-12)
    assert got_ag == pytest.approx(ag, rel=1e-12)


@pytest.mark.parametrize("p", POWERS)
def test_rabenseifner_and_recursive_halving_doubling(p):
    n, lg = size(p), int(math.log2(p))
    allreduce = 2 * lg * A + 2 * (p - 1) / p * n * B + (p - 1) / p * n * G
    halving = lg * A + (p - 1) / p * n * (B + G)
    doubling = lg * A + (p - 1) / p * n * B
    family = "halving_doubling"
    assert seconds(family, Collective.ALLREDUCE, p, n) == pytest.approx(allreduce, rel=1e-12)
    assert seconds(family, Collective.REDUCE_SCATTER, p, n) == pytest.approx(halving, rel=1e-12)
    assert seconds(family, Collective.ALLGATHER, p, n) == pytest.approx(doubling, rel=1e-12)


@pytest.mark.parametrize("p", [p for p in SOME if p not in POWERS])
def test_halving_doubling_folds_other_rank_counts_within_its_bound(p):
    """Two fold rounds and uneven halving rounds: the module's stated upper bound, which
    counts alpha per round (a link per peer)."""
    n = size(p)
    low = 2 ** int(math.log2(p))
    lg, rem = int(math.log2(low)), p - low
    extra = sum(min(d, rem) for d in (low >> k for k in range(1, lg + 1)))
    bound = (lg + 2) * A + (p + low - 1 + extra) / p * n * (B + G)
    power = lg * A + (p - 1) / p * n * (B + G)
    got = seconds("halving_doubling", Collective.REDUCE_SCATTER, p, n, MULTI)
    assert power < got <= bound * (1 + 1e-12)


@pytest.mark.parametrize("p", SOME)
def test_binomial_broadcast_and_reduce(p):
    n, lg = size(p), math.ceil(math.log2(p))
    for root in sorted({0, p // 2, p - 1}):
        got_b = seconds("tree", Collective.BROADCAST, p, n, root=root)
        got_r = seconds("tree", Collective.REDUCE, p, n, root=root)
        assert got_b == pytest.approx(lg * (A + n * B), rel=1e-12)
        assert got_r == pytest.approx(lg * (A + n * B + n * G), rel=1e-12)


@pytest.mark.parametrize("p", SOME[::2])
@pytest.mark.parametrize("segments", [2, 8])
def test_pipelined_binomial_broadcast_with_a_link_per_peer(p, segments):
    n, lg = size(p, segments), math.ceil(math.log2(p))
    want = (lg + segments - 1) * (A + n / segments * B)
    got = seconds("tree", Collective.BROADCAST, p, n, MULTI, segments)
    assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("p", SOME)
def test_direct_schedules(p):
    n = size(p)
    """A rank's p-1 messages share its port: (p-1) alphas; with a link per peer, one."""
    assert seconds("direct", Collective.ALLREDUCE, p, n) == pytest.approx(
        (p - 1) * (A + n * B) + (p - 1) * n * G, rel=1e-12
    )
    assert seconds("direct", Collective.REDUCE_SCATTER, p, n) == pytest.approx(
        (p - 1) * A + (p - 1) / p * n * (B + G), rel=1e-12
    )
    assert seconds("direct", Collective.ALLGATHER, p, n) == pytest.approx(
        (p - 1) * A + (p - 1) / p * n * B, rel=1e-12
    )
    assert seconds("direct", Collective.ALLREDUCE, p, n, MULTI) == pytest.approx(
        A + n * B + (p - 1) * n * G, rel=1e-12
    )


@pytest.mark.parametrize("p", SOME[::2])
@pytest.mark.parametrize("segments", [1, 4, 16])
def test_pipelined_double_binary_tree_between_its_bounds(p, segments):
    """The tree module's bound, (2H+S-1)(alpha + 2n/S beta) + (H+S-1) n/S gamma, counts alpha
    per round (a link per peer); with one port a round pays an alpha per message, up to four.
    At least: the rounds' alphas, and with one port the busiest rank's bytes."""
    n, h = size(p, 2 * segments), math.ceil(math.log2(p))
    rounds = 2 * h + segments - 1
    bytes_term = 2 * n / segments * B
    reduce_term = (h + segments - 1) * (n / segments * G)
    multi = seconds("tree", Collective.ALLREDUCE, p, n, MULTI, segments)
    single = seconds("tree", Collective.ALLREDUCE, p, n, segments=segments)
    assert rounds * A <= multi <= (rounds * (A + bytes_term) + reduce_term) * (1 + 1e-12)
    assert single <= (rounds * (4 * A + bytes_term) + reduce_term) * (1 + 1e-12)
    assert single >= rounds * A + 2 * (p - 1) / p * n * B


def test_tree_beats_ring_on_latency_and_ring_wins_on_bandwidth():
    p = 64
    small, large = size(p), size(p) * 4096
    fast = model.Topology(intra=model.Link(1e-5, 1e-10), gamma=1e-11, delta=0.0)
    assert seconds("tree", Collective.ALLREDUCE, p, small, fast) < seconds(
        "ring", Collective.ALLREDUCE, p, small, fast
    )
    assert seconds("ring", Collective.ALLREDUCE, p, large, fast) < seconds(
        "tree", Collective.ALLREDUCE, p, large, fast
    )


def test_links_between_nodes_cost_their_own_class():
    slow = model.Topology(
        intra=model.Link(A, B), inter=model.Link(10 * A, 10 * B), gamma=G, delta=0.0,
        ranks_per_node=2,
    )
    n, p = size(4), 4
    within = seconds("ring", Collective.ALLREDUCE, 2, size(2), slow)
    across = seconds("ring", Collective.ALLREDUCE, p, n, slow)
    # every ring step of 4 ranks on 2 nodes waits for a link between nodes
    assert across == pytest.approx(2 * (p - 1) * 10 * A + 2 * (p - 1) / p * n * 10 * B
                                   + (p - 1) / p * n * G, rel=1e-12)
    assert within == pytest.approx(2 * A + size(2) * B + size(2) / 2 * G, rel=1e-12)


@pytest.mark.parametrize("family", ["ring", "tree", "direct", "halving_doubling"])
def test_a_node_map_prices_links_as_ranks_per_node_does(family):
    """Uneven or scattered nodes are priced by each rank's node (``nodes``): for a regular
    layout the map gives what ranks_per_node gives; for 5 ranks on nodes of 2, 2 and 1 the
    links between nodes cost theirs (the model took every link as within a node)."""
    slow = model.Topology(intra=model.Link(A, B), inter=model.Link(10 * A, 10 * B), gamma=G,
                          delta=0.0)
    regular = replace(slow, ranks_per_node=2)
    mapped = replace(slow, nodes=(0, 0, 1, 1, 2, 2))
    for collective in (Collective.ALLREDUCE, Collective.ALLGATHER):
        n = size(6)
        assert model.seconds(collective, family, 6, 1, None, n, mapped, 4) == pytest.approx(
            model.seconds(collective, family, 6, 1, None, n, regular, 4), rel=1e-12)
        uneven = replace(slow, nodes=(0, 0, 1, 1, 2))
        flat = model.seconds(collective, family, 5, 1, None, size(5), slow, 4)
        across = model.seconds(collective, family, 5, 1, None, size(5), uneven, 4)
        full = model.play(model.programs(algorithms.build(family, collective, 5, 1, None),
                                         size(5)), uneven, 4).seconds
        assert across == pytest.approx(full, rel=1e-12) and across > flat


def test_seed_copies_cost_delta_per_byte():
    copying = model.Topology(intra=model.Link(0.0, 0.0), gamma=0.0, delta=1.0)
    # ring AllReduce copies nothing (its first send reads INPUT); AllGather its own shard
    assert seconds("ring", Collective.ALLREDUCE, 4, 400, copying) == 0
    assert seconds("ring", Collective.ALLGATHER, 4, 400, copying) == 100


def test_segment_choices_keep_chunks_of_four_elements_and_follow_the_topology():
    assert model.segment_choices(1 << 20, 4, model.Topology()) == model.SEGMENT_CHOICES
    assert model.segment_choices(64, 4, model.Topology()) == (1, 2, 4)
    assert model.segment_choices(1, 4, model.Topology()) == (1,)
    assert model.segment_choices(1 << 20, 4, model.Topology(segments=False)) == (1,)


def test_topology_files_round_trip_and_reject_unknown_keys(tmp_path):
    topology = model.Topology(name="x", ranks_per_node=8, ports="multi")
    again = model.Topology.from_json(topology.to_json(), source="file")
    assert again == model.Topology(name="x", ranks_per_node=8, ports="multi", source="file")
    with pytest.raises(ValueError, match="unknown keys \\['speed'\\]"):
        model.Topology.from_json({"speed": 1})
    # the curves' per-cost fields come from "curves" (as a list they made every call raise
    # TypeError: unhashable type: 'list'); a curve at 0 bytes divided by zero in every plan
    for bad, says in [({"gamma_curve": [[1, 2.0]]}, "unknown keys \\['gamma_curve'\\]"),
                      ({"curves": {"gama": [[8, 1.0]]}}, "curves\\['gama'\\] is unknown"),
                      ({"curves": {"gamma": [[0, 1.0]]}}, "bytes >= 1, costs >= 0"),
                      ({"curves": {"delta": [[8, -1.0]]}}, "bytes >= 1, costs >= 0"),
                      ({"curves": {"intra": []}}, "a list of \\[bytes, cost\\] pairs"),
                      ({"curves": {"inter": 5}}, "allowed: an object of the keys")]:
        with pytest.raises(ValueError, match=says):
            model.Topology.from_json(bad, source="file")
    curved = model.Topology.from_json({"curves": {"gamma": [[64, 2.0], [8, 1.0]]}})
    assert curved.curves == (("gamma", ((8, 1.0), (64, 2.0))),)
    path = tmp_path / "bad.json"
    path.write_text("{")
    with pytest.raises(ValueError, match="unreadable"):
        model.load_tuning(path)
    good = tmp_path / "tuning.json"
    model.save_tuning([("mpi", replace(topology, nranks=2))], good)
    model.save_tuning([("mpi", replace(topology, nranks=4)), ("local", model.Topology())], good)
    model.save_tuning([("mpi", replace(topology, nranks=4, ports="single"))], good)  # replaces
    loaded = model.load_tuning(good)
    assert set(loaded) == {"mpi", "local"}
    assert [(t.nranks, t.ports) for t in loaded["mpi"]] == [(2, "multi"), (4, "single")]
    assert model.nearest(loaded["mpi"], 3).nranks == 4
    assert model.nearest(loaded["mpi"], 2).nranks == 2
    assert model.nearest(loaded["mpi"], 64).nranks == 4 and model.nearest([], 4) is None
    misspelt = tmp_path / "misspelt.json"
    misspelt.write_text(json.dumps({"transports": {"shmm": [topology.to_json()]}}))
    with pytest.raises(ValueError, match=f"tuning file {misspelt}: transports \\['shmm'\\] "
                                         "unknown; allowed: local, mpi, shm, cuda; run `pycoll "
                                         "tune` to rewrite it"):
        model.load_tuning(misspelt)
    from pycoll import select

    assert set(select.DEFAULTS) == set(model.TRANSPORT_KINDS)


LOCAL = {"nranks": 2, "intra": {"alpha": 1e-6, "beta": 1e-9}}  # one valid entry


@pytest.mark.parametrize("transports,fits,says", [
    # not an object: AttributeError: 'str' object has no attribute 'get' (a traceback)
    ({"local": ["str"]}, None, "[local, ? ranks]: 'str' is not a JSON object"),
    ({"local": [None]}, None, "[local, ? ranks]: None is not a JSON object"),
    ({"local": "abc"}, None, "[local, ? ranks]: 'abc' is not a JSON object"),  # not 'a'
    ({"local": [{**LOCAL, "ports": 3}]}, None, "[local, 2 ranks]: ports=3; allowed: "),
    # float() read them as costs; a name or source of any type was kept
    ({"local": [{**LOCAL, "intra": {"alpha": "1e-6", "beta": 1e-9}}]}, None,
     "[local, 2 ranks]: intra.alpha='1e-6'; allowed: a number >= 0"),
    ({"local": [{**LOCAL, "inter": {"alpha": 1e-6, "beta": True}}]}, None,
     "[local, 2 ranks]: inter.beta=True; allowed: a number >= 0"),
    ({"local": [{**LOCAL, "intra": [1e-6, 1e-9]}]}, None,
     "intra=[1e-06, 1e-09]; allowed: an object with numbers alpha and beta"),
    ({"local": [{**LOCAL, "gamma": True}]}, None, "gamma=True; allowed: a number >= 0"),
    ({"local": [{**LOCAL, "name": 5}]}, None, "[local, 2 ranks]: name=5; allowed: a string"),
    ({"local": [{**LOCAL, "source": 7}]}, None, "source=7; allowed: a string"),
    ({"local": [{**LOCAL, "segments": "no"}]}, None, "segments='no'; allowed: true or false"),
    ({"local": [{**LOCAL, "curves": {"gamma": [["8", 1e-9]]}}]}, None,
     "curves['gamma']=[['8', 1e-09]]; allowed: a list of [bytes, cost] pairs of numbers"),
    # pycoll tune failed on it as on an unreadable file, naming neither file nor field
    ({"local": [LOCAL]}, "x", ": fits='x'; allowed: an object of each tuning's fits"),
])
def test_a_bad_tuning_file_is_refused_naming_the_file_the_field_and_the_value(
        tmp_path, transports, fits, says):
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"transports": transports} | ({"fits": fits} if fits else {})))
    with pytest.raises(ValueError) as refused:
        model.load_tuning(path)
    assert str(path) in str(refused.value) and says in str(refused.value)


# --- rank 0 alone for a symmetric schedule --------------------------------------------------

NODES = replace(SINGLE, inter=model.Link(3 * A, 5 * B), ranks_per_node=4)  # two link classes


def _every_rank(collective, family, p, segments, count, topology):
    schedule = algorithms.build(family, collective, p, segments,
                                ranks_per_node=topology.ranks_per_node)
    return model.play(model.programs(schedule, count), topology, 4).seconds


@pytest.mark.parametrize("family,collective", [
    (family, collective) for family, collectives in model.SYMMETRIC.items()
    for collective in sorted(collectives, key=lambda c: c.value)])
def test_one_rank_prices_a_symmetric_schedule_as_every_rank_does(family, collective):
    """What makes pricing 64 ranks take seconds, not minutes: rank 0's steps alone, played
    in lockstep, where that equals the play of every rank (on part-filled nodes or with
    uneven chunks ``model.seconds`` plays every rank, so it must agree everywhere)."""
    topologies = (SINGLE, MULTI, NODES, replace(NODES, ranks_per_node=1),
                  scaling.builtin_topologies()["nvlink-ib"].with_curves())
    alone = 0
    for p in (1, 2, 3, 5, 8, 12):  # NODES: 5 fills one node in part, 12 three nodes whole
        for topology in topologies:
            for segments in (1, 3):
                try:
                    nchunks = model.chunks_of(collective, family, p, segments, None,
                                              topology.ranks_per_node)
                except ValueError:
                    nchunks = 1
                for count in (5 * nchunks, 5 * nchunks + 1, 2):
                    try:
                        full = _every_rank(collective, family, p, segments, count, topology)
                    except ValueError:  # hierarchical on part-filled nodes: no schedule
                        with pytest.raises(ValueError, match="does not divide"):
                            model.seconds(collective, family, p, segments, None, count,
                                          topology, 4)
                        continue
                    fast = model.seconds(collective, family, p, segments, None, count,
                                         topology, 4)
                    assert fast == pytest.approx(full, rel=1e-12), (p, topology.name, count)
                    alone += model.symmetric(collective, family, p, topology.ranks_per_node)
    assert alone > 0


def test_a_symmetric_schedule_is_priced_without_building_every_rank(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("built every rank's steps")

    monkeypatch.setattr(algorithms, "build", refused)
    for family in ("ring", "direct", "halving_doubling", "two_shot"):
        p = 256
        t = model.seconds(Collective.ALLREDUCE, family, p, 1, None, p * 64, SINGLE, 4)
        assert t > 0
    # a part-filled node is not symmetric: every rank is played
    with pytest.raises(AssertionError, match="every rank"):
        model.seconds(Collective.ALLREDUCE, "ring", 6, 1, None, 6 * 64, NODES, 4)
