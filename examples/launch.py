"""What every example shares: run one function on every rank, agree on the verdict, report.

``python examples/NAME.py --ranks 4`` runs the ranks as threads of this process
(``pycoll.run_local``); ``mpiexec -n 4 python examples/NAME.py`` runs one process per rank on
the MPI world. Each rank checks its own result against the single-process computation; the
ranks then agree (an AllReduce of the failure count) so that every rank returns the same
verdict, and rank 0 prints the report.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

import pycoll
from pycoll.schedule import split as shares  # noqa: F401 - even shares, first ranks +1


@dataclass
class Report:
    """One rank's outcome: ``checks`` maps a check's name to whether it held; ``lines`` are
    what rank 0 prints (every rank may fill them; rank 0's are shown, and any rank's failed
    checks)."""

    checks: dict[str, bool] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)

    def check(self, name: str, held: bool) -> None:
        self.checks[name] = bool(held)

    def say(self, line: str) -> None:
        self.lines.append(line)


def parser(docstring: str | None) -> argparse.ArgumentParser:
    """The examples' common options, described by the first line of the example's docstring
    (None under python -OO); an example adds its own."""
    p = argparse.ArgumentParser(description=(docstring or "").split("\n", 1)[0])
    p.add_argument("--ranks", type=int, default=None,
                   help="in-process ranks (threads); default: the MPI job (one rank without "
                        "mpiexec)")
    return p


def main(name: str, on_rank: Callable[[argparse.Namespace], Report],
         arguments: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> bool:
    """Run ``on_rank(args)`` on every rank; print rank 0's report and the agreed verdict.

    Returns True when every check held on every rank (the exit status of the script)."""
    args = arguments.parse_args(argv)

    def rank_body() -> tuple[bool, list[str]]:
        comm = pycoll.world()
        report = on_rank(args)
        failed = [check for check, held in report.checks.items() if not held]
        if failed:
            # one write per line, so that threads' lines do not run together
            sys.stdout.write(f"rank {comm.rank}: FAILED {', '.join(failed)}\n")
            sys.stdout.flush()
        # every rank's counts: ranks off a root check less than rank 0, which reports
        failures, checks = (int(n) for n in pycoll.allreduce(
            np.array([len(failed), len(report.checks)], np.int64)))
        passed = failures == 0 and checks > 0
        report.say(f"{name} on {comm.size} ranks: {checks} checks in all, "
                   f"{failures} failed: {'PASSED' if passed else 'FAILED'}")
        return passed, report.lines

    if args.ranks is not None:
        if pycoll.world().size > 1:
            arguments.error("--ranks runs ranks as threads; under mpiexec leave it out")
        if args.ranks < 1:
            arguments.error(f"--ranks={args.ranks}; allowed: an int >= 1")
        results = pycoll.run_local(args.ranks, rank_body)
    else:
        results = [rank_body()]
    passed, lines = results[0]
    if pycoll.world().rank == 0:
        print("\n".join(lines), flush=True)
    return passed


def offsets(counts: Sequence[int]) -> list[int]:
    """Where each rank's share starts: [0, c0, c0 + c1, ...]."""
    return [0, *np.cumsum(counts).tolist()]
