"""Which algorithm serves a call, and in how many segments: the one place for these choices.

"auto" takes the (family, segment count) with the lowest time that the cost model
(:mod:`pycoll.model`) predicts for the call's collective, size and rank count on the
communicator's topology: the tuning file that ``pycoll tune`` wrote for this kind of
transport, else built-in defaults. ``PYCOLL_ALGO`` forces a family, for every collective
(``tree``) or per collective (``allreduce:tree,reduce_scatter:ring``); ``algorithm=`` in a
call forces one for that call (the model then picks only its segment count);
``PYCOLL_SEGMENTS`` forces the segment count. ``PYCOLL_DEBUG=1`` logs every call's choice.
``PYCOLL_ALGO`` is read when a communicator first prepares a call shape; ``PYCOLL_SEGMENTS``
and ``PYCOLL_DEBUG`` when pycoll is imported: set them before (a bad value is raised when a
communicator is made).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from dataclasses import dataclass, replace

from pycoll import agree, model
from pycoll.algorithms import FAMILIES, families_for, node_aware
from pycoll.schedule import ROOTED, Collective
from pycoll.settings import switch, whole_number

ALGO_ENV = "PYCOLL_ALGO"


MAX_SEGMENTS = 1024  # PYCOLL_SEGMENTS's: 10**8 took 32 s to plan a 4000-element call


def _segments_from_env() -> int | None:
    return whole_number("PYCOLL_SEGMENTS", 1, MAX_SEGMENTS)


def _settings_from_env() -> tuple[int | None, bool, str | None]:
    """PYCOLL_SEGMENTS and PYCOLL_DEBUG, and what is wrong with them (None: nothing)."""
    try:
        return _segments_from_env(), bool(switch("PYCOLL_DEBUG", False)), None
    except ValueError as error:
        return None, False, str(error)


# Read at import, as every call reads them. FORCED_SEGMENTS forces every schedule to that many
# segments (tests, `pycoll explain --segments`); None: the model's. A bad value is raised where
# a communicator is made (check_settings), not here: `import pycoll` and `pycoll --help` stand.
FORCED_SEGMENTS, DEBUG, SETTINGS_ERROR = _settings_from_env()


def check_settings() -> None:
    """Raise the error of a bad PYCOLL_SEGMENTS or PYCOLL_DEBUG read at import."""
    if SETTINGS_ERROR is not None:
        raise ValueError(SETTINGS_ERROR)
log = logging.getLogger("pycoll")

# Built-in costs per kind of transport, until `pycoll tune` measures this machine's. They
# only rank the candidates; rough is fine.
DEFAULTS = {
    "local": model.Topology(
        name="in-process threads", intra=model.Link(25e-6, 1 / 4e9), gamma=1 / 2e9,
        delta=1 / 8e9,
    ),
    "mpi": model.Topology(
        name="MPI", intra=model.Link(8e-6, 1 / 4e9), inter=model.Link(15e-6, 1 / 10e9),
        gamma=1 / 2e9, delta=1 / 8e9,
    ),
    # a step's messages all progress at once in one polling loop: alpha once per step; long
    # messages are pipelined by the transport itself, so no segments
    "shm": model.Topology(
        name="shared memory", intra=model.Link(4e-6, 1 / 10e9), inter=model.Link(15e-6, 1 / 10e9),
        gamma=1 / 4e9, delta=1 / 10e9, ports="multi", segments=False,
    ),
    "cuda": model.Topology(
        name="CUDA peer memory", intra=model.Link(30e-6, 1 / 1.5e12),
        inter=model.Link(30e-6, 1 / 40e9), gamma=1 / 1.5e12, delta=1 / 2e12,
    ),
}


@dataclass(frozen=True)
class Plan:
    """The choice for one call: the family, its segment count, why, and what the model
    predicted for it and for every other candidate (fastest first; seconds)."""

    collective: Collective
    nbytes: int
    nranks: int
    algorithm: str
    nsegments: int
    predicted: float
    reason: str
    candidates: tuple[model.Candidate, ...] = ()
    topology: str = ""

    def describe(self) -> str:
        others = ", ".join(
            f"{c.algorithm}x{c.nsegments} {c.seconds * 1e6:.1f}" for c in self.candidates[:6]
        )
        return (
            f"{self.collective.value} {self.nbytes} B on {self.nranks} ranks: "
            f"{self.algorithm} x{self.nsegments} segments, predicted "
            f"{self.predicted * 1e6:.1f} us ({self.reason}; {self.topology}); "
            f"candidates (us): {others}"
        )


def forced_algorithm(collective: Collective) -> str | None:
    """The family ``PYCOLL_ALGO`` forces for ``collective``, or None."""
    text = os.environ.get(ALGO_ENV, "").strip()
    if not text:
        return None
    forced = None
    seen: set[str] = set()
    for part in text.split(","):
        part = part.strip()
        name, _, family = part.rpartition(":")
        if name and name not in {c.value for c in Collective}:
            raise ValueError(
                f"{ALGO_ENV}={text!r}: {name!r} is not a collective; allowed: a family name, "
                "or collective:family pairs such as allreduce:tree,reduce_scatter:ring"
            )
        if not family:
            raise ValueError(f"{ALGO_ENV}={text!r}: empty family in {part!r}")
        if family not in FAMILIES:  # (alltoall, which has one family, ignored a typo)
            raise ValueError(f"{ALGO_ENV}={text!r}: {family!r} is not an algorithm family; "
                             f"allowed: {', '.join(FAMILIES)}")
        if name in seen:  # which one would win is no choice a user made
            raise ValueError(f"{ALGO_ENV}={text!r} names {name or 'the default'} twice; "
                             "allowed: once")
        seen.add(name)
        if name and families_for(Collective(name)) == ["direct"] and family != "direct":
            # the bare form forces collectives that have a choice; this one has none
            raise ValueError(f"{ALGO_ENV}={text!r} forces {family!r} for {name}, which it "
                             f"cannot serve; allowed for {name}: direct")
        if name == collective.value or (not name and forced is None):
            forced = family
    return forced


def check_forced(collective: Collective) -> str | None:
    """``forced_algorithm``, and an error if the family it forces has no schedule for
    ``collective`` (what an ``auto`` call of it raises; the command line asks first)."""
    forced = forced_algorithm(collective)
    allowed = families_for(collective)
    if forced is not None and forced not in allowed:
        raise ValueError(
            f"{ALGO_ENV} forces {forced!r} for {collective.value}, which it cannot "
            f"serve; allowed for {collective.value}: {', '.join(allowed)}"
        )
    return forced


def plan_for(
    collective: Collective,
    nbytes: int,
    nranks: int,
    algorithm: str = "auto",
    topology: model.Topology | None = None,
    itemsize: int = 1,
    root: int | None = None,
) -> Plan:
    """The family and segment count for ``collective`` on ``nbytes`` over ``nranks`` ranks."""
    topology = (DEFAULTS["local"] if topology is None else topology).with_curves()
    reason = "lowest predicted time"
    families = None
    if algorithm == "auto":
        forced = check_forced(collective)
        if forced is not None:
            families, reason = [forced], f"forced by {ALGO_ENV}"
    else:
        families, reason = [algorithm], f"algorithm={algorithm!r}"
    if families is not None and node_aware(families[0]) and not spans_nodes(topology, nranks):
        reason += ", run as its flat schedule (the ranks are not in several equal nodes)"
    segments = None
    if FORCED_SEGMENTS is not None:
        # more segments than elements add only empty messages (100 000 took a minute)
        segments = (min(FORCED_SEGMENTS, max(1, nbytes // itemsize)),)
        reason += f", PYCOLL_SEGMENTS={FORCED_SEGMENTS}"
        if segments[0] < FORCED_SEGMENTS:
            reason += f" (at most one per element: {segments[0]})"
    found = rank_candidates(collective, nbytes, nranks, topology, itemsize, root, families,
                            segments)
    best = found[0]
    return Plan(collective, nbytes, nranks, best.algorithm, best.nsegments, best.seconds,
                reason, tuple(found), topology.name)


def rank_candidates(
    collective: Collective,
    nbytes: int,
    nranks: int,
    topology: model.Topology,
    itemsize: int = 1,
    root: int | None = None,
    families: list[str] | None = None,
    segments: tuple[int, ...] | None = None,
) -> list[model.Candidate]:
    """Every (family, segments) serving the call with its predicted time, fastest first."""
    count = nbytes // itemsize
    root = (root or 0) if collective in ROOTED else None
    out = []
    for family in families or families_for(collective):
        if families is None and node_aware(family) and not spans_nodes(topology, nranks):
            continue  # on one node it is a flat ring or tree under another name
        priced = set()
        for nsegments in segments or model.segment_choices(count, nranks, topology):
            seconds = estimate(collective, family, nranks, nsegments, root, topology, itemsize,
                               count)
            if seconds not in priced:  # segments that change nothing (a family that does not
                out.append(model.Candidate(family, nsegments, seconds))  # pipeline): listed once
            priced.add(seconds)
    if not out:
        raise ValueError(f"no algorithm serves {collective.value}")
    return sorted(out, key=lambda c: (c.seconds, c.nsegments, c.algorithm))


def estimate(collective, family, nranks, nsegments, root, topology, itemsize, count) -> float:
    """The model's time for ``count`` elements, from exact plays (cached): up to 64 elements
    per chunk, linear between the chunk count's multiples around ``count`` (exact below one
    element per chunk); above, linear between the chunk count's multiples by powers of two
    around it. So a size sweep plays each schedule about once per size, whatever the rank
    count, and a new size costs about a millisecond to plan (a symmetric schedule is played
    on one rank: ``model.seconds``)."""
    with _PRICING:
        return _estimate(collective, family, nranks, nsegments, root, topology, itemsize,
                         count)


# In-process ranks price the same calls at once: one thread at a time, so that the others
# find what it priced in the caches (33 ranks each pricing their first plan took 15 s, not 1)
_PRICING = threading.RLock()


def _estimate(collective, family, nranks, nsegments, root, topology, itemsize, count) -> float:
    key = (collective, family, nranks, nsegments, root, topology.ranks_per_node)
    nchunks = model.chunks_of(collective, family, nranks, nsegments, root,
                              topology.ranks_per_node)
    if count <= 64 * nchunks:
        # the chunk count's multiples: an exact play per count cost each new size 41 ms at 5
        # ranks, 124 ms at 8 (every rank's program compiled for each family and segments)
        low, width = count - count % nchunks, nchunks
    else:
        # even chunks at both ends where nchunks is a power of two: the powers of two
        unit = (nchunks if model.symmetric(collective, family, nranks, topology.ranks_per_node)
                else 1)
        low = width = unit << ((count // unit).bit_length() - 1)
    if low == count or low == 0:
        return _exact(key, topology, itemsize, count)
    t_low = _exact(key, topology, itemsize, low)
    t_high = _exact(key, topology, itemsize, low + width)
    return t_low + (t_high - t_low) * (count - low) / width


@functools.lru_cache(maxsize=8192)
def _exact(key: tuple, topology: model.Topology, itemsize: int, count: int) -> float:
    collective, family, nranks, nsegments, root, _ = key
    return model.seconds(collective, family, nranks, nsegments, root, count, topology, itemsize)


def topology_for(comm, space, alone: bool = False) -> model.Topology:
    """The costs for ``comm``'s transport to ``space``'s arrays: tuned (at the nearest rank
    count), else the defaults. Under MPI rank 0 reads the tuning file and every rank uses its
    copy, so that all ranks choose alike; ``alone``: this rank is asking on its own (no
    broadcast: it reads the file itself, unless the agreed costs are known already)."""
    kind = "cuda" if space.is_device else comm.host_kind()
    cached = comm.topologies.get(kind)
    if cached is not None:
        return cached
    if comm.mpi_comm is not None and not alone:
        # every rank together: host arrays' first call makes the host transport (whatever
        # its path, the one-shot's too), which shares rank 0's costs; device arrays' shares
        # them alone (a device-only program makes no shared memory for host arrays)
        if kind != "cuda":
            comm.host_transport()
            kind = comm.host_kind()  # "mpi" where a node lacked the shared memory
        if kind not in comm.topologies:  # the device's first call, or costs since cleared
            comm.share_costs()
        return comm.topologies[kind]
    try:
        tunings = model.load_tuning()
    except ValueError as unreadable:  # in-process, every rank reads the same file
        raise (unreadable if alone else agree.AgreedError(str(unreadable))) from None
    topology = _costs(model.nearest(tunings.get(kind, []), comm.size), kind, comm)
    if not alone:  # in-process: every rank reads the same file
        comm.topologies[kind] = topology
    return topology


def share_tuning(comm) -> None:
    """Under MPI, rank 0's tuned costs for ``comm``'s host arrays and for device arrays,
    kept on every rank so that all choose alike. Collective: called as the host transport is
    made, in each rank's first collective whatever path it takes (a broadcast at the first
    scheduled call waited forever for ranks whose first call took the one-shot)."""
    kinds = (comm.host_kind(), "cuda")
    found: dict | str | None = None
    if comm.rank == 0:
        try:
            tunings = model.load_tuning()
            found = {kind: model.nearest(tunings.get(kind, []), comm.size) for kind in kinds}
        except ValueError as error:  # an unreadable file: every rank raises it
            found = str(error)
    found = comm.transport.comm.bcast(found, root=0)
    if isinstance(found, str):
        raise agree.AgreedError(found)
    for kind in kinds:
        comm.topologies[kind] = _costs(found[kind], kind, comm)


def _costs(tuned: model.Topology | None, kind: str, comm) -> model.Topology:
    """The tuned costs, else the defaults, on the ranks' actual nodes (which links are
    between nodes, and whether hierarchical schedules apply)."""
    nodes = comm.nodes()
    uneven = comm.ranks_per_node == 0 and len(set(nodes)) > 1
    return replace(tuned or DEFAULTS[kind], ranks_per_node=comm.ranks_per_node,
                   nodes=tuple(nodes) if uneven else ())


def spans_nodes(topology: model.Topology, nranks: int) -> bool:
    """Whether ``topology`` puts ``nranks`` ranks in several equal nodes."""
    k = topology.ranks_per_node
    return 0 < k < nranks and nranks % k == 0


def report(plan: Plan, rank: int) -> None:
    """The PYCOLL_DEBUG line for one call."""
    log.warning("pycoll: rank %d %s", rank, plan.describe())


# What auto runs for small host calls when every rank shares a node (pycoll/api.py's
# one-shot): no schedule, so no plan of its own.
ONE_SHOT = "one_shot"
ONE_SHOT_REASON = ("every rank on one node, a small call: every rank's input through the "
                   "shared-memory slots in one shot, no schedule")


def report_one_shot(collective: str, nbytes: int, nranks: int, rank: int) -> None:
    """The PYCOLL_DEBUG line for a call the one-shot served."""
    log.warning("pycoll: rank %d %s %d B on %d ranks: %s (%s)", rank, collective, nbytes,
                nranks, ONE_SHOT, ONE_SHOT_REASON)
