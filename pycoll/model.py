"""The cost of a schedule under a topology, computed from the schedule's own steps.

Nothing here restates an algorithm: :func:`predict` compiles every rank's program exactly as
the executor does (the same element ranges, the same deferred seed copies, the same dropped
empty transfers), pairs each send with its receive in posting order, and plays the steps
under the transports' rendezvous rule: a transfer starts once both ranks have reached the
steps that hold it, and a rank leaves a step when all of its transfers are done and its
reductions ran. So a change to a schedule changes its predicted cost with it.

One step of a rank costs (the LogGP-style model of Thakur, Rabenseifner & Gropp 2005)

    alpha + beta * bytes + gamma * reduced bytes

* ``alpha``: per message; a step's messages share the rank's port as its bytes do, so a step
  pays alpha for each message in its busier direction (with ``ports="multi"``, once);
* ``beta``: per byte per link class (``intra`` within a node, ``inter`` between nodes). With
  ``ports="single"`` (the default: a host's memory bus, a GPU's NVLink port, a node's NIC) a
  rank's bytes in one direction share one port per link class, so the step moves the larger of
  the bytes it sends and receives; with ``ports="multi"`` every peer has a link of its own and
  the largest message counts (the figure some textbook formulas quote);
* ``gamma``: per reduced byte (the reductions of a step run one after another, after it);
* ``delta``: per byte copied locally (the seed copies before the first step);
* ``call``: once per call. With measured curves (``Topology.curves``), each per-byte cost is
  read at the size of the operation it prices: the message, the reduction, the copy.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from pycoll import algorithms
from pycoll.execute import Program, compile_program
from pycoll.schedule import Collective, Layout, Schedule, building_only, split


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds per message
    beta: float  # seconds per byte
    # measured seconds per byte by message size, ((bytes, seconds per byte), ...): large
    # messages leave the caches, so they move slower per byte; empty: beta at every size
    curve: tuple = ()

    def per_byte(self, nbytes: int) -> float:
        return _interpolate(self.curve, nbytes) if self.curve else self.beta


@dataclass(frozen=True)
class Topology:
    """Where ranks sit and what their links cost."""

    name: str = "default"
    intra: Link = Link(20e-6, 1 / 5e9)
    inter: Link = Link(20e-6, 1 / 5e9)
    gamma: float = 1 / 5e9  # seconds per reduced byte
    delta: float = 1 / 10e9  # seconds per locally copied byte
    call: float = 0.0  # seconds per call, before any message (validation, lookup, launch)
    ranks_per_node: int = 0  # 0: every rank on one node (unless ``nodes`` says otherwise)
    # Each rank's node where the layout is not k consecutive ranks a node (uneven or
    # scattered nodes, ranks_per_node 0): the communicator's, not the costs' (not written)
    nodes: tuple[int, ...] = ()
    ports: str = "single"  # "single" or "multi"
    nranks: int = 0  # the rank count these costs were measured at (0: any)
    # False where the transport already pipelines a long message (pieces through shared
    # memory, reads from the sender's memory): segments would only add steps
    segments: bool = True
    source: str = "built-in defaults"
    # Measured per-byte costs by size, (name, ((bytes, seconds per byte), ...)), for name in
    # intra, inter (per message), gamma (per reduction), delta (per copy): a cache holds a
    # small operand, memory a large one, so per-byte costs depend on the size.
    curves: tuple = ()
    gamma_curve: tuple = ()  # filled in by ``at`` from ``curves``
    delta_curve: tuple = ()

    def reduce_seconds(self, nbytes: int) -> float:
        per_byte = _interpolate(self.gamma_curve, nbytes) if self.gamma_curve else self.gamma
        return per_byte * nbytes

    def copy_seconds(self, nbytes: int) -> float:
        per_byte = _interpolate(self.delta_curve, nbytes) if self.delta_curve else self.delta
        return per_byte * nbytes

    def same_node(self, a: int, b: int) -> bool:
        if self.nodes:
            return self.nodes[a] == self.nodes[b]
        return self.ranks_per_node <= 0 or a // self.ranks_per_node == b // self.ranks_per_node

    def link(self, a: int, b: int) -> Link:
        return self.intra if self.same_node(a, b) else self.inter

    def with_curves(self) -> Topology:
        """These costs ready to play: the measured curves attached where they are read, per
        message on the links, per reduction and per copy (log-linear between points, the
        end's value beyond the ends); without curves, unchanged."""
        if not self.curves:
            return self
        curves = dict(self.curves)
        intra = replace(self.intra, curve=curves.get("intra", ()))
        inter = replace(self.inter, curve=curves.get("inter", ()))
        return replace(self, intra=intra, inter=inter, gamma_curve=curves.get("gamma", ()),
                       delta_curve=curves.get("delta", ()), curves=())

    def to_json(self) -> dict:
        data = asdict(self)
        data.pop("nodes")  # where the ranks are, not what the links cost
        for name in ("intra", "inter"):
            data[name].pop("curve", None)
        data.pop("gamma_curve", None)
        data.pop("delta_curve", None)
        data["curves"] = {name: [list(p) for p in points] for name, points in self.curves}
        return data

    @classmethod
    def from_json(cls, data: dict, source: str = "") -> Topology:
        try:
            return cls._from_json(data, source)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            if isinstance(error, ValueError) and str(error).startswith("topology "):
                raise
            raise ValueError(
                f"topology {source or '?'}: {type(error).__name__}: {error}; allowed: an object "
                "of the keys to_json writes, intra and inter each with numbers alpha and beta, "
                "curves as [bytes, value] pairs, every cost >= 0") from None

    @classmethod
    def _from_json(cls, data: dict, source: str) -> Topology:
        if not isinstance(data, dict):
            raise ValueError(f"topology {source or '?'}: {data!r} is not a JSON object")
        # the curves' per-cost fields are filled in from ``curves`` (with_curves), not read
        known = set(cls.__dataclass_fields__) - {"gamma_curve", "delta_curve", "nodes"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"topology {source or data.get('name', '?')}: unknown keys {sorted(unknown)}; "
                f"allowed: {sorted(known)}"
            )
        values = dict(data)
        where = source or data.get("name", "?")
        curves = values.get("curves") or {}
        values["curves"] = tuple(
            (name, _curve(name, points, where)) for name, points in sorted(curves.items())
        )
        for name in ("intra", "inter"):
            link = values.get(name)
            if name in values and not isinstance(link, Link):
                if not isinstance(link, dict):
                    raise ValueError(f"topology {where}: {name}={link!r}; allowed: an object "
                                     "with numbers alpha and beta")
                for key in ("alpha", "beta"):  # float() took "1e-6" and true as costs
                    if not _is_number(link[key]):
                        raise ValueError(f"topology {where}: {name}.{key}={link[key]!r}; "
                                         "allowed: a number >= 0")
                values[name] = Link(float(link["alpha"]), float(link["beta"]))
        # a link's own curve is filled in by ``at``; files keep curves in ``curves``
        topology = cls(**values)
        for name, kind, allowed in (("name", str, "a string"), ("source", str, "a string"),
                                    ("segments", bool, "true or false")):
            if not isinstance(getattr(topology, name), kind):
                raise ValueError(f"topology {where}: {name}={getattr(topology, name)!r}; "
                                 f"allowed: {allowed}")
        if topology.ports not in ("single", "multi"):
            raise ValueError(f"topology {where}: ports={topology.ports!r}; "
                             "allowed: 'single', 'multi'")
        for name, kinds in (("ranks_per_node", int), ("nranks", int),
                            ("gamma", (int, float)), ("delta", (int, float)),
                            ("call", (int, float))):
            value = getattr(topology, name)
            if isinstance(value, bool) or not isinstance(value, kinds) or not value >= 0:
                allowed = "an int >= 0" if kinds is int else "a number >= 0"
                raise ValueError(f"topology {source or topology.name}: {name}={value!r}; "
                                 f"allowed: {allowed}")
        costs = [topology.intra.alpha, topology.intra.beta, topology.inter.alpha,
                 topology.inter.beta, topology.gamma, topology.delta]
        if any(not 0 <= cost < math.inf for cost in costs + [topology.call]):  # NaN too
            raise ValueError(f"topology {source or topology.name}: a cost below 0 or not "
                             f"finite in {costs}; allowed: finite costs >= 0 (Infinity "
                             "priced every algorithm at inf)")
        return replace(topology, source=source or topology.source)


CURVES = ("intra", "inter", "gamma", "delta")  # the costs a curve may replace


def _curve(name: str, points: list, source: str) -> tuple[tuple[int, float], ...]:
    """A curve read from a file: [bytes, cost] pairs, bytes >= 1 (interpolated on a log
    scale), costs >= 0; in order of bytes."""
    if name not in CURVES:
        raise ValueError(f"topology {source}: curves[{name!r}] is unknown; allowed: "
                         f"{', '.join(CURVES)}")
    if any(not (_is_number(b) and _is_number(v)) for b, v in points):  # not "8", not true
        raise ValueError(f"topology {source}: curves[{name!r}]={points!r}; allowed: a list "
                         "of [bytes, cost] pairs of numbers, bytes >= 1, costs >= 0")
    # bytes finite before int() (1e400 reads as inf: OverflowError)
    if not points or any(not (math.isfinite(b) and b >= 1 and math.isfinite(v) and v >= 0)
                         for b, v in points):
        raise ValueError(f"topology {source}: curves[{name!r}]={points!r}; allowed: a list "
                         "of [bytes, cost] pairs, bytes >= 1, costs >= 0")
    return tuple(sorted((int(b), float(v)) for b, v in points))


def _is_number(value: object) -> bool:
    """An int or a float, not a bool (JSON's true is no cost)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _interpolate(points: tuple[tuple[int, float], ...], size: int) -> float:
    if size <= points[0][0]:
        return points[0][1]
    for (b0, v0), (b1, v1) in zip(points, points[1:]):
        if size <= b1:
            w = math.log(size / b0) / math.log(b1 / b0)
            return v0 + w * (v1 - v0)
    return points[-1][1]


@dataclass(frozen=True)
class Prediction:
    seconds: float


@dataclass
class _Step:
    alpha: float = 0.0  # the largest alpha among the step's links
    messages_out: int = 0
    messages_in: int = 0
    sent: dict = field(default_factory=lambda: defaultdict(int))  # link -> bytes
    received: dict = field(default_factory=lambda: defaultdict(int))
    reduced: list = field(default_factory=list)  # bytes of each reduction


def programs(
    schedule: Schedule, count: int, input_counts: list[int] | None = None
) -> list[Program]:
    """Every rank's compiled program for a call of ``count`` elements (see ``program_of``)."""
    return [program_of(schedule, rank, count, input_counts) for rank in range(schedule.nranks)]


def program_of(
    schedule: Schedule, rank: int, count: int, input_counts: list[int] | None = None
) -> Program:
    """``rank``'s compiled program for a call of ``count`` elements (WORK), as the API builds
    it: even blocks of WORK; INPUT the same, or for AllGather one block of
    ``input_counts[rank]`` elements (that rank's shard); for AllToAll every rank sends
    ``count`` elements in even pieces, so rank r receives piece r of every rank."""
    work_blocks = split(count, schedule.nblocks)
    work = Layout(work_blocks, schedule.nsegments)
    source = target = work
    if schedule.collective is Collective.ALLGATHER:
        shard = work_blocks[rank] if input_counts is None else input_counts[rank]
        source = Layout([shard], schedule.nsegments)
    elif schedule.collective is Collective.ALLTOALL:
        target = Layout([work_blocks[rank]] * schedule.nblocks, schedule.nsegments)
    return compile_program(schedule, rank, source, target)


def predict(
    schedule: Schedule, nbytes: int, topology: Topology, itemsize: int = 1
) -> Prediction:
    """The predicted time of ``schedule`` on ``nbytes`` of WORK (elements of ``itemsize``)."""
    count = nbytes // itemsize
    compiled = programs(schedule, count)
    return play(compiled, topology, itemsize)


def traffic(schedule: Schedule, count: int, ranks_per_node: int, itemsize: int = 1,
            nodes: tuple[int, ...] = ()) -> list[dict[str, int]]:
    """The bytes each rank sends within its node (``intra``) and to other nodes (``inter``)
    in a call of ``count`` elements: read from the same compiled programs the model plays
    (what ``comm.traffic`` counts when the call runs). ``nodes``: each rank's node, for a
    layout ``ranks_per_node`` cannot say (uneven nodes)."""
    layout = Topology(ranks_per_node=ranks_per_node, nodes=tuple(nodes))
    sent = []
    for rank, program in enumerate(programs(schedule, count)):
        mine = {"intra": 0, "inter": 0}
        for _, transmits in program.steps:
            for t in transmits:
                link = "intra" if layout.same_node(rank, t.peer) else "inter"
                mine[link] += (t.stop - t.start) * itemsize
        sent.append(mine)
    return sent


def play(compiled: list[Program], topology: Topology, itemsize: int) -> Prediction:
    """Play compiled programs under the rendezvous rule; the slowest rank's finish."""
    nranks = len(compiled)
    steps: list[list[_Step]] = []
    # Pair the k-th send a->b with the k-th receive at b from a, as the transports do.
    sends: dict[tuple[int, int], list[int]] = defaultdict(list)
    receives: dict[tuple[int, int], list[int]] = defaultdict(list)
    for rank, program in enumerate(compiled):
        steps.append([_step(rank, incoming, outgoing, topology, itemsize)
                      for incoming, outgoing in program.steps])
        for index, (incoming, outgoing) in enumerate(program.steps):
            for r in incoming:
                receives[(r.peer, rank)].append(index)
            for t in outgoing:
                sends[(rank, t.peer)].append(index)
    partners: list[list[list[tuple[int, int]]]] = [[[] for _ in s] for s in steps]
    for (src, dst), indices in sends.items():
        theirs = receives.get((src, dst), [])
        if len(theirs) != len(indices):
            raise ValueError(
                f"rank {src} sends {len(indices)} messages to rank {dst}, which receives "
                f"{len(theirs)}; the schedule does not pair"
            )
        for i, j in zip(indices, theirs):
            partners[src][i].append((dst, j))
            partners[dst][j].append((src, i))

    # finish[r][i + 1]: when rank r left step i; finish[r][0]: its seed copies are done.
    finish = [[_start(program, topology, itemsize)] for program in compiled]
    pending = list(range(nranks))
    while pending:
        advanced = False
        still = []
        for rank in pending:
            while (done := len(finish[rank]) - 1) < len(steps[rank]):
                ready = [finish[rank][done]]
                for peer, j in partners[rank][done]:
                    if len(finish[peer]) <= j:  # the peer has not reached that step yet
                        break
                    ready.append(finish[peer][j])
                else:
                    finish[rank].append(max(ready) + _cost(steps[rank][done], topology))
                    advanced = True
                    continue
                still.append(rank)
                break
        if still and not advanced:
            raise ValueError("the schedule cannot progress under rendezvous: it would hang")
        pending = still
    return Prediction(max(f[-1] for f in finish) if finish else 0.0)


def play_lockstep(program: Program, topology: Topology, itemsize: int, rank: int) -> float:
    """One rank's program played alone, every partner assumed ready when it is: the time of
    a rank-symmetric schedule, whose ranks all do the same at the same moments."""
    return _start(program, topology, itemsize) + sum(
        _cost(_step(rank, incoming, outgoing, topology, itemsize), topology)
        for incoming, outgoing in program.steps
    )


# --- one rank for all -----------------------------------------------------------------------

_EVERY_RANK_ALIKE = frozenset({Collective.ALLREDUCE, Collective.REDUCE_SCATTER,
                               Collective.ALLGATHER})
# Families whose ranks all do the same at the same moments, by collective (``symmetric``
# adds: halving-doubling at powers of two, ranks on whole nodes): one rank's program played
# alone then costs what every rank's played together do. hierarchical_tree is not symmetric,
# but rank 0 roots both trees between nodes: busy in every round, its finish is the call's.
SYMMETRIC = {"ring": _EVERY_RANK_ALIKE, "direct": _EVERY_RANK_ALIKE,
             "halving_doubling": _EVERY_RANK_ALIKE, "hierarchical": _EVERY_RANK_ALIKE,
             "two_shot": frozenset({Collective.ALLREDUCE}),
             "hierarchical_tree": frozenset({Collective.ALLREDUCE})}


def symmetric(collective: Collective, family: str, nranks: int, ranks_per_node: int = 0
              ) -> bool:
    """Whether rank 0's program stands for every rank's (``SYMMETRIC``)."""
    if collective not in SYMMETRIC.get(family, ()):
        return False
    if family == "halving_doubling" and nranks & (nranks - 1):
        return False
    # a part-filled node's ranks send more between nodes than rank 0 does
    return _node_size(nranks, ranks_per_node) == 0 or nranks % ranks_per_node == 0


def _node_size(nranks: int, ranks_per_node: int) -> int:
    return 0 if ranks_per_node >= nranks else ranks_per_node  # as algorithms.build reads it


@functools.lru_cache(maxsize=256)
def rank_zero_schedule(collective: Collective, family: str, nranks: int, nsegments: int,
                       ranks_per_node: int) -> Schedule:
    """``family``'s schedule with rank 0's steps alone (``building_only``): O(p) transfers
    where every rank's are O(p^2), for pricing a symmetric one."""
    emit = algorithms.FAMILIES[family].SCHEDULES[collective]
    nodes = ({"ranks_per_node": _node_size(nranks, ranks_per_node)}
             if algorithms.node_aware(family) else {})
    with building_only(frozenset({0})):
        return emit(nranks, nsegments, **nodes)


def lockstep_seconds(collective: Collective, family: str, nranks: int, nsegments: int,
                     count: int, topology: Topology, itemsize: int) -> float:
    """Rank 0's program for ``count`` elements played alone (``play_lockstep``); with fewer
    elements than chunks, every chunk is given one, so that rank 0 does what every rank does."""
    schedule = rank_zero_schedule(collective, family, nranks, nsegments,
                                  topology.ranks_per_node)
    program = program_of(schedule, 0, max(count, schedule.nchunks))
    return play_lockstep(program, topology, itemsize, rank=0)


def chunks_of(collective: Collective, family: str, nranks: int, nsegments: int,
              root: int | None, ranks_per_node: int) -> int:
    """How many chunks ``family``'s schedule cuts WORK into, without building every rank's
    steps where rank 0's say it."""
    if symmetric(collective, family, nranks, ranks_per_node):
        return rank_zero_schedule(collective, family, nranks, nsegments, ranks_per_node).nchunks
    return algorithms.build(family, collective, nranks, nsegments, root,
                            ranks_per_node=ranks_per_node).nchunks


def seconds(collective: Collective, family: str, nranks: int, nsegments: int,
            root: int | None, count: int, topology: Topology, itemsize: int) -> float:
    """The predicted time of a call of ``count`` elements: the play of every rank's program,
    or, where that is the same number, rank 0's alone (a symmetric schedule whose chunks all
    hold as many elements; tests/test_model.py checks the two agree)."""
    # uneven nodes: rank 0's program does not stand for the others' (their links differ)
    if count > 0 and not topology.nodes and symmetric(collective, family, nranks,
                                                      topology.ranks_per_node):
        nchunks = chunks_of(collective, family, nranks, nsegments, root,
                            topology.ranks_per_node)
        if count % nchunks == 0:
            return lockstep_seconds(collective, family, nranks, nsegments, count, topology,
                                    itemsize)
    schedule = algorithms.build(family, collective, nranks, nsegments, root,
                                ranks_per_node=topology.ranks_per_node)
    return play(programs(schedule, count), topology, itemsize).seconds


def _start(program: Program, topology: Topology, itemsize: int) -> float:
    """The call's fixed cost and its seed copies, before the first step."""
    return topology.call + sum(topology.copy_seconds((stop - start) * itemsize)
                               for start, stop, *_ in program.seeds)


def _step(rank: int, incoming, outgoing, topology: Topology, itemsize: int) -> _Step:
    """What one step of ``rank`` moves and reduces, per link class (or per peer)."""
    step = _Step()
    for r in incoming:
        link, size = topology.link(rank, r.peer), (r.stop - r.start) * itemsize
        step.alpha = max(step.alpha, link.alpha)
        step.messages_in += 1
        step.received[_key(link, r.peer, topology)] += size
        if r.scratch >= 0:
            step.reduced.append(size)
    for t in outgoing:
        link, size = topology.link(rank, t.peer), (t.stop - t.start) * itemsize
        step.alpha = max(step.alpha, link.alpha)
        step.messages_out += 1
        step.sent[_key(link, t.peer, topology)] += size
    return step


def _key(link: Link, peer: int, topology: Topology):
    return (id(link), peer) if topology.ports == "multi" else id(link)


def _cost(step: _Step, topology: Topology) -> float:
    links = {id(topology.intra): topology.intra, id(topology.inter): topology.inter}
    moved = 0.0
    for table in (step.sent, step.received):
        for key, size in table.items():
            link = links[key[0] if isinstance(key, tuple) else key]
            moved = max(moved, link.per_byte(size) * size)
    messages = 1 if topology.ports == "multi" else max(step.messages_out, step.messages_in)
    return step.alpha * messages + moved + sum(topology.reduce_seconds(b) for b in step.reduced)


# --- every candidate of a call -------------------------------------------------------------

SEGMENT_CHOICES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Candidate:
    algorithm: str
    nsegments: int
    seconds: float


def segment_choices(count: int, nranks: int, topology: Topology) -> tuple[int, ...]:
    """The segment counts worth pricing for ``count`` elements on ``nranks`` ranks: 1 where
    ``topology`` has no use for segments; else SEGMENT_CHOICES while each of a ring's chunks
    keeps 4 elements or more (more segments only add messages)."""
    if not topology.segments:
        return (1,)
    return tuple(s for s in SEGMENT_CHOICES if s == 1 or count >= 4 * s * nranks)


# --- tuning files ---------------------------------------------------------------------------

TUNING_ENV = "PYCOLL_TUNING"
# the kinds of transport a tuning file holds costs for (select.DEFAULTS has each one's defaults)
TRANSPORT_KINDS = ("local", "mpi", "shm", "cuda")


def tuning_path() -> Path:
    """$PYCOLL_TUNING, else the user's cache folder (XDG_CACHE_HOME or ~/.cache)/pycoll;
    ValueError where there is no home folder to name it by."""
    if os.environ.get(TUNING_ENV):
        return Path(os.environ[TUNING_ENV])
    cache = os.environ.get("XDG_CACHE_HOME")
    if not cache:
        try:
            cache = str(Path.home() / ".cache")
        except RuntimeError:  # HOME unset, and a user id with no passwd entry (containers)
            raise ValueError(
                "the tuning file has no path: HOME is unset and this user has no home "
                f"folder; allowed: {TUNING_ENV} (the file) or XDG_CACHE_HOME set") from None
    return Path(cache) / "pycoll" / "tuning.json"


_FILE_SET_ASIDE = False  # within tuning_file_set_aside()


@contextlib.contextmanager
def tuning_file_set_aside() -> Iterator[None]:
    """Within: the tuning file reads as absent where no path is given (the calls' own costs),
    so that `pycoll tune` measures with the default costs, and can rewrite a file that is
    unreadable (which it is told to do), rather than fail on reading it."""
    global _FILE_SET_ASIDE
    saved, _FILE_SET_ASIDE = _FILE_SET_ASIDE, True
    try:
        yield
    finally:
        _FILE_SET_ASIDE = saved


def load_tuning(path: Path | None = None) -> dict[str, list[Topology]]:
    """The tuned topologies of this machine by kind of transport ("local", "mpi", "shm", "cuda"),
    one per rank count tuned at; empty when there is no tuning file."""
    if path is None and _FILE_SET_ASIDE:
        return {}
    # the cache folder's file, where no one named a file: optional, so where it cannot be
    # (no home folder) or cannot be looked for (a home this user may not enter: a container
    # run as another user than its image's HOME), the built-in costs
    optional = path is None and not os.environ.get(TUNING_ENV)
    if path is None:
        try:
            path = tuning_path()
        except ValueError:
            return {}
    try:
        if not path.exists():
            return {}
    except OSError as error:  # a folder on its path this user may not search
        if optional:
            return {}
        raise ValueError(
            f"tuning file {path} is unreadable ({error!r}); allowed: a path this user can "
            f"read, or {TUNING_ENV} unset") from error
    if path.is_dir():  # `pycoll tune` could not rewrite it either
        raise ValueError(f"tuning file {path} is a folder; allowed: a file's path "
                         f"({TUNING_ENV} names the file itself, as tuning.json)")
    try:
        data = json.loads(path.read_text())
        if _one_topology(data):
            raise ValueError(f"tuning file {path} {HOLDS_ONE_TOPOLOGY}; allowed: a file "
                             "`pycoll tune` wrote, or a path where it will write one")
        # one entry: not a list ("abc" was read as three entries, 'a', 'b' and 'c')
        kinds = {kind: entries if isinstance(entries, list) else [entries]
                 for kind, entries in data["transports"].items()}
        fits = data.get("fits", {})
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
            AttributeError) as error:
        raise ValueError(
            f"tuning file {path} is unreadable ({error!r}); run `pycoll tune` to rewrite it"
        ) from error
    unknown = sorted(set(kinds) - set(TRANSPORT_KINDS))
    if unknown:  # a misspelt kind ("shmm") was kept and never read: its costs went unused
        raise ValueError(
            f"tuning file {path}: transports {unknown} unknown; allowed: "
            f"{', '.join(TRANSPORT_KINDS)}; run `pycoll tune` to rewrite it")
    if not isinstance(fits, dict):  # save_tuning merges them, by kind@ranks
        raise ValueError(
            f"tuning file {path}: fits={fits!r}; allowed: an object of each tuning's fits by "
            "kind@ranks; run `pycoll tune` to rewrite it")
    return {
        kind: [Topology.from_json(e, source=f"{path} [{kind}, {_nranks_of(e)} ranks]")
               for e in entries]
        for kind, entries in kinds.items()
    }


