"""`pycoll demo` and `pycoll explain`: the seed's scenes, run and checked on in-process ranks.

Both use the seed's inputs: on N ranks, rank r holds [N·r+1, …, N·r+N] (with N = 4: rank 0
holds [1, 2, 3, 4], rank 3 holds [13, 14, 15, 16]). For AllGather, rank r holds the single
element at position r of that row, so four ranks hold A0=1, B1=6, C2=11 and D3=16.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import Any

import numpy as np

import pycoll
from pycoll import algorithms, oracle, select
from pycoll.check import check
from pycoll.schedule import Buffer, Collective, Layout, seeded_chunks

SEED_RANKS = 4
MAX_RANKS = 64  # every delivery of every round is printed: p^2 lines a round (256 took minutes)


def seed_input(nranks: int, rank: int) -> np.ndarray:
    return np.arange(nranks * rank + 1, nranks * rank + nranks + 1, dtype=np.int64)


def seed_shard(nranks: int, rank: int) -> np.ndarray:
    return seed_input(nranks, rank)[rank : rank + 1]


def _show(values: np.ndarray) -> str:
    # Floats rounded to 12 digits print as the seed writes them: 9.3, 39.0.
    shown = (str(round(v, 12)) if isinstance(v, float) else str(v) for v in values.tolist())
    return "[" + ", ".join(shown) + "]"


# Each scene: (title, what rank r calls, the oracle's result for rank r, the inputs shown).
def _scenes(nranks: int, root: int) -> list[tuple[str, Callable, Callable, Callable]]:
    rows = [seed_input(nranks, r) for r in range(nranks)]
    shards = [seed_shard(nranks, r) for r in range(nranks)]

    def row():
        return seed_input(nranks, pycoll.world().rank)

    def shard():
        return seed_shard(nranks, pycoll.world().rank)

    reduced = oracle.allreduce(rows, "sum")
    scattered = oracle.reduce_scatter(rows, "sum")
    exchanged = oracle.alltoall(rows)

    def send_recv():
        rank = pycoll.world().rank
        if rank == root:
            pycoll.send(row(), dst=(root + 1) % nranks)
            return None
        if rank == (root + 1) % nranks:
            return pycoll.recv(np.zeros(nranks, np.int64), src=root)
        return None

    receiver = (root + 1) % nranks
    return [
        (
            f"Broadcast from rank {root}",
            lambda: pycoll.broadcast(
                row() if pycoll.world().rank == root else np.zeros(nranks, np.int64), root
            ),
            lambda r: oracle.broadcast(rows, root),
            lambda r: rows[r] if r == root else None,
        ),
        (
            f"Reduce (sum) to rank {root}",
            lambda: pycoll.reduce(row(), "sum", root),
            lambda r: reduced if r == root else None,
            lambda r: rows[r],
        ),
        ("AllReduce (sum)", lambda: pycoll.allreduce(row()), lambda r: reduced, lambda r: rows[r]),
        (
            "AllGather",
            lambda: pycoll.allgather(shard()),
            lambda r: oracle.allgather(shards),
            lambda r: shards[r],
        ),
        (
            "ReduceScatter (sum)",
            lambda: pycoll.reduce_scatter(row()),
            lambda r: scattered[r],
            lambda r: rows[r],
        ),
        ("AllToAll", lambda: pycoll.alltoall(row()), lambda r: exchanged[r], lambda r: rows[r]),
        (
            f"Send/Recv rank {root} -> rank {receiver}",
            send_recv,
            lambda r: oracle.sendrecv(rows, root, receiver) if r == receiver else None,
            lambda r: rows[r] if r == root else None,
        ),
    ]


def demo(print_: Callable[[str], None] = print) -> bool:
    """Run every collective of the seed, then its FSDP step; True when all match the oracle."""
    nranks = SEED_RANKS
    print_(f"pycoll demo: {nranks} in-process ranks; rank r holds [4r+1, 4r+2, 4r+3, 4r+4]\n")
    all_match = True
    for title, call, expect, shown_input in _scenes(nranks, root=0):
        results = pycoll.run_local(nranks, call)
        print_(title)
        match = True
        for rank, result in enumerate(results):
            want, given = expect(rank), shown_input(rank)
            ok = (result is None and want is None) or (
                result is not None and want is not None and np.array_equal(result, want)
            )
            match &= ok
            before = "-" if given is None else _show(given)
            after = "no result" if result is None else _show(result)
            print_(f"  rank {rank}: {before:>16} -> {after}")
        print_("  matches the numpy oracle\n" if match else "  DIFFERS from the numpy oracle\n")
        all_match &= match
    all_match &= fsdp_step(print_)
    return all_match


def fsdp_step(print_: Callable[[str], None] = print) -> bool:
    """The seed's FSDP step: ReduceScatter gradients, average, SGD on each shard, AllGather."""
    nranks, learning_rate = SEED_RANKS, 0.1
    parameters = np.array([10.0, 20.0, 30.0, 40.0])

    def step():
        rank = pycoll.world().rank
        gradients = seed_input(nranks, rank).astype(np.float64)
        mine = pycoll.reduce_scatter(gradients, "sum") / nranks  # this owner's mean gradient
        shard = parameters[rank : rank + 1] - learning_rate * mine
        return pycoll.allgather(shard)

    results = pycoll.run_local(nranks, step)
    expected = np.array([9.3, 19.2, 29.1, 39.0])
    match = all(np.allclose(r, expected, rtol=0, atol=1e-12) for r in results)
    print_(f"FSDP step: parameters {_show(parameters)}, gradients as above, SGD lr {learning_rate}")
    print_(
        "  ReduceScatter(sum) -> rank r owns sum of w_r's gradients; divide by 4; update; AllGather"
    )
    for rank, result in enumerate(results):
        print_(f"  rank {rank}: {_show(result)}")
    print_(
        "  matches [9.3, 19.2, 29.1, 39.0]\n"
        if match
        else "  DIFFERS from [9.3, 19.2, 29.1, 39.0]\n"
    )
    return match


