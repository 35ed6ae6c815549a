"""The `pycoll` command: demo, explain."""

from __future__ import annotations

import argparse
import sys

from pycoll.algorithms import FAMILIES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pycoll", description="Collective communication whose algorithms are checked data."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "demo", help="run every collective of the seed on 4 in-process ranks, then its FSDP step"
    )
    explain = commands.add_parser(
        "explain", help="print a schedule round by round on the seed's inputs, then the results"
    )
    explain.add_argument(
        "collective",
        choices=["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall"],
    )
    explain.add_argument("--ranks", type=int, default=4, help="rank count (default 4)")
    explain.add_argument("--algorithm", default="ring", choices=sorted(FAMILIES))
    explain.add_argument("--root", type=int, default=0, help="root of broadcast/reduce")
    explain.add_argument("--segments", type=int, default=1, help="segments per block")
    args = parser.parse_args(argv)

    from pycoll import explain as scenes

    try:
        if args.command == "demo":
            ok = scenes.demo()
        else:
            ok = scenes.explain(
                args.collective, args.ranks, args.algorithm, args.root, args.segments
            )
    except ValueError as error:
        print(f"pycoll {args.command}: {error}", file=sys.stderr)
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
