"""Run under mpiexec: every collective × algorithm against the oracle and mpi4py's natives.

Each rank builds every rank's inputs from the same seeds, so each can compute the oracle's
answer locally. Rank 0 prints one summary line, 'N passed, M failed'; the exit status is
non-zero when any rank saw a failure.
"""

from __future__ import annotations

import sys
import traceback
from functools import partial

import numpy as np
from mpi4py import MPI

import pycoll
from pycoll import oracle
from pycoll.algorithms import families_for
from pycoll.schedule import Collective

comm = pycoll.world()
native = MPI.COMM_WORLD
P, RANK = comm.size, comm.rank
MPI_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}
DTYPES = [np.int32, np.int64, np.float32, np.float64, np.uint8, np.float16, np.complex64]
passed = failed = 0


def inputs_for(count: int, dtype, op: str, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    values = rng.choice([1, 2] if op == "prod" else [0, 1, 2, 3], size=(P, count))
    return [np.ascontiguousarray(values[r].astype(dtype)) for r in range(P)]


def case(name: str, got, want) -> None:
    global passed, failed
    ok = (got is None and want is None) or (
        got is not None and want is not None and np.array_equal(got, want)
    )
    if ok:
        passed += 1
    else:
        failed += 1
        print(f"rank {RANK}: FAILED {name}: got {got!r}, want {want!r}", flush=True)


def run(name: str, fn) -> None:
    global failed
    try:
        fn()
    except Exception:
        failed += 1
        print(f"rank {RANK}: ERROR in {name}\n{traceback.format_exc()}", flush=True)


def check_reducing(index: int, count: int) -> None:
    dtype = DTYPES[index % len(DTYPES)]
    complex_ = np.dtype(dtype).kind == "c"
    ops = ["sum", "prod", "avg"] if complex_ else ["sum", "prod", "min", "max", "avg"]
    op = ops[index % len(ops)]
    xs = inputs_for(count, dtype, op, index)
    x, root = xs[RANK], index % P
    rows = [len(part) for part in np.array_split(np.arange(count), P)]
    has_native = op in MPI_OPS and np.dtype(dtype).kind in "iuf" and dtype is not np.float16
    for algorithm in [*families_for(Collective.ALLREDUCE), "auto"]:
        label = f"allreduce {algorithm} {np.dtype(dtype)} {op} n={count}"
        case(label, pycoll.allreduce(x, op, algorithm=algorithm), oracle.allreduce(xs, op))
    for algorithm in [*families_for(Collective.REDUCE_SCATTER), "auto"]:
        label = f"reduce_scatter {algorithm} {np.dtype(dtype)} {op} n={count}"
        got = pycoll.reduce_scatter(x, op, counts=rows, algorithm=algorithm)
        case(label, got, oracle.reduce_scatter(xs, op, rows)[RANK])
        mine = x.copy()  # in place, as NCCL's: out is this rank's rows of x
        start = sum(rows[:RANK])
        pycoll.reduce_scatter(mine, op, counts=rows, out=mine[start:start + rows[RANK]],
                              algorithm=algorithm)
        case(f"{label} in place", mine[start:start + rows[RANK]], got)
    for algorithm in [*families_for(Collective.REDUCE), "auto"]:
        label = f"reduce {algorithm} {np.dtype(dtype)} {op} root={root} n={count}"
        want = oracle.reduce(xs, op, root) if RANK == root else None
        case(label, pycoll.reduce(x, op, root, algorithm=algorithm), want)
    if has_native:
        mpi_op = MPI_OPS[op]
        out = np.empty_like(x)
        native.Allreduce(x, out, op=mpi_op)
        case(f"allreduce vs native {label}", pycoll.allreduce(x, op), out)
        shard = np.empty(rows[RANK], x.dtype)
        native.Reduce_scatter(x, shard, recvcounts=rows, op=mpi_op)
        case(f"reduce_scatter vs native {label}", pycoll.reduce_scatter(x, op, counts=rows), shard)
        reduced = np.empty_like(x) if RANK == root else None
        native.Reduce(x, reduced, op=mpi_op, root=root)
        case(f"reduce vs native {label}", pycoll.reduce(x, op, root), reduced)


def check_moving(index: int, count: int) -> None:
    dtype = DTYPES[index % len(DTYPES)]
    rows = [len(part) for part in np.array_split(np.arange(count), P)][::-1]
    shards = inputs_for(max(rows), dtype, "sum", index)
    shards = [shards[r][: rows[r]].copy() for r in range(P)]
    root = (index * 3) % P
    for algorithm in [*families_for(Collective.ALLGATHER), "auto"]:
        got = pycoll.allgather(shards[RANK], counts=rows, algorithm=algorithm)
        case(f"allgather {algorithm} n={count}", got, oracle.allgather(shards))
        out = np.zeros_like(got)  # in place, as NCCL's: x is this rank's rows of out
        start = sum(rows[:RANK])
        out[start:start + rows[RANK]] = shards[RANK]
        pycoll.allgather(out[start:start + rows[RANK]], counts=rows, out=out,
                         algorithm=algorithm)
        case(f"allgather {algorithm} n={count} in place", out, oracle.allgather(shards))
    full = inputs_for(count, dtype, "sum", index + 1)
    for algorithm in [*families_for(Collective.BROADCAST), "auto"]:
        got = pycoll.broadcast(full[RANK].copy(), root, algorithm=algorithm)
        case(f"broadcast {algorithm} root={root} n={count}", got, oracle.broadcast(full, root))
    gathered = np.empty(sum(rows), shards[RANK].dtype)
    native.Allgatherv(shards[RANK], [gathered, rows])
    case(f"allgather vs native n={count}", pycoll.allgather(shards[RANK], counts=rows), gathered)
    copy = full[RANK].copy()
    native.Bcast(copy, root=root)
    case(f"broadcast vs native n={count}", pycoll.broadcast(full[RANK].copy(), root), copy)


def check_alltoall(per_peer: int) -> None:
    xs = inputs_for(P * per_peer, np.int64, "sum", per_peer)
    out = np.empty_like(xs[RANK])
    native.Alltoall(xs[RANK], out)
    got = pycoll.alltoall(xs[RANK])
    case(f"alltoall {per_peer} per peer", got, oracle.alltoall(xs)[RANK])
    case(f"alltoall vs native {per_peer} per peer", got, out)
    rng = np.random.default_rng(per_peer)
    counts = rng.integers(0, 4, size=(P, P))
    ys = [np.arange(counts[r].sum(), dtype=np.float64) + 100 * r for r in range(P)]
    recv = np.empty(int(counts[:, RANK].sum()))
    native.Alltoallv([ys[RANK], counts[RANK].tolist()], [recv, counts[:, RANK].tolist()])
    got = pycoll.alltoallv(ys[RANK], counts[RANK].tolist())
    case(f"alltoallv {per_peer}", got, oracle.alltoallv(ys, counts.tolist())[RANK])
    into = np.full_like(got, -1)  # an out of the caller's, without recv_counts
    pycoll.alltoallv(ys[RANK], counts[RANK].tolist(), out=into)
    case(f"alltoallv {per_peer} into out", into, got)
    case(f"alltoallv vs native {per_peer}", got, recv)


def check_point_to_point_and_groups() -> None:
    if P > 1:
        payload = np.arange(5, dtype=np.float32) + RANK
        got = np.empty(5, np.float32)
        if RANK % 2 == 0:
            pycoll.send(payload, (RANK + 1) % P, tag=3)
            pycoll.recv(got, (RANK - 1) % P, tag=3)
        else:
            pycoll.recv(got, (RANK - 1) % P, tag=3)
            pycoll.send(payload, (RANK + 1) % P, tag=3)
        case("send/recv ring", got, np.arange(5, dtype=np.float32) + (RANK - 1) % P)
        # an empty message is a message: rank 0 sends its token last, and the next rank's
        # empty receive takes it, not rank 0's later message on the same tag
        if RANK == 0:
            pycoll.send(np.empty(0), 1, tag=4)
            pycoll.send(np.full(2, 7.0), 1, tag=4)
        elif RANK == 1:
            token, after = np.empty(0), np.empty(2)
            pycoll.recv(token, 0, tag=4)
            pycoll.recv(after, 0, tag=4)
            case("empty send/recv, then the next message", after, np.full(2, 7.0))
    halves = comm.split(RANK % 2, key=-RANK)
    members = [r for r in range(P) if r % 2 == RANK % 2][::-1]
    case("split size", np.array(halves.size), np.array(len(members)))
    case("split rank", np.array(halves.rank), np.array(members.index(RANK)))
    got = pycoll.allreduce(np.array([RANK]), comm=halves)
    case("allreduce on a split", got, np.array([sum(members)]))
    for i in range(3):  # interleave world and split collectives of the same shape
        on_world = pycoll.allreduce(np.array([RANK + i]), comm=comm, algorithm="ring")
        on_half = pycoll.allreduce(np.array([RANK * i]), comm=halves, algorithm="ring")
        case(f"interleaved world {i}", on_world, np.array([P * (P - 1) // 2 + P * i]))
        case(f"interleaved split {i}", on_half, np.array([sum(members) * i]))
    group = pycoll.new_group([0], comm=comm)
    case("new_group outside", np.array(group is None), np.array(RANK != 0))
    shared = pycoll.empty(1000, np.int64, comm=halves)  # sent in place, then freed
    shared[...] = RANK
    got = pycoll.allreduce(shared, comm=halves, algorithm="two_shot")
    case("allreduce of pycoll.empty", got, np.full(1000, sum(members)))
    halves.free()
    try:
        pycoll.allreduce(np.ones(2), comm=halves)
        case("a freed communicator refuses", np.array(False), np.array(True))
    except RuntimeError:
        case("a freed communicator refuses", np.array(True), np.array(True))
    pycoll.barrier()


def check_plan_on_one_rank() -> None:
    """pycoll.plan takes no collective step: one rank may call it alone, on a communicator
    that has run nothing yet, for host and device arrays."""
    fresh = pycoll.Communicator()
    if RANK == P - 1:
        for device in (False, True):
            chosen = pycoll.plan("allreduce", 1 << 20, fresh, device=device)
            case(f"plan alone (device={device})", np.array(chosen.nbytes), np.array(1 << 20))
    pycoll.barrier(fresh)
    fresh.free()


def check_a_short_message_is_an_error() -> None:
    """A receive buffer larger than the message: an error naming both counts (MPI alone
    would fill the buffer's start silently); smaller (MPI's truncation): one naming the
    receive."""
    if P == 1:
        return
    for name, count, tag, said in [
        ("a short message is an error", 8, 11, "expects 64 bytes from rank 0 (tag 11) and "
                                               "received 32"),
        ("a long message is an error", 2, 12, "expects 16 bytes from rank 0 (tag 12) and the "
                                              "message is longer"),
    ]:
        if RANK == 0:
            pycoll.send(np.arange(4.0), P - 1, tag=tag)
        elif RANK == P - 1:
            try:
                pycoll.recv(np.full(count, -1.0), 0, tag=tag)
                error = ""
            except ValueError as raised:
                error = str(raised)
            case(name, np.array(said in error), np.array(True))
    pycoll.barrier()


def check_split_keeps_nodes() -> None:
    """A sub-communicator's ranks stay on their nodes (simulated ones too)."""
    world = pycoll.world()
    half = world.split(RANK % 2)
    members = [r for r in range(P) if r % 2 == RANK % 2]
    first_seen: dict[int, int] = {}
    want = [first_seen.setdefault(world.nodes()[r], len(first_seen)) for r in members]
    case("split keeps nodes", np.array(half.nodes()), np.array(want))
    made = half.mpi_comm
    half.free()
    case("free releases the split's own MPI communicator", np.array(made == MPI.COMM_NULL),
         np.array(True))
    try:
        half.split(0)
        case("a freed communicator does not split", np.array(False), np.array(True))
    except RuntimeError:
        case("a freed communicator does not split", np.array(True), np.array(True))


for index, count in enumerate([0, 1, P + 1, 13, 1000]):
    run(f"reducing n={count}", partial(check_reducing, index, count))
    run(f"moving n={count}", partial(check_moving, index, count))
for per_peer in (0, 1, 3):
    run(f"alltoall {per_peer}", partial(check_alltoall, per_peer))
run("point to point and groups", check_point_to_point_and_groups)
run("plan on one rank", check_plan_on_one_rank)
run("split keeps nodes", check_split_keeps_nodes)
run("a short message is an error", check_a_short_message_is_an_error)

totals = native.allreduce(np.array([passed, failed]), op=MPI.SUM)
if RANK == 0:
    print(f"mpi collectives on {P} ranks: {totals[0]} passed, {totals[1]} failed", flush=True)
sys.exit(1 if totals[1] else 0)
