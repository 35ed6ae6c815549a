"""Evaluation: the global mean loss at a logging rank, by **Reduce** of (loss sum, token count).

Before: each rank holds the per-token losses of its own evaluation shard, with its own number
of valid tokens (shards differ: padding, uneven data). After: rank 0 holds the global loss sum
and the global valid-token count, and divides one by the other; the other ranks hold nothing
new.

Why Reduce: only the logging rank needs the number, so AllReduce would deliver a result to
ranks that do not use it. Why the sum and the count rather than each rank's mean: the global
mean is sum / count over all tokens; the mean of per-rank means weights every rank equally,
whatever its token count, and is wrong as soon as the counts differ. Both numbers travel in
one two-element Reduce (sums of integer-valued losses are exact here, so the checks are
exact).

    python examples/evaluation.py --ranks 4
    mpiexec -n 4 python examples/evaluation.py
"""

from __future__ import annotations

import sys

import numpy as np
from launch import Report, main, parser

import pycoll


def token_losses(rank: int, equal: bool) -> np.ndarray:
    """Rank ``rank``'s per-token losses: integer-valued; 6 tokens each when ``equal``, else
    2 + 3 * rank."""
    count = 6 if equal else 2 + 3 * rank
    return np.random.default_rng(rank).integers(0, 10, count).astype(np.float64)


def global_mean(losses: np.ndarray) -> float | None:
    """Reduce (sum, count) to rank 0; the mean there, None elsewhere."""
    totals = pycoll.reduce(np.array([losses.sum(), losses.size], np.float64), "sum", root=0)
    return None if totals is None else float(totals[0] / totals[1])


def mean_of_means(losses: np.ndarray) -> float | None:
    """The tempting mistake: average the ranks' own means (at rank 0)."""
    means = pycoll.reduce(np.array([losses.mean()]), "sum", root=0)
    return None if means is None else float(means[0] / pycoll.world().size)


def on_rank(args) -> Report:
    comm = pycoll.world()
    report = Report()
    for equal in (False, True):
        kind = "equal counts" if equal else "unequal counts"
        everything = [token_losses(r, equal) for r in range(comm.size)]  # single process
        expected = float(np.concatenate(everything).mean())
        mine = token_losses(comm.rank, equal)
        mean, wrong = global_mean(mine), mean_of_means(mine)
        if comm.rank != 0:
            report.check(f"{kind}: no result off the root", mean is None and wrong is None)
            continue
        report.check(f"{kind}: global mean", mean == expected)
        counts = [len(x) for x in everything]
        report.say(f"{kind} {counts}: sum/count at rank 0 = {mean:.6f} "
                   f"(single process {expected:.6f}); mean of per-rank means = {wrong:.6f}")
        # per-rank means agree with the global mean when the counts are equal, not otherwise
        # (unless by accident: rank 0's alone at one rank)
        if equal or comm.size == 1:
            report.check(f"{kind}: mean of means", np.isclose(wrong, expected, rtol=1e-15))
        else:
            report.check(f"{kind}: mean of means is wrong", wrong != expected)
    return report


if __name__ == "__main__":
    sys.exit(0 if main("evaluation", on_rank, parser(__doc__)) else 1)
