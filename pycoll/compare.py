"""`pycoll compare`: every algorithm of a collective, and auto, measured side by side over a
size sweep, against the cost model's predictions; a markdown table and a PNG.

Measuring: for each size, every iteration runs each algorithm once, in a fresh random order,
between barriers (so all see the same machine moment), and counts the slowest rank; the median over
iterations is reported (nccl-tests' size and busbw conventions, :mod:`pycoll.bench`). Each
algorithm also runs once on integer data against the oracle (``#wrong``).

Predicting: the model's time for the plan each call ran (:func:`pycoll.select.plan_for` with
that family, or auto), on the topology the calls used (the tuning file, else defaults).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

import pycoll
from pycoll import bench, select
from pycoll.algorithms import families_for
from pycoll.api import one_shot_serves
from pycoll.comm import Communicator
from pycoll.schedule import Collective
from pycoll.spaces import HOST

BAND_BYTES = 64 << 10  # the prediction bar applies from here up


@dataclass
class Point:
    size: int
    measured_us: dict[str, float] = field(default_factory=dict)
    predicted_us: dict[str, float] = field(default_factory=dict)
    wrong: dict[str, int] = field(default_factory=dict)
    auto_choice: str = ""

    def fastest(self) -> str:
        families = {a: t for a, t in self.measured_us.items() if a != "auto"}
        return min(families, key=families.get)


@dataclass
class Comparison:
    collective: Collective
    nranks: int
    where: str
    topology: str
    algorithms: list[str]
    points: list[Point]
    costs: str = ""
    command: str = ""

    def auto_gap(self, point: Point) -> float:
        """How much slower auto measured than the fastest family at this size."""
        return point.measured_us["auto"] / point.measured_us[point.fastest()] - 1

    def prediction_error(self, point: Point, algorithm: str) -> float:
        return point.predicted_us[algorithm] / point.measured_us[algorithm] - 1

    def worst_auto_gap(self) -> float | None:
        """Over the sizes that move data (None: no such size); an empty call times only
        each path's fixed cost, which the bar is not about."""
        gaps = [self.auto_gap(p) for p in self.points if p.size > 0]
        return max(gaps) if gaps else None

    def worst_prediction_error(self, from_bytes: int = BAND_BYTES) -> float:
        errors = [abs(self.prediction_error(p, a)) for p in self.points if p.size >= from_bytes
                  for a in self.algorithms]
        return max(errors) if errors else 0.0

    def markdown(self) -> str:
        names = self.algorithms + ["auto"]
        head = "| size | " + " | ".join(f"{a} µs (model)" for a in names) + \
            " | auto ran | fastest | auto vs fastest | #wrong |"
        lines = [
            f"# {self.collective.value}, {self.nranks} ranks ({self.where})",
            "",
            f"Made by `{self.command}`." if self.command else "",
            f"Model topology: {self.topology} ({self.costs}). Times are medians over "
            "iterations of the slowest rank; each iteration runs every algorithm, in random order.",
            "",
            head,
            "|" + "---|" * (len(names) + 5),
        ]
        for p in self.points:
            cells = [f"{p.measured_us[a]:.1f} ({p.predicted_us[a]:.1f})"
                     if not math.isnan(p.predicted_us[a]) else f"{p.measured_us[a]:.1f} (-)"
                     for a in names]
            lines.append(
                f"| {bench.size_text(p.size, flag=False)} | " + " | ".join(cells)
                + f" | {p.auto_choice} | {p.fastest()} | {self.auto_gap(p):+.0%} | "
                + f"{sum(p.wrong.values())} |"
            )
        band = bench.size_text(BAND_BYTES, flag=False)
        lines += [
            "",
            f"- auto's measured time, worst over sizes that move data, against the fastest "
            f"family: {self.worst_auto_gap():+.0%} (bar: within +10%)."
            if self.worst_auto_gap() is not None else
            "- auto's measured time against the fastest family: no size that moves data was "
            "measured.",
            f"- model against measurement at ≥ {band}, worst over sizes and "
            f"algorithms: ±{self.worst_prediction_error():.0%} (bar: ±30%)."
            if any(p.size >= BAND_BYTES for p in self.points) else
            f"- model against measurement: no size at ≥ {band} was measured.",
        ]
        per_algorithm = ", ".join(
            f"{a} ±{max(abs(self.prediction_error(p, a)) for p in self.points if p.size >= BAND_BYTES):.0%}"  # noqa: E501
            for a in self.algorithms if any(p.size >= BAND_BYTES for p in self.points)
        )
        if per_algorithm:
            lines.append(f"- per algorithm at ≥ {band}: {per_algorithm}.")
        return "\n".join(line for line in lines if line is not None) + "\n"