_CALLS = {
    Collective.ALLREDUCE: lambda x, algorithm, root: pycoll.allreduce(x, algorithm=algorithm),
    Collective.REDUCE_SCATTER: lambda x, algorithm, root: pycoll.reduce_scatter(
        x, algorithm=algorithm
    ),
    Collective.ALLGATHER: lambda x, algorithm, root: pycoll.allgather(x, algorithm=algorithm),
    Collective.BROADCAST: lambda x, algorithm, root: pycoll.broadcast(x, root, algorithm=algorithm),
    Collective.REDUCE: lambda x, algorithm, root: pycoll.reduce(
        x, "sum", root, algorithm=algorithm
    ),
    Collective.ALLTOALL: lambda x, algorithm, root: pycoll.alltoall(x),
}


def explain(
    collective: str,
    nranks: int,
    algorithm: str | None,
    root: int = 0,
    nsegments: int = 1,
    print_: Callable[[str], None] = print,
) -> bool:
    """Print the schedule round by round on the seed's inputs, then each rank's real result."""
    kind = _collective(collective)
    if isinstance(nranks, bool) or not isinstance(nranks, int) or not 1 <= nranks <= MAX_RANKS:
        raise ValueError(f"--ranks={nranks!r} is invalid; allowed: an int in 1..{MAX_RANKS}")
    if algorithm is None:  # the default: ring, or alltoall's one schedule
        algorithm = "direct" if kind is Collective.ALLTOALL else "ring"
    try:  # before anything is printed (a note on node-aware families came first)
        algorithms.check_family(algorithm, kind)
    except ValueError as error:
        raise ValueError(f"--{error}") from None  # "algorithm=...": the flag's name
    rooted = kind in (Collective.BROADCAST, Collective.REDUCE)
    if rooted and not 0 <= root < nranks:
        raise ValueError(f"--root={root} is not a rank; allowed: 0..{nranks - 1}")
    if not rooted:  # as bench: --root applies to broadcast and reduce alone
        root = 0
    if nsegments < 1:
        raise ValueError(f"--segments={nsegments} is invalid; allowed: an int >= 1")
    if nsegments > nranks:  # the seed's nranks elements: a run makes one segment per element
        print_(f"pycoll explain: --segments={nsegments}: at most one per element, as a run "
               f"makes them: {nranks}")
        nsegments = nranks
    # the nodes (PYCOLL_RANKS_PER_NODE) as the run below sees them: for hierarchical
    per_node, nnodes = pycoll.run_local(
        nranks, lambda: (pycoll.world().ranks_per_node, len(set(pycoll.world().nodes()))))[0]
    if algorithms.node_aware(algorithm) and per_node == 0:
        where = ("one node" if nnodes == 1 else
                 f"nodes of unequal size (PYCOLL_RANKS_PER_NODE does not divide {nranks})")
        print_(f"pycoll explain: {algorithm} on {where} runs as its flat schedule, shown here; "
               "set PYCOLL_RANKS_PER_NODE to a divisor of --ranks to see the nodes")
    schedule = algorithms.build(algorithm, kind, nranks, nsegments, root,
                                ranks_per_node=per_node)
    report = check(schedule)
    inputs = [
        seed_shard(nranks, r) if kind is Collective.ALLGATHER else seed_input(nranks, r)
        for r in range(nranks)
    ]
    if kind is Collective.ALLGATHER:
        layout = Layout([1] * nranks, nsegments)
        input_layout = Layout([1], nsegments)
    else:
        layout = input_layout = Layout.even(nranks, schedule.nblocks, nsegments)
    broadcast = kind is Collective.BROADCAST
    if broadcast:
        inputs = [x if r == root else np.zeros_like(x) for r, x in enumerate(inputs)]

    def value(contents) -> str:
        if contents is None:  # a broadcast's x off the root: written over, as the demo's "-"
            return "-" if broadcast else "(undefined)"
        total = None
        for origin_rank, origin_chunk in sorted(contents):
            start, stop = input_layout.chunk_range(origin_chunk)
            part = inputs[origin_rank][start:stop]
            total = part.copy() if total is None else total + part
        return _show(total)

    def elements(chunk: int) -> str:
        start, stop = layout.chunk_range(chunk)
        if stop == start:  # more chunks than elements: the run drops this transfer
            return "no elements"
        return f"element {start}" if stop == start + 1 else f"elements {start}..{stop - 1}"

    at_root = f", root {root}" if rooted else ""
    holds = f"[{nranks}r+1, ..., {nranks}r+{nranks}]"
    print_(
        f"pycoll explain: {algorithm} {kind.value} on {nranks} ranks{at_root}, "
        f"{nsegments} segment(s), {schedule.nchunks} chunks; "
        + (f"the root (r = {root}) holds {holds}; the others' x is written over (-)"
           if broadcast else f"rank r holds {holds}")
        + (", AllGather shard: its element r" if kind is Collective.ALLGATHER else "")
    )
    for rank in range(nranks):
        shown = "-" if broadcast and rank != root else _show(inputs[rank])
        print_(f"  rank {rank}: {shown}")
    state = _initial_state(schedule)
    for number, unordered in enumerate(report.rounds, 1):
        deliveries = sorted(unordered, key=lambda d: (d.src, d.dst))
        print_(f"round {number}")
        for d in deliveries:
            source = "its input" if d.src_buffer is Buffer.INPUT else "chunk"
            print_(
                f"  rank {d.src} sends {source} {d.src_chunk} ({value(d.contents)}) to rank {d.dst}"
            )
        for d in deliveries:
            before = state[d.dst][d.dst_chunk]
            after = (before | d.contents) if d.reduce else d.contents
            verb = "adds it into" if d.reduce else "stores it as"
            print_(
                f"  rank {d.dst} {verb} chunk {d.dst_chunk} ({elements(d.dst_chunk)}): "
                f"{value(before)} -> {value(after)}"
            )
            state[d.dst][d.dst_chunk] = after

    def run() -> tuple[Any, int]:
        comm = pycoll.world()
        comm.traffic.reset()
        result = _CALLS[kind](inputs[comm.rank].copy(), algorithm, root)
        return result, sum(comm.traffic.messages.values())

    select.FORCED_SEGMENTS, saved = nsegments, select.FORCED_SEGMENTS
    try:
        results, messages = zip(*pycoll.run_local(nranks, run))
    finally:
        select.FORCED_SEGMENTS = saved
    sends = [sum(d.src == rank for d in chain.from_iterable(report.rounds))
             for rank in range(nranks)]
    if list(messages) != sends:
        print_("messages the run sent (the sends above to one peer in one step whose chunks lie "
               "side by side travel as one; chunks of no elements are not sent): "
               + ", ".join(f"rank {r}: {m} for {s} sends" for r, (m, s) in
                           enumerate(zip(messages, sends))))
    expected = _expected(kind, inputs, root)
    print_("results (run on in-process ranks)")
    match = True
    for rank, result in enumerate(results):
        want = expected[rank]
        ok = (result is None) == (want is None) and (result is None or np.array_equal(result, want))
        match &= ok
        print_(f"  rank {rank}: {'no result' if result is None else _show(result)}")
    print_("matches the numpy oracle" if match else "DIFFERS from the numpy oracle")
    return match


