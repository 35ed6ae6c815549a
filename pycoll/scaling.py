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
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from pycoll import algorithms, model
from pycoll.bench import bus_factor, element_count, size_text
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


@functools.lru_cache(maxsize=4096)
def predict_at_scale(collective: Collective, family: str, nranks: int, nbytes: int,
                     topology: model.Topology, itemsize: int = 4) -> Estimate:
    """The best segment count's prediction for ``family`` (see the module docstring)."""
    count = nbytes // itemsize
    topology = topology.with_curves()
    root = 0 if collective in ROOTED else None
    best = None
    # beyond FULL_LIMIT, rank 0 stands for all even on part-filled nodes (so nodes are not
    # passed) and with uneven chunks
    lockstep = nranks > FULL_LIMIT and model.symmetric(collective, family, nranks)
    for nsegments in (1,) if lockstep else model.segment_choices(count, nranks, topology):
        if lockstep:
            seconds = model.lockstep_seconds(collective, family, nranks, 1, count, topology,
                                             itemsize)
        else:
            seconds = model.seconds(collective, family, nranks, nsegments, root, count,
                                    topology, itemsize)
        if best is None or seconds < best[1]:
            best = (nsegments, seconds)
    nsegments, seconds = best
    factor = bus_factor(collective, nranks)
    busbw = nbytes / seconds / 1e9 * factor if seconds > 0 else 0.0
    how = "one rank for all" if lockstep else "every rank's play"
    return Estimate(nranks, nbytes, family, nsegments, seconds, busbw, how)


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


def table(collective: Collective, ranks: list[int], sizes: list[int], topology: model.Topology,
          families: list[str] | None = None, itemsize: int = 4
          ) -> list[list[Estimate | None]]:
    """For every (rank count, size): every family's estimate, None where the family does not
    apply at that rank count (the columns: families that apply at any of ``ranks``). Sizes
    are rounded as ``pycoll bench`` rounds them (whole elements; for ReduceScatter, AllGather
    and AllToAll whole rows per rank), each priced once, none empty."""
    measured = {p: sorted({element_count(collective, itemsize, s, p) * itemsize
                           for s in sizes} - {0}) for p in ranks}
    families = families or [f for f in algorithms.families_for(collective)
                            if any(applies(collective, f, p, topology)
                                   for p in ranks if measured[p])]
    rows = []
    for p in ranks:
        for nbytes in measured[p]:
            rows.append([predict_at_scale(collective, f, p, nbytes, topology, itemsize)
                         if applies(collective, f, p, topology) else None for f in families])
    return rows


def crossover(collective: Collective, p: int, topology: model.Topology, a: str, b: str,
              low: int = 8, high: int = 1 << 32, itemsize: int = 4) -> int | None:
    """The largest power-of-two size (bytes) at which ``a`` still predicts faster than
    ``b`` at ``p`` ranks, scanning up from ``low`` (None: ``a`` is never faster)."""
    if low < 1:  # 0 * 4 would scan forever
        raise ValueError(f"low={low}; allowed: an int >= 1")
    last = None
    size = low
    while size <= high:
        nbytes = element_count(collective, itemsize, size, p) * itemsize  # as bench measures
        if nbytes:
            ta = predict_at_scale(collective, a, p, nbytes, topology, itemsize).seconds
            tb = predict_at_scale(collective, b, p, nbytes, topology, itemsize).seconds
            if ta < tb * (1 - 1e-9):  # faster, not equal up to rounding (2 ranks: same steps)
                last = nbytes
        size *= 4
    return last


def format_table(collective: Collective, rows: list[list[Estimate | None]],
                 topology: model.Topology, families: list[str] | None = None) -> str:
    """The table; ``families``: the column names (default: read off the rows); "—" where a
    family does not apply at that row's rank count."""
    names = families or [next(r[i] for r in rows if r[i] is not None).algorithm
                         for i in range(len(rows[0]))]
    lines = [f"# pycoll model: {collective.value} on {topology.name}",
             "| ranks | size | " + " | ".join(f"{name} µs (busbw GB/s)" for name in names)
             + " | fastest |",
             "|---|---|" + "---|" * (len(names) + 1)]
    for row in rows:
        priced = [e for e in row if e is not None]
        fastest = min(priced, key=lambda e: (e.seconds, e.nsegments, e.algorithm))  # as auto
        cells = ["—" if e is None else f"{e.seconds * 1e6:.1f} ({e.busbw:.1f})"
                 + (f" ×{e.nsegments}" if e.nsegments > 1 else "") for e in row]
        size = size_text(priced[0].nbytes, flag=False)
        lines.append(f"| {priced[0].nranks} | {size} | " + " | ".join(cells)
                     + f" | {fastest.algorithm} |")
    return "\n".join(lines)


