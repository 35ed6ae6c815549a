"""Medians over bench/cpu_small.sh's runs: per transport, collective and size, pycoll's time
over native MPI's (both timed in one run), for this tree and, where the sweep had one, the
older tree.

    python bench/summarize_small.py bench/results/raw-small
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from summarize import human, wrong_of


def load(folder: Path) -> dict:
    """(transport, collective, size) -> tree -> list of pycoll time / native time; #wrong."""
    slowdowns: dict = defaultdict(lambda: defaultdict(list))
    wrong = 0
    for path in sorted(folder.glob("*.json")):
        tree, transport = path.name.split("-")[:2]
        for row in json.loads(path.read_text()):
            slowdowns[(transport, row["collective"], row["size"])][tree].append(
                row["time_us"] / row["native_time_us"])
            wrong += wrong_of(row) or 0  # None: not checked (-c 0)
    return {"slowdowns": slowdowns, "wrong": wrong}


def main(folder: str) -> None:
    loaded = load(Path(folder))
    slowdowns = loaded["slowdowns"]
    trees = sorted({t for per in slowdowns.values() for t in per}, reverse=True)  # new, old
    runs = max(len(v) for per in slowdowns.values() for v in per.values())
    print(f"pycoll time / native time, both timed in one run (median of {runs} runs; the MPI "
          "issue's bar: AllReduce over mpi at most 2)\n")
    head = ["transport", "collective", "size", *trees]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for (transport, collective, size), per in sorted(slowdowns.items()):
        cells = [f"{statistics.median(per[t]):.2f}" if per.get(t) else "-" for t in trees]
        print(f"| {transport} | {collective} | {human(size)} | " + " | ".join(cells) + " |")
    print(f"\n#wrong over every checking run: {loaded['wrong']}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/raw-small")