def _collective(name: str) -> Collective:
    allowed = [c.value for c in _CALLS]
    if name not in allowed:
        raise ValueError(f"collective={name!r} is unknown; allowed: {', '.join(allowed)}")
    return Collective(name)


def _initial_state(schedule) -> list[dict]:
    """Every rank's WORK chunks after seeding, as sets of (origin rank, origin chunk)."""
    states = []
    for rank in range(schedule.nranks):
        state = dict.fromkeys(range(schedule.nchunks))
        for input_chunk, work_chunk in seeded_chunks(schedule, rank):
            state[work_chunk] = frozenset({(rank, input_chunk)})
        states.append(state)
    return states


def _expected(kind: Collective, inputs, root):
    n = len(inputs)
    if kind is Collective.ALLREDUCE:
        return [oracle.allreduce(inputs, "sum")] * n
    if kind is Collective.REDUCE_SCATTER:
        return oracle.reduce_scatter(inputs, "sum")
    if kind is Collective.ALLGATHER:
        return [oracle.allgather(inputs)] * n
    if kind is Collective.BROADCAST:
        return [oracle.broadcast(inputs, root)] * n
    if kind is Collective.REDUCE:
        return [oracle.reduce(inputs, "sum", root) if r == root else None for r in range(n)]
    return oracle.alltoall(inputs)