HOLDS_ONE_TOPOLOGY = ("holds one topology (as `pycoll model --topology` reads), not the "
                      "costs `pycoll tune` writes")


def _one_topology(data: object) -> bool:
    return isinstance(data, dict) and "transports" not in data and "intra" in data


def holds_one_topology(path: Path) -> bool:
    """Whether ``path`` is a topology's JSON (which `pycoll tune` must not replace)."""
    try:
        return path.is_file() and _one_topology(json.loads(path.read_text()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False


def _nranks_of(entry: object) -> object:
    """An entry's rank count for naming it; from_json then refuses what is not an object."""
    return entry.get("nranks", 0) if isinstance(entry, dict) else "?"


def save_tuning(topologies: list[tuple[str, Topology]], path: Path | None = None,
                fits: dict | None = None) -> Path:
    """Write (kind, topology) pairs into the tuning file, replacing those of the same kind and
    rank count and keeping the rest (their fits too); returns the file's path."""
    path = tuning_path() if path is None else path
    kept_fits: dict = {}
    try:
        current = load_tuning(path)
        if current:
            kept_fits = dict(json.loads(path.read_text()).get("fits") or {})
    except ValueError as unreadable:  # what `pycoll tune` is told to fix: start it afresh
        print(f"pycoll: {unreadable}; writing a new one", file=sys.stderr)
        current = {}
    for kind, topology in topologies:
        kept = [t for t in current.get(kind, []) if t.nranks != topology.nranks]
        current[kind] = sorted(kept + [topology], key=lambda t: t.nranks)
    body: dict = {"transports": {k: [t.to_json() for t in v] for k, v in current.items()}}
    if fits or kept_fits:
        body["fits"] = {**kept_fits, **(fits or {})}
    path.resolve().parent.mkdir(parents=True, exist_ok=True)  # a link's target's folder
    path.write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")
    return path


def nearest(topologies: list[Topology], nranks: int) -> Topology | None:
    """The topology tuned at the rank count closest to ``nranks`` (by ratio), if any."""
    if not topologies:
        return None
    return min(topologies, key=lambda t: (abs(math.log(max(t.nranks, 1) / nranks)), t.nranks))
