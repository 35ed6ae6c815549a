"""Which algorithm serves a call, and in how many segments: the one place for these choices.

For now a size rule; the cost-model selection replaces it. A caller forces a family with
``algorithm=``; ``plan_for`` names the choice so that it can be shown.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from pycoll.algorithms import families_for
from pycoll.schedule import Collective

# A pipelined schedule cuts the array so each segment is about this many bytes.
SEGMENT_BYTES = int(os.environ.get("PYCOLL_SEGMENT_BYTES", 1 << 20))
MAX_SEGMENTS = 16
# Force every schedule to this many segments (tests, `pycoll explain --segments`); None: by size.
FORCED_SEGMENTS: int | None = (
    int(os.environ["PYCOLL_SEGMENTS"]) if os.environ.get("PYCOLL_SEGMENTS") else None
)
# At or below this size latency dominates: take the schedule with the fewest rounds.
SMALL_BYTES = 64 << 10

_SMALL = {
    Collective.ALLREDUCE: "direct",
    Collective.REDUCE_SCATTER: "direct",
    Collective.ALLGATHER: "direct",
    Collective.BROADCAST: "tree",
    Collective.REDUCE: "tree",
}
_LARGE = {
    Collective.ALLREDUCE: "ring",
    Collective.REDUCE_SCATTER: "ring",
    Collective.ALLGATHER: "ring",
    Collective.BROADCAST: "ring",
    Collective.REDUCE: "ring",
}


@dataclass(frozen=True)
class Plan:
    algorithm: str
    nsegments: int


def plan_for(collective: Collective, nbytes: int, nranks: int, algorithm: str = "auto") -> Plan:
    """The family and segment count for ``collective`` on ``nbytes`` over ``nranks`` ranks."""
    if algorithm == "auto":
        table = _SMALL if nbytes <= SMALL_BYTES else _LARGE
        algorithm = table.get(collective) or families_for(collective)[0]
    if FORCED_SEGMENTS is not None:
        return Plan(algorithm, FORCED_SEGMENTS)
    nsegments = max(1, min(MAX_SEGMENTS, math.ceil(nbytes / SEGMENT_BYTES)))
    return Plan(algorithm, nsegments)
