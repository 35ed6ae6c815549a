"""`pycoll model`: predicted time and busbw per algorithm at scale, on a named topology.

Every prediction plays the algorithm's own schedule (:mod:`pycoll.model`). Two schedules
grow as the square of the rank count (ring: 2(p-1) steps on each of p ranks; direct: p-1
messages on each; halving-doubling's transfers are per block, merged into log2 p messages
only when compiled), too many to hold at thousands of ranks; all are rank-symmetric (halving-
doubling for powers of two), so rank 0's steps alone are built (``building_only``) and played
in lockstep (``model.seconds``): every step costs what it costs that rank, as every rank does
the same. Up to ``FULL_LIMIT`` ranks that is done only where it equals the full play (whole
nodes, chunks of equal size; the tests check it), else every rank is played. Beyond, one rank
stands for all whatever the size, and the segment count is 1 (a ring's segments run one after
another, so under the model more only add alphas). Direct and two_shot are left out beyond
512 ranks, and the tree's AllGather and ReduceScatter (p² transfers, every rank's different)
beyond 64.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from importlib import resources
from multiprocessing import get_context
from pathlib import Path

from pycoll import algorithms, model
from pycoll.bench import bus_factor, element_count, size_text
from pycoll.bindings.shm import available_memory
from pycoll.schedule import ROOTED, Collective
from pycoll.select import spans_nodes

FULL_LIMIT = 64  # beyond: symmetric schedules played on one rank at every size (up to: where exact)
DIRECT_LIMIT = 512  # p-1 messages per rank: not a candidate beyond
ONE_ROUND = ("direct", "two_shot")  # the families with p-1 messages per rank and round
# a tree's AllGather and ReduceScatter carry every rank's block through each level: p^2
# transfers, on no rank alike (64 ranks took 2 s a size to play, 512 hours)
SQUARE_UNEVEN = {("tree", Collective.ALLGATHER), ("tree", Collective.REDUCE_SCATTER)}


def builtin_topologies() -> dict[str, model.Topology]:
    text = resources.files("pycoll").joinpath("data/topologies.json").read_text()
    return {name: model.Topology.from_json(entry, source="built-in")
            for name, entry in json.loads(text).items() if not name.startswith("_")}


def topology_named(name_or_path: str) -> model.Topology:
    """A built-in topology by name, "tuned" (this machine's MPI tuning), or a JSON file."""
    builtins = builtin_topologies()
    if name_or_path in builtins:
        return builtins[name_or_path]
    if name_or_path == "tuned":
        tuning = model.load_tuning()
        tuned = tuning.get("mpi") or tuning.get("shm") or tuning.get("local")
        if not tuned:
            raise ValueError("--topology tuned: no tuning file; run `pycoll tune` first")
        return max(tuned, key=lambda t: t.nranks)
    path = Path(name_or_path)
    if not path.exists():
        raise ValueError(
            f"--topology {name_or_path!r} is neither a built-in topology nor a file; allowed: "
            + ", ".join(sorted(builtins)) + ", tuned, or a JSON file like pycoll/data/"
            "topologies.json's entries"
        )
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"--topology {path}: not JSON ({error})") from error
    except OSError as error:  # a directory, no permission
        raise ValueError(f"--topology {path}: cannot read it ({error.strerror})") from None
    if isinstance(data, dict) and "transports" in data:  # what pycoll tune --output wrote
        raise ValueError(f"--topology {path} is a tuning file (pycoll tune's); allowed: one "
                         f"topology's JSON, or PYCOLL_TUNING={path} with --topology tuned")
    return model.Topology.from_json(data, source=str(path))


@dataclass(frozen=True)
class Estimate:
    nranks: int
    nbytes: int
    algorithm: str
    nsegments: int
    seconds: float
    busbw: float
    # "every rank's play", or beyond FULL_LIMIT "one rank for all" (where the two may differ)
    how: str


def _lockstep(collective: Collective, family: str, nranks: int) -> bool:
    """Rank 0 stands for all, at every size (beyond FULL_LIMIT, a symmetric family)."""
    return nranks > FULL_LIMIT and model.symmetric(collective, family, nranks)


