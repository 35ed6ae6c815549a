"""Inter-node bytes per rank of every algorithm, from the schedules (pycoll.model.traffic):
the table in docs/cluster.md.

    python bench/cluster_traffic.py RANKS RANKS_PER_NODE
"""

from __future__ import annotations

import sys

from pycoll import algorithms, model
from pycoll.schedule import ROOTED, Collective

NAMES = {Collective.ALLREDUCE: "AllReduce", Collective.REDUCE_SCATTER: "ReduceScatter",
         Collective.ALLGATHER: "AllGather", Collective.BROADCAST: "Broadcast",
         Collective.REDUCE: "Reduce"}


def main(nranks: int, per_node: int, nbytes: int = 64 << 20) -> None:
    print("| collective | algorithm | max per rank | mean per rank |")
    print("|---|---|---|---|")
    for collective, name in NAMES.items():
        for family in algorithms.families_for(collective):
            root = 0 if collective in ROOTED else None
            schedule = algorithms.build(family, collective, nranks, 1, root,
                                        ranks_per_node=per_node)
            inter = [r["inter"] for r in model.traffic(schedule, nbytes // 4, per_node, 4)]
            bold = "**" if family == "hierarchical" and collective not in ROOTED else ""
            print(f"| {name} | {bold}{family}{bold} | {bold}{max(inter) / nbytes:.3f} n{bold} "
                  f"| {bold}{sum(inter) / len(inter) / nbytes:.3f} n{bold} |")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
