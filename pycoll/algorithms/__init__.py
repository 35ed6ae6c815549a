"""Algorithm families. Each module only emits schedules; it never touches arrays or transports.

Every family module defines ``SCHEDULES``, a mapping from :class:`Collective` to a function:

* unrooted collectives: ``f(nranks, nsegments=1) -> Schedule``
* Broadcast and Reduce: ``f(nranks, root, nsegments=1) -> Schedule``
* Send/Recv: ``f(nranks, src, dst, nsegments=1) -> Schedule``

A family whose module sets ``NODE_AWARE = True`` (hierarchical, hierarchical_tree) also takes
``ranks_per_node=``: the ranks form nodes of that many consecutive ranks (0: one node).
"""

from __future__ import annotations

from functools import lru_cache
from types import ModuleType

from pycoll.algorithms import (
    direct,
    halving_doubling,
    hierarchical,
    hierarchical_tree,
    ring,
    tree,
    two_shot,
)
from pycoll.schedule import ROOTED, Collective, Schedule

FAMILIES: dict[str, ModuleType] = {
    "ring": ring,
    "tree": tree,
    "halving_doubling": halving_doubling,
    "direct": direct,
    "two_shot": two_shot,
    "hierarchical": hierarchical,
    "hierarchical_tree": hierarchical_tree,
}


def families_for(collective: Collective) -> list[str]:
    """The family names that have a schedule for ``collective``."""
    return [name for name, module in FAMILIES.items() if collective in module.SCHEDULES]


def node_aware(family: str) -> bool:
    """Whether ``family``'s schedules depend on the ranks' nodes."""
    return getattr(FAMILIES.get(family), "NODE_AWARE", False)


def build(
    family: str,
    collective: Collective,
    nranks: int,
    nsegments: int = 1,
    root: int | None = None,
    peer: int | None = None,
    ranks_per_node: int = 0,
) -> Schedule:
    """The schedule ``family`` emits for ``collective``; cached, since schedules are immutable.
    ``ranks_per_node`` (0: one node) matters to node-aware families only."""
    if not isinstance(nsegments, int) or nsegments < 1:  # zero segments would move nothing
        raise ValueError(f"nsegments={nsegments!r} is invalid; allowed: an int >= 1")
    if ranks_per_node >= nranks or not node_aware(family):
        ranks_per_node = 0  # one cache entry for what does not depend on it
    return _build(family, collective, nranks, nsegments, root, peer, ranks_per_node)


def check_family(family: str, collective: Collective) -> None:
    """Raise unless ``family`` names a family with a schedule for ``collective``."""
    if family not in FAMILIES:
        raise ValueError(
            f"algorithm={family!r} is not an algorithm family; allowed: "
            + ", ".join(repr(name) for name in FAMILIES)
        )
    if collective not in FAMILIES[family].SCHEDULES:
        raise ValueError(
            f"algorithm={family!r} has no {collective.value} schedule; allowed for "
            f"{collective.value}: " + ", ".join(repr(n) for n in families_for(collective))
        )


@lru_cache(maxsize=1024)
def _build(family: str, collective: Collective, nranks: int, nsegments: int,
           root: int | None, peer: int | None, ranks_per_node: int) -> Schedule:
    check_family(family, collective)
    emit = FAMILIES[family].SCHEDULES[collective]
    nodes = {"ranks_per_node": ranks_per_node} if node_aware(family) else {}
    if collective in ROOTED:
        return emit(nranks, root, nsegments, **nodes)
    if collective is Collective.SENDRECV:
        return emit(nranks, root, peer, nsegments)
    return emit(nranks, nsegments, **nodes)