def run(options: bench.Options, comm: Communicator, algorithms: list[str] | None = None
        ) -> Comparison:
    """Measure and predict on ``comm`` (every rank calls it; every rank gets the result)."""
    collective = bench.validate(options)
    dtype = np.dtype(options.dtype)
    families = algorithms or families_for(collective)
    topology = select.topology_for(comm, HOST)
    points = []
    for size in bench.distinct_sizes(options, collective, dtype, comm.size):
        case = bench._Case(options, collective, dtype, size, comm)
        nbytes = case.count * dtype.itemsize
        names = families + ["auto"]
        point = Point(nbytes)
        samples: dict[str, list[float]] = {a: [] for a in names}
        for a in names:  # warm up: compiles each plan once
            for _ in range(options.warmup):
                case.call(a)
        shuffle = np.random.default_rng(size)  # the same order on every rank
        barrier = bench.barrier_of(comm)
        for _ in range(options.iters):
            for a in shuffle.permutation(names):  # no algorithm always follows the same one
                barrier()
                started = time.perf_counter()
                case.call(a)
                samples[a].append(time.perf_counter() - started)
        barrier()  # every rank's last call ends before any goes on (see bench._time)
        flat = np.array([samples[a] for a in names], dtype=np.float64)
        slowest = pycoll.allreduce(flat, "max", comm=comm)
        for i, a in enumerate(names):
            point.measured_us[a] = statistics.median(slowest[i]) * 1e6
            plan = select.plan_for(collective, nbytes, comm.size, a, topology, dtype.itemsize,
                                   options.root if collective in _ROOTED else None)
            point.predicted_us[a] = plan.predicted * 1e6
            if a == "auto":
                point.auto_choice = f"{plan.algorithm}×{plan.nsegments}"
                if one_shot_serves(comm, collective, case.x.nbytes):  # no schedule: no model
                    point.auto_choice, point.predicted_us[a] = "one-shot", math.nan
            if options.check:
                point.wrong[a] = bench._count_wrong(case, a)
        points.append(point)
    where = "MPI" if comm.mpi_comm is not None else "in-process"
    costs = (f"alpha {topology.intra.alpha * 1e6:.2f} us, beta {_rate(topology.intra.beta)}, "
             f"gamma {_rate(topology.gamma)}, delta {_rate(topology.delta)}, "
             f"call {topology.call * 1e6:.1f} us; from {topology.source}")
    forced = select.forced_algorithm(collective)
    if forced is not None:  # auto's column is that family's, whatever the model says
        costs += f"; auto runs {forced}, as {select.ALGO_ENV} forces"
    return Comparison(collective, comm.size, where, topology.name, families, points, costs)


_ROOTED = (Collective.BROADCAST, Collective.REDUCE)


def _rate(seconds_per_byte: float) -> str:
    """A per-byte cost as a rate (a tuning fit on a noisy machine may give none)."""
    return (f"{1e-9 / seconds_per_byte:.1f} GB/s" if seconds_per_byte > 0
            else "no per-byte cost")


def plot(comparison: Comparison, path: str) -> None:
    """busbw against size per algorithm: measured solid, predicted dashed; the sizes where
    the measured fastest algorithm changes are marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    factor = bench.bus_factor(comparison.collective, comparison.nranks)
    # one rank moves nothing between ranks: busbw is 0 there, which a log axis cannot show
    shown = "busbw" if factor > 0 else "algbw"
    factor = factor if factor > 0 else 1.0
    points = [p for p in comparison.points if p.size > 0]  # a log axis has no 0 B
    sizes = [p.size for p in points]
    figure, axes = plt.subplots(figsize=(9, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = comparison.algorithms + ["auto"]
    for i, a in enumerate(names):
        color = colors[i % len(colors)]

        def busbw(times, sizes=sizes):
            return [s / (t * 1e-6) / 1e9 * factor if t > 0 else math.nan
                    for s, t in zip(sizes, times)]

        measured = busbw([p.measured_us[a] for p in points])
        predicted = busbw([p.predicted_us[a] for p in points])
        style = {"linewidth": 2.5} if a == "auto" else {}
        axes.plot(sizes, measured, "-o", color=color, markersize=3, label=f"{a} measured",
                  **style)
        axes.plot(sizes, predicted, "--", color=color, alpha=0.8, label=f"{a} model")
    for before, after in zip(points, points[1:]):
        if before.fastest() != after.fastest():
            boundary = math.sqrt(before.size * after.size)
            axes.axvline(boundary, color="grey", linestyle=":", linewidth=1)
            axes.annotate(f"{before.fastest()} → {after.fastest()}", (boundary, 0.98),
                          xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                          ha="right", va="top", color="grey")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("size (bytes)")
    axes.set_ylabel(f"{shown} (GB/s)")
    axes.set_title(f"pycoll {comparison.collective.value}, {comparison.nranks} ranks "
                   f"({comparison.where}): measured (solid) and model (dashed)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
