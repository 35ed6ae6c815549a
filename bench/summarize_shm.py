"""Medians over the runs of bench/cpu_shm.sh, as one markdown table per rank count: native
MPICH, pycoll over MPI messages, over shared memory, and over shared memory with arrays from
``pycoll.empty``, side by side, with the issue's bars checked.

    python bench/summarize_shm.py bench/results/raw-shm > bench/results/cpu-shm.md.part
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from summarize import wrong_of

SETUPS = ("mpi", "shm", "shared")


def load(folder: Path) -> dict:
    """ranks -> size -> (setup, algorithm) -> list of rows."""
    table: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for path in sorted(folder.glob("*.json")):
        setup = path.name.split("-")[0]
        for row in json.loads(path.read_text()):
            table[row["nranks"]][row["size"]][(setup, row["algorithm"])].append(row)
    return table


def human(size: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size} B"


def median(rows: list[dict], key) -> float:
    return statistics.median(key(r) for r in rows)


def _ratio(per: dict, setup: str, algorithm: str) -> float | None:
    rows = per.get((setup, algorithm))
    return median(rows, lambda row: row["native_time_us"] / row["time_us"]) if rows else None


def _roof(per: dict, setup: str, algorithm: str) -> float | None:
    rows = per.get((setup, algorithm))
    return median(rows, lambda row: row["roofline_pct"] or 0) if rows else None


def main(folder: str) -> None:
    table = load(Path(folder))
    for ranks, by_size in sorted(table.items()):
        runs = max(len(v) for per in by_size.values() for v in per.values())
        print(f"\n### AllReduce, {ranks} ranks (median of {runs} runs)\n")
        print("busbw in GB/s; `×` = native time / pycoll time, both timed in the same run "
              "(above 1: pycoll faster); `roof` = % of the memory roofline.\n")
        print("| size | native busbw | native roof | mpi auto × | shm auto busbw | shm auto × "
              "| shm auto roof | shm two_shot × | shared auto × | shared two_shot × "
              "| shared two_shot roof | #wrong |")
        print("|" + "---|" * 12)
        shortfalls = []
        for size in sorted(by_size):
            per = by_size[size]

            ratio = functools.partial(_ratio, per)
            roof = functools.partial(_roof, per)
            shm_rows = per[("shm", "auto")]
            natives = [r for rows in per.values() for r in rows]
            cells = [human(size), f"{median(natives, lambda r: r['native_busbw']):.3f}",
                     f"{median(natives, lambda r: r['native_roofline_pct'] or 0):.0f}%"]
            for setup, algorithm in (("mpi", "auto"), ("shm", "auto")):
                if setup == "shm":
                    cells.append(f"{median(shm_rows, lambda r: r['busbw']):.3f}")
                value = ratio(setup, algorithm)
                cells.append("-" if value is None else f"{value:.2f}")
            cells.append(f"{roof('shm', 'auto'):.0f}%")
            for setup, algorithm in (("shm", "two_shot"), ("shared", "auto"),
                                     ("shared", "two_shot")):
                value = ratio(setup, algorithm)
                cells.append("-" if value is None else f"{value:.2f}")
            shared_roof = roof("shared", "two_shot")
            cells.append("-" if shared_roof is None else f"{shared_roof:.0f}%")
            checked = [wrong_of(r) for r in natives if wrong_of(r) is not None]  # None: -c 0
            cells.append(str(sum(checked)) if checked else "not checked")
            print("| " + " | ".join(cells) + " |")
            shm_ratio = ratio("shm", "auto")
            if size >= 1 << 20 and shm_ratio < 2:
                shortfalls.append(f"busbw {shm_ratio:.2f}× native at {human(size)}")
            if size >= 32 << 20 and roof("shm", "auto") < 70:
                shortfalls.append(f"{roof('shm', 'auto'):.0f}% of the roofline at {human(size)}")
            if size <= 8 << 10 and 1 / shm_ratio > 1.5:
                shortfalls.append(f"{1 / shm_ratio:.2f}× native time at {human(size)}")
        print(f"\nBars for shared memory, auto, plain numpy arrays ({ranks} ranks): "
              + ("all met." if not shortfalls else "short: " + "; ".join(shortfalls) + "."))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/raw-shm")