def segment_counts(collective: Collective, family: str, nranks: int, nbytes: int,
                   topology: model.Topology, itemsize: int = 4) -> tuple[int, ...]:
    """The segment counts priced for ``family`` at this size: 1 where rank 0 stands for all
    (beyond FULL_LIMIT, even on part-filled nodes and with uneven chunks), else the model's
    choices."""
    if _lockstep(collective, family, nranks):
        return (1,)
    return model.segment_choices(nbytes // itemsize, nranks, topology)


@functools.lru_cache(maxsize=4096)
def segment_seconds(collective: Collective, family: str, nranks: int, nbytes: int,
                    nsegments: int, topology: model.Topology, itemsize: int = 4) -> float:
    """The predicted time of ``family`` cut into ``nsegments`` (see the module docstring)."""
    count = nbytes // itemsize
    topology = topology.with_curves()
    if _lockstep(collective, family, nranks):
        return model.lockstep_seconds(collective, family, nranks, nsegments, count, topology,
                                      itemsize)
    root = 0 if collective in ROOTED else None
    return model.seconds(collective, family, nranks, nsegments, root, count, topology,
                         itemsize)


def estimate(collective: Collective, family: str, nranks: int, nbytes: int,
             seconds_by_segments: dict[int, float]) -> Estimate:
    """The best of the priced segment counts (the fewest segments among equals)."""
    nsegments, seconds = min(seconds_by_segments.items(), key=lambda pair: (pair[1], pair[0]))
    factor = bus_factor(collective, nranks)
    busbw = nbytes / seconds / 1e9 * factor if seconds > 0 else 0.0
    how = "one rank for all" if _lockstep(collective, family, nranks) else "every rank's play"
    return Estimate(nranks, nbytes, family, nsegments, seconds, busbw, how)


@functools.lru_cache(maxsize=4096)
def predict_at_scale(collective: Collective, family: str, nranks: int, nbytes: int,
                     topology: model.Topology, itemsize: int = 4) -> Estimate:
    """The best segment count's prediction for ``family`` (see the module docstring)."""
    return estimate(collective, family, nranks, nbytes, {
        nsegments: segment_seconds(collective, family, nranks, nbytes, nsegments, topology,
                                   itemsize)
        for nsegments in segment_counts(collective, family, nranks, nbytes, topology, itemsize)})


Price = Callable[[str, int, int], Estimate]  # (family, nranks, nbytes) -> its estimate


class Pricer:
    """``predict_at_scale`` for one collective, topology and dtype, called as ``price(family,
    nranks, nbytes)``; what ``prefetch`` was given is priced ahead by worker processes, one
    segment count a task, each call then waiting for its own. Playing every rank of a
    4096-rank tree takes seconds per segment count, minutes for a sweep on one core."""

    def __init__(self, collective: Collective, topology: model.Topology, itemsize: int = 4,
                 workers: int = 1) -> None:
        self.collective, self.topology, self.itemsize = collective, topology, itemsize
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None
        self._pending: dict[tuple[str, int, int], dict[int, Future]] = {}

    def prefetch(self, keys: list[tuple[str, int, int]]) -> None:
        """Start pricing each (family, nranks, nbytes), in this order, where workers > 1."""
        if self.workers < 2:
            return
        if self._pool is None:  # spawned: a fork could copy a thread's held lock
            self._pool = ProcessPoolExecutor(self.workers, mp_context=get_context("spawn"))
        for family, nranks, nbytes in keys:
            if (family, nranks, nbytes) in self._pending:
                continue
            args = (self.collective, family, nranks, nbytes)
            self._pending[(family, nranks, nbytes)] = {
                nsegments: self._pool.submit(segment_seconds, *args, nsegments, self.topology,
                                             self.itemsize)
                for nsegments in segment_counts(*args, self.topology, self.itemsize)}

    def __call__(self, family: str, nranks: int, nbytes: int) -> Estimate:
        futures = self._pending.get((family, nranks, nbytes))
        if futures is None:
            return predict_at_scale(self.collective, family, nranks, nbytes, self.topology,
                                    self.itemsize)
        return estimate(self.collective, family, nranks, nbytes,
                        {nsegments: future.result() for nsegments, future in futures.items()})

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def __enter__(self) -> Pricer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# A worker's peak while it plays the 4096-rank tree (about 430 MB measured), rounded up
WORKER_BYTES = 512 * 2**20


def workers_for(collective: Collective, ranks: list[int], topology: model.Topology) -> int:
    """Worker processes worth starting for ``pycoll model`` at ``ranks``: one per core where
    some family plays every rank of more than FULL_LIMIT (seconds a size), as many as the
    free memory holds at WORKER_BYTES each; else none (a process takes about a second to
    start)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    slow = any(p > FULL_LIMIT and applies(collective, f, p, topology)
               and not model.symmetric(collective, f, p)
               for p in ranks for f in algorithms.families_for(collective))
    if not slow:
        return 1
    memory = available_memory()
    fits = (cores or 1) if memory is None else memory // WORKER_BYTES
    return max(1, min(cores or 1, fits))


def applies(collective: Collective, family: str, nranks: int, topology: model.Topology) -> bool:
    """Whether ``family`` is priced at ``nranks``: one-round families up to DIRECT_LIMIT
    ranks where one rank can price them in lockstep, else up to FULL_LIMIT (their p² full
    play takes minutes beyond), as the tree's AllGather and ReduceScatter
    (``SQUARE_UNEVEN``); node-aware ones where the ranks span nodes."""
    if family in ONE_ROUND:
        limit = DIRECT_LIMIT if model.symmetric(collective, family, nranks) else FULL_LIMIT
        if nranks > limit:
            return False
    if (family, collective) in SQUARE_UNEVEN and nranks > FULL_LIMIT:
        return False
    return not (algorithms.node_aware(family) and not spans_nodes(topology, nranks))


@dataclass(frozen=True)
class Sweep:
    """What a table prices: each rank count's sizes, rounded as ``pycoll bench`` rounds them
    (whole elements; for ReduceScatter, AllGather and AllToAll whole rows per rank), none
    empty; its columns, the families that apply at any of the rank counts; and which apply
    at each."""

    collective: Collective
    sizes: dict[int, list[int]]  # rank count -> its sizes in bytes
    families: list[str]
    applying: dict[int, list[bool]]  # rank count -> whether each column's family applies

    def keys(self) -> list[tuple[str, int, int]]:
        """Every (family, rank count, size) the table prices, row by row."""
        return [(f, p, nbytes) for p, sizes in self.sizes.items() for nbytes in sizes
                for f, applying in zip(self.families, self.applying[p]) if applying]


def sweep(collective: Collective, ranks: list[int], sizes: list[int], topology: model.Topology,
          families: list[str] | None = None, itemsize: int = 4) -> Sweep:
    measured = {p: sorted({element_count(collective, itemsize, s, p) * itemsize
                           for s in sizes} - {0}) for p in ranks}
    families = families or [f for f in algorithms.families_for(collective)
                            if any(applies(collective, f, p, topology)
                                   for p in ranks if measured[p])]
    applying = {p: [applies(collective, f, p, topology) for f in families] for p in ranks}
    return Sweep(collective, measured, families, applying)


def rows(plan: Sweep, price: Price) -> Iterator[list[Estimate | None]]:
    """For every (rank count, size) of ``plan``: every column's estimate, None where its
    family does not apply at that rank count; each row as soon as it is priced."""
    for p, sizes in plan.sizes.items():
        for nbytes in sizes:
            yield [price(f, p, nbytes) if applying else None
                   for f, applying in zip(plan.families, plan.applying[p])]


def table(collective: Collective, ranks: list[int], sizes: list[int], topology: model.Topology,
          families: list[str] | None = None, itemsize: int = 4
          ) -> list[list[Estimate | None]]:
    """Every row of ``rows`` (see ``sweep``), priced in this process."""
    plan = sweep(collective, ranks, sizes, topology, families, itemsize)
    return list(rows(plan, Pricer(collective, topology, itemsize)))


def crossover_sizes(collective: Collective, p: int, low: int, high: int, itemsize: int = 4
                    ) -> list[int]:
    """The sizes ``crossover`` compares: from ``low`` by factors of 4 up to ``high``,
    rounded as bench measures them, none empty."""
    if low < 1:  # 0 * 4 would scan forever
        raise ValueError(f"low={low}; allowed: an int >= 1")
    scanned = []
    size = low
    while size <= high:
        nbytes = element_count(collective, itemsize, size, p) * itemsize
        if nbytes:
            scanned.append(nbytes)
        size *= 4
    return scanned


def crossover(collective: Collective, p: int, topology: model.Topology, a: str, b: str,
              low: int = 8, high: int = 1 << 32, itemsize: int = 4,
              price: Price | None = None) -> int | None:
    """The largest size (bytes) at which ``a`` still predicts faster than ``b`` at ``p``
    ranks, of ``crossover_sizes`` (None: ``a`` is never faster)."""
    price = price or Pricer(collective, topology, itemsize)
    last = None
    for nbytes in crossover_sizes(collective, p, low, high, itemsize):
        ta, tb = price(a, p, nbytes).seconds, price(b, p, nbytes).seconds
        if ta < tb * (1 - 1e-9):  # faster, not equal up to rounding (2 ranks: same steps)
            last = nbytes
    return last


def format_header(collective: Collective, families: list[str], topology: model.Topology
                  ) -> str:
    return "\n".join([f"# pycoll model: {collective.value} on {topology.name}",
                      "| ranks | size | " + " | ".join(f"{name} µs (busbw GB/s)"
                                                     for name in families) + " | fastest |",
                      "|---|---|" + "---|" * (len(families) + 1)])


def format_row(row: list[Estimate | None]) -> str:
    """A table row; "—" where a family does not apply at that row's rank count."""
    priced = [e for e in row if e is not None]
    fastest = min(priced, key=lambda e: (e.seconds, e.nsegments, e.algorithm))  # as auto
    cells = ["—" if e is None else f"{e.seconds * 1e6:.1f} ({e.busbw:.1f})"
             + (f" ×{e.nsegments}" if e.nsegments > 1 else "") for e in row]
    size = size_text(priced[0].nbytes, flag=False)
    return f"| {priced[0].nranks} | {size} | " + " | ".join(cells) + f" | {fastest.algorithm} |"


def format_table(collective: Collective, rows: list[list[Estimate | None]],
                 topology: model.Topology, families: list[str] | None = None) -> str:
    """The table; ``families``: the column names (default: read off the rows)."""
    names = families or [next(r[i] for r in rows if r[i] is not None).algorithm
                         for i in range(len(rows[0]))]
    return "\n".join([format_header(collective, names, topology), *map(format_row, rows)])
