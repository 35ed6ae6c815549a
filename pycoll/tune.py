"""`pycoll tune`: measure this machine's costs for the model, fit them, write a tuning file.

For each transport present (in-process threads; MPI when run under mpiexec with two ranks or
more) and at the rank count it runs with, it measures what the model charges for
(:mod:`pycoll.model`), with every rank busy at once, as in a collective:

* ``alpha`` and ``beta``: ranks pair up (0-1, 2-3, ...) and each pair runs a one-step
  exchange through pycoll itself (a 2-rank ring AllGather: both send and receive ``b`` bytes),
  over a size sweep; the median time, less the call's fixed cost and its seed copy, fits
  ``alpha + beta b`` (a ping-pong in both directions at once, with the executor's own
  per-step work in it). Under MPI across nodes, pairs are formed across nodes as well.
* ``gamma``: the host reduction (float32 sum) of ``b`` bytes into place, on every rank at
  once (they share memory bandwidth): ``gamma b``.
* ``delta``: a local copy of ``b`` bytes, likewise: ``delta b``.
* ``call``: a whole collective with nothing to move (0 elements).

Each fit is least squares on relative error, so small and large sizes count alike; it is
printed with every point's residual. Medians of repeated runs, since the machine is shared.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

import pycoll
from pycoll import model, select
from pycoll.comm import Communicator
from pycoll.kernels import ReduceOp, reducer

STEP_SIZES = [8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 32 << 20]
LOCAL_SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 32 << 20]
PASSES = 3  # passes over each sweep; the median over passes is kept
CURVE_FROM = 32 << 10  # below this a step's time is mostly alpha: no per-byte reading


@dataclass
class Fit:
    """``seconds = fixed + per_byte * bytes`` over the measured points."""

    name: str
    fixed: float
    per_byte: float
    points: list[tuple[int, float]]

    def predicted(self, nbytes: int) -> float:
        return self.fixed + self.per_byte * nbytes

    def worst_residual(self) -> float:
        return max(abs(self.predicted(b) / t - 1) for b, t in self.points if t > 0)

    def table(self) -> str:
        lines = [f"{self.name}: {self.fixed * 1e6:.2f} us + {self.per_byte * 1e12:.2f} ps/B "
                 f"(= {_rate(self.per_byte)}); worst residual {self.worst_residual():.0%}",
                 f"  {'bytes':>10} {'measured(us)':>13} {'fitted(us)':>11} {'residual':>9}"]
        for nbytes, seconds in self.points:
            fitted = self.predicted(nbytes)
            lines.append(f"  {nbytes:>10} {seconds * 1e6:>13.2f} {fitted * 1e6:>11.2f} "
                         f"{fitted / seconds - 1:>+9.1%}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"fixed_s": self.fixed, "per_byte_s": self.per_byte,
                "points": [[b, t] for b, t in self.points]}


def _rate(per_byte: float) -> str:
    return f"{1 / per_byte / 1e9:.2f} GB/s" if per_byte > 0 else "no per-byte cost measured"


def fit(name: str, points: list[tuple[int, float]], through_zero: bool = False) -> Fit:
    """Least squares on relative error: minimise sum((a + b x) / t - 1)^2."""
    x = np.array([b for b, _ in points], dtype=np.float64)
    t = np.array([s for _, s in points], dtype=np.float64)
    if through_zero:
        columns = np.stack([x / t], axis=1)
    else:
        columns = np.stack([1 / t, x / t], axis=1)
    solution, *_ = np.linalg.lstsq(columns, np.ones_like(t), rcond=None)
    fixed, per_byte = (0.0, solution[0]) if through_zero else (solution[0], solution[1])
    return Fit(name, max(float(fixed), 0.0), max(float(per_byte), 0.0), points)


def _median_time(call: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
    samples = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def measure_steps(comm: Communicator, partner: Callable[[int], int | None], sizes: list[int],
                  repeats: int) -> list[tuple[int, float]] | None:
    """Every rank with a partner runs a 2-rank ring AllGather of shards of ``b`` bytes with it
    (one exchange step), all pairs at once, calls back to back; rank 0's median time per
    call, per size (None on the other ranks)."""
    mate = partner(comm.rank)
    pair = comm.split(None if mate is None else min(comm.rank, mate))
    runs: dict[int, list[float]] = {nbytes: [] for nbytes in sizes}
    # Several passes over the sweep: a slow moment of the shared machine spoils one pass's
    # points, not one size's every sample; the median over passes drops it.
    for _ in range(PASSES):
        for nbytes in sizes:
            shard = np.ones(nbytes, np.uint8)
            out = np.empty(2 * nbytes, np.uint8)
            batch = max(1, min(20, (1 << 20) // max(nbytes, 1)))
            calls = functools.partial(_allgathers, pair, shard, out, batch)
            calls()  # warm up: prepares the call shape
            seconds = _median_time(calls, repeats, functools.partial(pycoll.barrier, comm))
            runs[nbytes].append(seconds / batch)
    points = [(nbytes, statistics.median(runs[nbytes])) for nbytes in sizes]
    return points if comm.rank == 0 else None


def _allgathers(pair, shard, out, times: int) -> None:
    for _ in range(times if pair is not None else 0):
        pycoll.allgather(shard, out=out, comm=pair, algorithm="ring")


def measure_local(comm: Communicator, sizes: list[int], repeats: int) -> tuple[list, list]:
    """Medians of the float32 sum reduction and of a copy, per size, every rank at once."""
    add = reducer(ReduceOp.SUM, np.dtype(np.float32))
    sync = functools.partial(pycoll.barrier, comm)
    reduces: dict[int, list[float]] = {nbytes: [] for nbytes in sizes}
    copies: dict[int, list[float]] = {nbytes: [] for nbytes in sizes}
    for _ in range(PASSES):
        for nbytes in sizes:
            dst, src = np.ones(nbytes // 4, np.float32), np.ones(nbytes // 4, np.float32)
            add(dst, src)
            reduces[nbytes].append(_median_time(functools.partial(add, dst, src), repeats, sync))
            copies[nbytes].append(_median_time(functools.partial(np.copyto, dst, src), repeats,
                                               sync))
    return ([(b, statistics.median(reduces[b])) for b in sizes],
            [(b, statistics.median(copies[b])) for b in sizes])


def measure_call(comm: Communicator, repeats: int) -> float:
    """A collective with nothing to move, back to back: the fixed cost of a call."""
    empty = np.zeros(0, np.float32)
    batch = 20
    calls = functools.partial(_allreduces, comm, empty, batch)
    calls()
    return _median_time(calls, repeats, functools.partial(pycoll.barrier, comm)) / batch


def _allreduces(comm, x, times: int) -> None:
    for _ in range(times):
        pycoll.allreduce(x, comm=comm)


@dataclass
class Tuned:
    kind: str
    topology: model.Topology
    fits: list[Fit]

    def report(self) -> str:
        t = self.topology
        head = (f"# {self.kind}: alpha {t.intra.alpha * 1e6:.2f} us, beta {_rate(t.intra.beta)}"
                + (f"; between nodes alpha {t.inter.alpha * 1e6:.2f} us, beta "
                   f"{_rate(t.inter.beta)}, {t.ranks_per_node} ranks per node"
                   if t.ranks_per_node else "")
                + f"; gamma {_rate(t.gamma)}; delta {_rate(t.delta)}; call {t.call * 1e6:.1f} us")
        lines = [head, *(f.table() for f in self.fits)]
        for name, points in t.curves:
            lines.append(f"  per-byte {name} by operation size: " + ", ".join(
                f"{b >> 10} KiB {_rate(v)}" for b, v in points))
        return "\n".join(lines)


def tune_comm(comm: Communicator, kind: str, repeats: int = 15,
              sizes: list[int] | None = None, local_sizes: list[int] | None = None
              ) -> Tuned | None:
    """Measure and fit on ``comm`` (every rank calls it); the result on rank 0, else None."""
    comm.ensure_usable()  # a freed one has no MPI duplicate to find nodes on
    sizes = STEP_SIZES if sizes is None else sizes
    local_sizes = LOCAL_SIZES if local_sizes is None else local_sizes
    nodes = [0] * comm.size
    if comm.mpi_comm is not None:
        from pycoll.bindings.mpi import node_of_each_rank

        nodes = node_of_each_rank(comm.transport.comm)  # pycoll's own: the user may free theirs
    call = measure_call(comm, repeats)
    reduce_points, copy_points = measure_local(comm, local_sizes, repeats)
    by_node: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)

    def within(rank: int) -> int | None:  # pairs inside each node
        ranks = by_node[nodes[rank]]
        i = ranks.index(rank)
        j = i + 1 if i % 2 == 0 else i - 1
        return ranks[j] if j < len(ranks) else None

    def across(rank: int) -> int | None:  # node k's i-th rank with node k^1's i-th rank
        ranks, other = by_node[nodes[rank]], nodes[rank] ^ 1
        i = ranks.index(rank)
        return by_node[other][i] if other in by_node and i < len(by_node[other]) else None

    step_intra = measure_steps(comm, within, sizes, repeats) if comm.size > 1 else None
    step_inter = measure_steps(comm, across, sizes, repeats) if len(by_node) > 1 else None
    if comm.rank != 0:
        return None
    gamma = fit("host reduction (float32 sum)", reduce_points, through_zero=True)
    delta = fit("host copy", copy_points, through_zero=True)
    fits = [gamma, delta]
    base = select.DEFAULTS[kind]

    copy_curve = tuple((b, t / b) for b, t in copy_points)
    curves = {"gamma": tuple((b, t / b) for b, t in reduce_points), "delta": copy_curve}

    def link(points, where: str, name: str) -> model.Link:
        line = fit(f"{kind} exchange step {where}, {comm.size} ranks busy", points)
        fits.insert(len(fits) - 2, line)
        # A measured call holds the call's fixed cost and its seed copy besides the step.
        alpha = max(line.fixed - call, 1e-7)
        curve = tuple(
            (b, max((t - line.fixed) / b - model._interpolate(copy_curve, b), 1e-13))
            for b, t in points if b >= CURVE_FROM
        )
        if curve:  # none when every size measured is below CURVE_FROM: the line's beta alone
            curves[name] = curve
        return model.Link(alpha, max(line.per_byte - delta.per_byte, line.per_byte / 10))

    intra = link(step_intra, "within a node", "intra") if step_intra else base.intra
    inter = link(step_inter, "between nodes", "inter") if step_inter else intra
    if "inter" not in curves and "intra" in curves:
        curves["inter"] = curves["intra"]
    topology = replace(
        base, name=f"{kind}, tuned at {comm.size} ranks", intra=intra, inter=inter,
        gamma=gamma.per_byte, delta=delta.per_byte, call=call,
        ranks_per_node=len(by_node[0]) if len(by_node) > 1 else 0, nranks=comm.size,
        source="pycoll tune", curves=tuple(sorted(curves.items())),
    )
    return Tuned(kind, topology, fits)


def tune(path=None, repeats: int = 15, sizes: list[int] | None = None,
         local_ranks: tuple[int, ...] = (2, 4), print_: Callable[[str], None] = print,
         local_sizes: list[int] | None = None) -> list[Tuned]:
    """Tune every transport present and write the tuning file (on rank 0): the MPI job's
    host transport (shared memory on one node, else MPI) at its rank count, in-process
    threads at each of ``local_ranks``."""
    results = []
    with model.tuning_file_set_aside():
        world = pycoll.world()
        if world.mpi_comm is not None and world.size > 1:
            tuned = tune_comm(world, world.host_kind(), repeats, sizes, local_sizes)
            if tuned is not None:
                results.append(tuned)
        if world.rank == 0:
            for nranks in local_ranks:
                local = pycoll.run_local(
                    nranks,
                    lambda: tune_comm(pycoll.world(), "local", repeats, sizes, local_sizes),
                )
                results.append(local[0])
    if world.rank == 0:
        written = model.save_tuning(
            [(t.kind, t.topology) for t in results], path,
            fits={f"{t.kind}@{t.topology.nranks}": {f.name: f.to_json() for f in t.fits}
                  for t in results},
        )
        for tuned in results:
            print_(tuned.report())
        print_(f"# wrote {written}")
    if world.mpi_comm is not None:
        # the world's calls from here on choose by what was just written (its costs were
        # shared by its first call, before); every rank waits here for rank 0's writing
        select.share_tuning(world)
    return results
