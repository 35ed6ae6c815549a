"""Medians over repeated `pycoll bench --json` runs, as a markdown table per collective and
rank count: pycoll's best algorithm and auto against native MPI, side by side.

    python bench/summarize.py bench/results/raw > bench/results/cpu-mpich.md
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def wrong_of(row: dict) -> int | None:
    """A JSON row's #wrong over both sets, out of place and in place (None: not checked)."""
    if row["wrong"] is None:
        return None
    return row["wrong"] + (row.get("in_place_wrong") or 0)  # None: run with --in-place 0


def load(folder: Path) -> dict:
    """(collective, ranks) -> size -> algorithm -> list of (time_us, native_us, wrong)."""
    table: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for path in sorted(folder.glob("*.json")):
        for row in json.loads(path.read_text()):
            if row.get("native_time_us") is None:
                sys.exit(f"{path}: a row without native MPI times; this table compares "
                         "against them: run `pycoll bench --against mpi` under mpiexec")
            key = (row["collective"], row["nranks"])
            table[key][row["size"]][row["algorithm"]].append(
                (row["time_us"], row["native_time_us"], wrong_of(row), row["busbw"],
                 row["native_busbw"])
            )
    return table


def human(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


def main(folder: str) -> None:
    table = load(Path(folder))
    for (collective, ranks), by_size in sorted(table.items()):
        algorithms = sorted({a for per in by_size.values() for a in per} - {"auto"}) + ["auto"]
        runs = max(len(v) for per in by_size.values() for v in per.values())
        print(f"\n### {collective}, {ranks} ranks (median of {runs} runs)\n")
        print("busbw in GB/s; `ratio` = native time / pycoll time (above 1: pycoll faster).\n")
        head = ["size"] + [f"{a}" for a in algorithms] + ["native MPI", "best", "best ratio",
                                                          "auto ratio", "#wrong"]
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for size in sorted(by_size):
            per = by_size[size]
            cells, ratios, natives, wrong = [human(size)], {}, [], []
            for algorithm in algorithms:
                samples = per.get(algorithm, [])
                if not samples:
                    cells.append("-")
                    continue
                busbw = statistics.median(s[3] for s in samples)
                ratios[algorithm] = statistics.median(s[1] / s[0] for s in samples if s[0] > 0)
                natives += [s[4] for s in samples]
                wrong += [s[2] for s in samples if s[2] is not None]  # None: -c 0
                cells.append(f"{busbw:.3f}")
            cells.append(f"{statistics.median(natives):.3f}")
            best = max((a for a in ratios if a != "auto"), key=ratios.get, default=None)
            cells += ["-", "-"] if best is None else [best, f"{ratios[best]:.2f}"]
            cells += [f"{ratios['auto']:.2f}" if "auto" in ratios else "-",
                      str(sum(wrong)) if wrong else "not checked"]
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/raw")
