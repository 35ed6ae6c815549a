"""The public collectives: array in, array out.

Each function validates its arguments (errors name the argument, the value and what is
allowed), picks a schedule, and runs this rank's part of it over the communicator. Arrays are
read as flat sequences of elements; the sharded collectives split along the first axis, so
``counts`` are in rows of ``x`` (elements, for a 1-D array).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from pycoll import agree, algorithms, select, verify
from pycoll.bindings.transport import (
    INTERRUPTS,
    ChannelsCrossed,
    CollectiveTimeout,
    WaitTimeout,
)
from pycoll.comm import AGREEMENT_TAG, Communicator, is_int, world
from pycoll.execute import compile_program, player, run, some_rank_forwards
from pycoll.kernels import ReduceOp, check_dtype, check_op_for_dtype
from pycoll.kernels.host import SUPPORTED_SET
from pycoll.schedule import SHARDED, Collective, Layout, split
from pycoll.settings import switch
from pycoll.spaces import HOST, space_of
from pycoll.work import Posted

OpLike = str | ReduceOp
Array = Any  # a numpy.ndarray, or a device array (cupy.ndarray) of a registered space
PREPARED_CALLS = 1024  # call shapes remembered per communicator
_KNOWN = object()  # first in the key of a host call remembered whole (see _known)
_ONE_SHOT = "one shot"  # how a remembered call ran: every rank's x through shared memory
# Enum members as module constants for the one-shot's hot path: in CPython 3.11,
# ``ReduceOp.AVG`` is a Python-level lookup on the Enum class (about 0.1 us each)
_ALLREDUCE, _AVG = Collective.ALLREDUCE, ReduceOp.AVG


@verify.verified("allreduce")
def allreduce(
    x: Array,
    op: OpLike = "sum",
    *,
    out: Array | None = None,
    comm: Communicator | None = None,
    algorithm: str = "auto",
    stream: Any = None,
    async_op: bool = False,
) -> Array:
    """Combine ``x`` over all ranks with ``op``; every rank gets the whole result."""
    if async_op is not False and _async(async_op, "allreduce"):
        _before_submit(comm, x, "allreduce", algorithm, stream)
        _op(op, x, "allreduce")
        if out is not None:
            _out(out, x, x.shape, "allreduce", may_alias=True)
        return _submit(allreduce, "allreduce", x, op, out=out, comm=comm, algorithm=algorithm,
                       stream=stream)
    comm = _comm(comm)
    known = None
    if stream is None and algorithm == "auto" and (type(x) is np.ndarray or _host_ndarray(x)):
        done = _one_shot_allreduce(x, op, out, comm)  # which remembers (dtype, op) itself
        if done is not None:
            return done
    if stream is None and type(x) is np.ndarray:
        known = (_KNOWN, "allreduce", x.dtype, x.shape, op, algorithm, select.FORCED_SEGMENTS)
        remembered = _known(comm, known)
        if remembered is not None and x.flags.c_contiguous:
            parsed, call = remembered
            out = _out(out, x, x.shape, "allreduce", may_alias=True)
            _execute(comm, call, x, out)
            if parsed is _AVG:
                HOST.finish(out.reshape(-1), parsed, comm.size)
            return out
    space = _space(x, "allreduce")
    parsed = _op(op, x, "allreduce")
    with space.using(stream, "allreduce"):
        out = _out(out, x, x.shape, "allreduce", may_alias=True)
        call = _run(comm, Collective.ALLREDUCE, x, out, parsed, algorithm)
        if parsed is _AVG:
            space.finish(out.reshape(-1), parsed, comm.size)
    _remember(comm, known, (parsed, call))
    return out


def _host_ndarray(x: object) -> bool:
    """Whether ``x`` is numpy memory the one-shot may read: a subclass too (np.memmap), since
    whether a call is one-shot must not depend on what differs between ranks (a rank left
    out would hang the others), but not a device space's ndarray subclass."""
    return type(x) is np.ndarray or (isinstance(x, np.ndarray) and space_of(x) is HOST)


def _one_shot_allreduce(x: np.ndarray, op: OpLike, out: np.ndarray | None,
                        comm: Communicator) -> np.ndarray | None:
    """The small AllReduce over shared memory (every rank on one node), with the checks of
    the general path done once per (dtype, op) and the common ``out`` cases checked inline;
    None when it does not apply, and the general path then runs (and reports any error)."""
    shared = comm.one_shot_for(_ALLREDUCE)
    if shared is None or x.nbytes > shared.small_bytes or not x.flags.c_contiguous:
        return None  # (strided: the general path names it)
    try:
        known = shared.ops.get((x.dtype, op))
    except TypeError:  # an unhashable op: the general path names it
        return None
    if known is None or type(x) is not np.ndarray:  # a subclass: matrix and masked refused
        _space(x, "allreduce")
    if known is None:
        parsed = _op(op, x, "allreduce")
        reducer = HOST.reducer(parsed, x.dtype)
        known = shared.ops[(x.dtype, op)] = (
            parsed, reducer, _call_number(_ALLREDUCE, parsed, None, None),
            getattr(reducer, "ufunc", None))
    parsed, reducer, call, ufunc = known
    if out is None:
        out = np.empty(x.shape, x.dtype)  # numpy's own, as the general path returns
    elif not (type(out) is np.ndarray and out.dtype == x.dtype and out.shape == x.shape
              and (flags := out.flags).c_contiguous and flags.writeable
              and (out is x or (out.base is None and x.base is None)  # own their memory
                   or not np.may_share_memory(out, x))):
        out = _out(out, x, x.shape, "allreduce", may_alias=True)  # raises, or in place
    flat = out if out.ndim == 1 else out.reshape(-1)
    if comm.check:
        _agree(comm, _ALLREDUCE, x, parsed, "auto", None, None)
    slots = _publish(comm, shared, _ALLREDUCE, x, call)
    if ufunc is not None and len(slots) == 2:  # _sum_in_rank_order's call, without two frames
        try:
            ufunc(slots[0], slots[1], out=flat)
        except (FloatingPointError, RuntimeWarning):
            pass  # written: inf, never an error, as the reducer gives (kernels/host.py)
    else:
        _sum_in_rank_order(flat, slots, reducer)
    if parsed is _AVG:
        HOST.finish(flat, parsed, comm.size)
    return out


_OP_CODES = {op: code for code, op in enumerate(ReduceOp, start=1)}
_COLLECTIVE_CODES = {c: code for code, c in enumerate(Collective, start=1)}  # under 16
SMALL_EXCHANGE_BYTES = 64 << 10  # per rank: ReduceScatter, AllGather, Broadcast and Reduce


def one_shot_serves(comm: Communicator, collective: Collective, nbytes: int) -> bool:
    """Whether an ``auto`` call of ``collective`` with ``nbytes`` of host input per rank goes
    through the shared-memory one-shot (every rank's input through the slots), not a
    schedule (so no plan is made and PYCOLL_DEBUG reports none)."""
    shared = comm.one_shot_for(collective)
    return shared is not None and nbytes <= _one_shot_limit(collective, shared.small_bytes)


def _one_shot_limit(collective: Collective, small_bytes: int) -> int:
    """The most bytes per rank a one-shot call of ``collective`` takes (``small_bytes``: the
    slot's)."""
    return small_bytes if collective is Collective.ALLREDUCE else min(small_bytes,
                                                                       SMALL_EXCHANGE_BYTES)


def _one_shot_would_serve(comm: Communicator, collective: Collective, nbytes: int) -> bool:
    """``one_shot_serves``, on one rank alone: before the first collective has made the host
    transport (every rank together), read off the layout what it will be."""
    if comm.host_transport_made():
        return one_shot_serves(comm, collective, nbytes)
    from pycoll.bindings import shm

    if (comm.host_kind() != "shm" or len(set(comm.nodes())) > 1
            or select.forced_algorithm(collective) is not None):
        return False
    return nbytes <= _one_shot_limit(collective, shm.small_bytes_from_env())


def _small_exchange(comm: Communicator, collective: Collective, x: Array, op: ReduceOp | None,
                    algorithm: str, stream: Any, blocks: tuple[int, ...] | None,
                    root: int | None = None) -> tuple | None:
    """For a small call on host arrays where every rank shares a node: every rank's ``x``
    (flat views of the shared slots, valid until this communicator's next small exchange),
    after the agreement check when it is on; None when the schedules serve the call."""
    if algorithm != "auto" or stream is not None or not _host_ndarray(x):
        return None
    shared = comm.one_shot_for(collective)
    if shared is None or x.nbytes > min(shared.small_bytes, SMALL_EXCHANGE_BYTES):
        return None
    if comm.check:
        _agree(comm, collective, x, op, "auto", blocks, root)
    return _publish(comm, shared, collective, x, _call_number(collective, op, blocks, root))


def _call_number(collective: Collective, op: ReduceOp | None, blocks: tuple[int, ...] | None,
                 root: int | None) -> int:
    """The collective, op, root and counts as one int64 that every rank computes alike
    (hashes of ints and tuples of ints are not salted per process), for the one-shot to
    compare."""
    call = (_COLLECTIVE_CODES[collective] | _OP_CODES.get(op, 0) << 4
            | (0 if root is None else root + 1) << 7)
    return call if blocks is None else hash((call, blocks)) >> 1  # fits an int64 word


def _publish(comm: Communicator, shared: Any, collective: Collective, x: np.ndarray,
             call: int) -> tuple:
    """Every rank's ``x`` through the shared slots (``call``: ``_call_number``'s)."""
    comm.traffic.to_every_peer(x.nbytes)
    name = collective._value_  # not .value: an Enum property costs as much as a small copy
    try:
        parts = shared.publish_small(x if x.ndim == 1 else x.reshape(-1), name, call)
    except WaitTimeout as late:
        raise comm.timed_out(f"{name} (one-shot)", late) from None
    except ChannelsCrossed as error:
        raise comm.broken_by(error) from None
    except INTERRUPTS as stop:
        comm.interrupted(name, stop)
        raise
    if select.DEBUG and not comm.agreeing:  # an AllGather's size is its output's, as plan's
        select.report_one_shot(name, sum(p.nbytes for p in parts)
                               if collective is Collective.ALLGATHER else x.nbytes,
                               comm.size, comm.rank)
    return parts


def _sum_in_rank_order(out: np.ndarray, parts: tuple, reduce: Any) -> None:
    """``out`` = parts[0] op parts[1] op ... (left to right: the same bits on every rank)."""
    if len(parts) == 1:
        out[...] = parts[0]
        return
    reduce(out, parts[1], parts[0])
    for part in parts[2:]:
        reduce(out, part)


@verify.verified("reduce_scatter")
def reduce_scatter(
    x: Array,
    op: OpLike = "sum",
    *,
    counts: list[int] | None = None,
    out: Array | None = None,
    comm: Communicator | None = None,
    algorithm: str = "auto",
    stream: Any = None,
    async_op: bool = False,
) -> Array:
    """Combine ``x`` over all ranks; rank r gets rows ``sum(counts[:r])`` up to the next.

    ``out`` may be those rows of ``x`` (in place, as NCCL's); x's other rows are kept."""
    if async_op is not False and _async(async_op, "reduce_scatter"):
        checked = _before_submit(comm, x, "reduce_scatter", algorithm, stream)
        _op(op, x, "reduce_scatter")
        listed = _counts(counts, _rows(x, "reduce_scatter"), checked.size, "reduce_scatter",
                         "len(x)")
        if out is not None:
            _out(out, x, (listed[checked.rank], *x.shape[1:]), "reduce_scatter",
                 block_at=_block_at(x, listed, checked.rank))
        return _submit(reduce_scatter, "reduce_scatter", x, op,
                       counts=None if counts is None else listed, out=out, comm=comm,
                       algorithm=algorithm, stream=stream)
    comm = _comm(comm)
    known = None
    if counts is None and stream is None and type(x) is np.ndarray:
        known = (_KNOWN, "reduce_scatter", x.dtype, x.shape, op, algorithm,
                 select.FORCED_SEGMENTS)
        remembered = _known(comm, known)
        if remembered is not None and x.flags.c_contiguous:
            parsed, shape, blocks, block_at, how = remembered
            out = _out(out, x, shape, "reduce_scatter", block_at=block_at)
            _reduce_scatter(comm, x, out, parsed, blocks, algorithm, None, HOST, how)
            return out
    space = _space(x, "reduce_scatter")
    op = _op(op, x, "reduce_scatter")
    rows = _rows(x, "reduce_scatter")
    counts = _counts(counts, rows, comm.size, "reduce_scatter", "len(x)")
    shape = (counts[comm.rank], *x.shape[1:])
    block_at = _block_at(x, counts, comm.rank)
    with space.using(stream, "reduce_scatter"):
        out = _out(out, x, shape, "reduce_scatter", block_at=block_at)
        blocks = tuple(c * _row_size(x) for c in counts)
        how = _reduce_scatter(comm, x, out, op, blocks, algorithm, stream, space)
    _remember(comm, known, (op, shape, blocks, block_at, how))
    return out


def _reduce_scatter(comm: Communicator, x: Array, out: Array, op: ReduceOp,
                    blocks: tuple[int, ...], algorithm: str, stream: Any, space: Any,
                    how: Any = None) -> Any:
    """ReduceScatter of checked arguments into ``out``; returns how it ran (``_ONE_SHOT``,
    or the prepared call), for a repeat of the call to run the same way (``how``)."""
    start = sum(blocks[: comm.rank])
    stop = start + blocks[comm.rank]
    if how is None or how is _ONE_SHOT:
        slots = _small_exchange(comm, Collective.REDUCE_SCATTER, x, op, algorithm, stream, blocks)
        if slots is not None:  # every rank's x, in shared memory: sum my block in rank order
            flat = out.reshape(-1)
            _sum_in_rank_order(flat, [s[start:stop] for s in slots], HOST.reducer(op, x.dtype))
            if op is _AVG:
                HOST.finish(flat, op, comm.size)
            return _ONE_SHOT
    work = comm.buffer("reduce_scatter", x.size, x.dtype, space)
    if isinstance(how, PreparedCall):
        _execute(comm, how, x, work)
    else:
        how = _run(comm, Collective.REDUCE_SCATTER, x, work, op, algorithm, blocks=blocks)
    result = work[start:stop]
    if op is _AVG:
        space.finish(result, op, comm.size)
    space.copy(out.reshape(-1), result)
    return how


@verify.verified("allgather")
def allgather(
    x: Array,
    *,
    counts: list[int] | None = None,
    out: Array | None = None,
    comm: Communicator | None = None,
    algorithm: str = "auto",
    stream: Any = None,
    async_op: bool = False,
) -> Array:
    """Every rank's ``x`` concatenated in rank order along the first axis, on every rank.

    Without ``counts`` every rank's ``x`` has the same shape; with them, rank r's has
    ``counts[r]`` rows. ``x`` may be this rank's rows of ``out`` (in place, as NCCL's).
    """
    if async_op is not False and _async(async_op, "allgather"):
        checked = _before_submit(comm, x, "allgather", algorithm, stream)
        rows = _rows(x, "allgather")
        listed = (None if counts is None
                  else _gathered_counts(counts, rows, checked.size, checked.rank))
        if out is not None:
            _out(out, x, (rows * checked.size if listed is None else sum(listed), *x.shape[1:]),
                 "allgather", block_at=_block_at(x, listed or [rows] * checked.size,
                                                 checked.rank))
        return _submit(allgather, "allgather", x, counts=listed, out=out, comm=comm,
                       algorithm=algorithm, stream=stream)
    comm = _comm(comm)
    known = None
    if counts is None and stream is None and type(x) is np.ndarray:
        known = (_KNOWN, "allgather", x.dtype, x.shape, algorithm, select.FORCED_SEGMENTS)
        remembered = _known(comm, known)
        if remembered is not None and x.flags.c_contiguous:
            shape, blocks, block_at, how = remembered
            out = _out(out, x, shape, "allgather", block_at=block_at)
            _allgather(comm, x, out, blocks, algorithm, None, how)
            return out
    space = _space(x, "allgather")
    rows = _rows(x, "allgather")
    if counts is None:
        counts = [rows] * comm.size
    else:
        counts = _gathered_counts(counts, rows, comm.size, comm.rank)
    shape = (sum(counts), *x.shape[1:])
    block_at = _block_at(x, counts, comm.rank)
    with space.using(stream, "allgather"):
        out = _out(out, x, shape, "allgather", block_at=block_at)
        row = _row_size(x)
        blocks = tuple(c * row for c in counts)
        how = _allgather(comm, x, out, blocks, algorithm, stream)
    _remember(comm, known, (shape, blocks, block_at, how))
    return out


def _gathered_counts(counts: Any, rows: int, nranks: int, rank: int) -> list[int]:
    """AllGather's ``counts``, checked: ``nranks`` row counts, this rank's its x's."""
    counts = _counts(counts, None, nranks, "allgather", "")
    if counts[rank] != rows:
        raise ValueError(
            f"allgather: counts[{rank}]={counts[rank]} but this rank's x has "
            f"{rows} rows; counts[r] must be the length of rank r's x"
        )
    return counts


def _allgather(comm: Communicator, x: Array, out: Array, blocks: tuple[int, ...],
               algorithm: str, stream: Any, how: Any = None) -> Any:
    """AllGather of checked arguments into ``out``; returns how it ran (as
    ``_reduce_scatter``)."""
    if (how is None and len(set(blocks)) == 1) or how is _ONE_SHOT:  # slots hold equal arrays
        slots = _small_exchange(comm, Collective.ALLGATHER, x, None, algorithm, stream, blocks)
        if slots is not None:
            np.concatenate(slots, out=out.reshape(-1))
            return _ONE_SHOT
    if isinstance(how, PreparedCall):
        _execute(comm, how, x, out)
        return how
    return _run(comm, Collective.ALLGATHER, x, out, None, algorithm, (x.size,), blocks,
                out.nbytes)


@verify.verified("broadcast")
def broadcast(
    x: Array,
    root: int = 0,
    *,
    comm: Communicator | None = None,
    algorithm: str = "auto",
    stream: Any = None,
    async_op: bool = False,
) -> Array:
    """Copy root's ``x`` into every rank's ``x`` (in place; the root's is only read, and may
    be read-only); returns ``x``."""
    if async_op is not False and _async(async_op, "broadcast"):
        checked = _before_submit(comm, x, "broadcast", algorithm, stream)
        if _root(root, checked, "broadcast") != checked.rank:  # the root's x is only read
            _writable(x, "x", "broadcast")
        return _submit(broadcast, "broadcast", x, root, comm=comm, algorithm=algorithm,
                       stream=stream)
    comm = _comm(comm)
    known = None
    if stream is None and type(x) is np.ndarray and type(root) is int:
        known = (_KNOWN, "broadcast", x.dtype, x.shape, root, algorithm, select.FORCED_SEGMENTS)
        remembered = _known(comm, known)
        if remembered is not None and x.flags.c_contiguous and x.flags.writeable:
            _broadcast(comm, x, root, algorithm, None, remembered)
            return x
    space = _space(x, "broadcast")
    root = _root(root, comm, "broadcast")
    if root != comm.rank:  # the root's x is only read (as MPI_Bcast's buffer)
        _writable(x, "x", "broadcast")
    with space.using(stream, "broadcast"):
        how = _broadcast(comm, x, root, algorithm, stream)
    _remember(comm, known, how)
    return x


def _broadcast(comm: Communicator, x: Array, root: int, algorithm: str, stream: Any,
               how: Any = None) -> Any:
    """Broadcast of checked arguments; returns how it ran (as ``_reduce_scatter``)."""
    if how is None or how is _ONE_SHOT:
        slots = _small_exchange(comm, Collective.BROADCAST, x, None, algorithm, stream, None,
                                root)
        if slots is not None:
            if comm.rank != root:
                x.reshape(-1)[...] = slots[root]
            return _ONE_SHOT
    if isinstance(how, PreparedCall):
        _execute(comm, how, x, x)
        return how
    return _run(comm, Collective.BROADCAST, x, x, None, algorithm, root=root)


@verify.verified("reduce")
def reduce(
    x: Array,
    op: OpLike = "sum",
    root: int = 0,
    *,
    out: Array | None = None,
    comm: Communicator | None = None,
    algorithm: str = "auto",
    stream: Any = None,
    async_op: bool = False,
) -> Array | None:
    """Combine ``x`` over all ranks at ``root``; returns the result there, None elsewhere."""
    if async_op is not False and _async(async_op, "reduce"):
        checked = _before_submit(comm, x, "reduce", algorithm, stream)
        _op(op, x, "reduce")
        if _root(root, checked, "reduce") == checked.rank and out is not None:
            _out(out, x, x.shape, "reduce", may_alias=True)
        return _submit(reduce, "reduce", x, op, root, out=out, comm=comm, algorithm=algorithm,
                       stream=stream)
    comm = _comm(comm)
    known = None
    if stream is None and type(x) is np.ndarray and type(root) is int:
        known = (_KNOWN, "reduce", x.dtype, x.shape, op, root, algorithm, select.FORCED_SEGMENTS)
        remembered = _known(comm, known)
        if remembered is not None and x.flags.c_contiguous:
            parsed, how = remembered
            return _reduce(comm, x, out, parsed, root, algorithm, None, HOST, how)[0]
    space = _space(x, "reduce")
    op = _op(op, x, "reduce")
    root = _root(root, comm, "reduce")
    with space.using(stream, "reduce"):
        result, how = _reduce(comm, x, out, op, root, algorithm, stream, space)
    _remember(comm, known, (op, how))
    return result


def _reduce(comm: Communicator, x: Array, out: Array | None, op: ReduceOp, root: int,
            algorithm: str, stream: Any, space: Any, how: Any = None) -> tuple[Any, Any]:
    """Reduce of checked arguments (``out`` is checked here): the result (None off the
    root), and how it ran (as ``_reduce_scatter``)."""
    if comm.rank == root:  # before any exchange, on every path (off the root unused)
        out = _out(out, x, x.shape, "reduce", may_alias=True)
    if how is None or how is _ONE_SHOT:
        slots = _small_exchange(comm, Collective.REDUCE, x, op, algorithm, stream, None, root)
        if slots is not None:
            if comm.rank != root:
                return None, _ONE_SHOT
            flat = out.reshape(-1)
            _sum_in_rank_order(flat, slots, HOST.reducer(op, x.dtype))
            if op is _AVG:
                HOST.finish(flat, op, comm.size)
            return out, _ONE_SHOT
    if comm.rank == root:
        work = out
    else:
        work = comm.buffer("reduce", x.size, x.dtype, space)  # partials pass non-roots
    if isinstance(how, PreparedCall):
        _execute(comm, how, x, work)
    else:
        how = _run(comm, Collective.REDUCE, x, work, op, algorithm, root=root)
    if comm.rank != root:
        return None, how
    if op is _AVG:
        space.finish(out.reshape(-1), op, comm.size)
    return out, how


@verify.verified("alltoall")
def alltoall(
    x: Array,
    *,
    out: Array | None = None,
    comm: Communicator | None = None,
    algorithm: str = "auto",
    stream: Any = None,
    async_op: bool = False,
) -> Array:
    """Rank r sends its j-th equal piece of ``x`` to rank j; pieces arrive in source order.
    ``algorithm``: "auto" or "direct", its one family (as every collective takes it)."""
    if async_op is not False and _async(async_op, "alltoall"):
        checked = _before_submit(comm, x, "alltoall", algorithm, stream)
        _counts(None, _rows(x, "alltoall"), checked.size, "alltoall", "len(x)")
        if out is not None:
            _out(out, x, x.shape, "alltoall", may_alias=True)
        return _submit(alltoall, "alltoall", x, out=out, comm=comm, algorithm=algorithm,
                       stream=stream)
    comm = _comm(comm)
    known = None
    if stream is None and type(x) is np.ndarray:
        known = (_KNOWN, "alltoall", x.dtype, x.shape, algorithm, select.FORCED_SEGMENTS)
        call = _known(comm, known)
        if call is not None and x.flags.c_contiguous:
            out = _out(out, x, x.shape, "alltoall", may_alias=True)
            _agree_on_pieces(comm, x)
            _execute(comm, call, x, out)
            return out
    space = _space(x, "alltoall")
    _algorithm(algorithm, Collective.ALLTOALL)  # and PYCOLL_ALGO, if it names alltoall wrongly
    rows = _rows(x, "alltoall")
    counts = _counts(None, rows, comm.size, "alltoall", "len(x)")
    _agree_on_pieces(comm, x)
    with space.using(stream, "alltoall"):
        out = _out(out, x, x.shape, "alltoall", may_alias=True)
        call = _alltoallv(x, counts, counts, out, comm)
    _remember(comm, known, call)
    return out


@verify.verified("alltoallv")
def alltoallv(
    x: Array,
    send_counts: list[int],
    recv_counts: list[int] | None = None,
    *,
    out: Array | None = None,
    comm: Communicator | None = None,
    algorithm: str = "auto",
    stream: Any = None,
    async_op: bool = False,
) -> Array:
    """Rank r sends ``send_counts[j]`` rows of ``x`` to rank j, in order of j.

    Returns what arrived, in source-rank order (into ``out`` where given: as many rows as
    arrive, shaped as x's; as torch's ``all_to_all_single``). The counts are exchanged first;
    given ``recv_counts``, and ``out``'s row count, are checked against what the peers send,
    on every rank. ``algorithm``: "auto" or "direct", its one family.
    """
    if async_op is not False and _async(async_op, "alltoallv"):
        send_counts, recv_counts = _alltoallv_counts(
            _before_submit(comm, x, "alltoallv", algorithm, stream), x, send_counts,
            recv_counts)
        if out is not None:
            _alltoallv_out(out, x, recv_counts)
        return _submit(alltoallv, "alltoallv", x, send_counts, recv_counts, out=out,
                       comm=comm, algorithm=algorithm, stream=stream)
    comm = _comm(comm)
    space = _space(x, "alltoallv")
    _algorithm(algorithm, Collective.ALLTOALL, "alltoallv")
    send_counts, recv_counts = _alltoallv_counts(comm, x, send_counts, recv_counts)
    if out is not None:  # before any exchange: what this rank alone can tell
        _alltoallv_out(out, x, recv_counts)
    if comm.check and not comm.agreeing:  # first: the exchange of counts is an AllToAll too
        _agree(comm, Collective.ALLTOALL, x, None, "counts exchanged", None, None,
               named="alltoallv")
    arrived = _exchange_counts(comm, send_counts, recv_counts,
                               None if out is None else out.shape[0])
    with space.using(stream, "alltoallv"):
        if out is None:
            out = space.empty((sum(arrived), *x.shape[1:]), x.dtype)
        _alltoallv(x, send_counts, arrived, out, comm)
    return out


def _alltoallv_out(out: Array, x: Array, recv_counts: list[int] | None) -> None:
    """AllToAllv's ``out`` checked against ``x`` (its rows against ``recv_counts`` where
    given; else the exchange of counts checks them)."""
    if recv_counts is None and getattr(out, "ndim", x.ndim) != x.ndim:
        raise ValueError(f"alltoallv: out.shape={out.shape}; allowed: the rows that arrive, "
                         f"each shaped {x.shape[1:]}")
    rows = sum(recv_counts) if recv_counts is not None else getattr(out, "shape", (0,))[0]
    _out(out, x, (rows, *x.shape[1:]), "alltoallv", may_alias=True)


def _alltoallv_counts(comm: Communicator, x: Array, send_counts: Any,
                      recv_counts: Any) -> tuple[list[int], list[int] | None]:
    """AllToAllv's counts, checked against ``x`` and the rank count."""
    rows = _rows(x, "alltoallv")
    if send_counts is None:  # _counts would split evenly: that is alltoall
        raise ValueError(f"alltoallv: send_counts=None is invalid; allowed: {comm.size} "
                         "non-negative ints, one per rank (or alltoall(x) for even rows)")
    send_counts = _counts(send_counts, rows, comm.size, "alltoallv", "len(x)", "send_counts")
    if recv_counts is not None:
        recv_counts = _counts(recv_counts, None, comm.size, "alltoallv", "", "recv_counts")
    return send_counts, recv_counts


def _agree_on_pieces(comm: Communicator, x: Array) -> None:
    """With the agreement check on, AllToAll's equal pieces: every rank's ``x`` alike in
    size (AllToAllv's counts are exchanged and checked by the call; the check proper leaves
    them out, so it cannot tell the two apart)."""
    if comm.check and not comm.agreeing:
        _agree(comm, Collective.ALLTOALL, x, None, "equal pieces", None, None, count=x.size)


def _exchange_counts(comm: Communicator, send_counts: list[int],
                     recv_counts: list[int] | None, out_rows: int | None = None) -> list[int]:
    """The rows each rank sends to this one, by an AllToAll of (count, checking) pairs: O(p)
    per rank. Where any rank gave ``recv_counts`` or an ``out`` of ``out_rows`` rows (every
    rank learns whether one did), the first disagreement is agreed by a MIN AllReduce, so
    every rank raises the same error and none waits in the data exchange for a rank that
    raised."""
    checking = recv_counts is not None or out_rows is not None
    pairs = np.array([[count, checking] for count in send_counts], np.int64).reshape(-1)
    table = alltoall(pairs, comm=comm).reshape(comm.size, 2)
    arrived = [int(c) for c in table[:, 0]]
    if not table[:, 1].any():
        return arrived
    p = comm.size
    mine = [src for src in range(p) if recv_counts is not None and recv_counts[src] != arrived[src]]
    out_differs = recv_counts is None and out_rows is not None and out_rows != sum(arrived)
    # a pair's disagreement: dst * p + src; an out of other rows: p * p + rank; none: more
    none = p * p + p
    code = comm.rank * p + mine[0] if mine else p * p + comm.rank if out_differs else none
    first = int(allreduce(np.array([code], np.int64), "min", comm=comm)[0])
    if first == none:
        return arrived
    if first >= p * p:
        who = first - p * p
        pair = np.array([sum(arrived), out_rows or 0] if comm.rank == who else [0, 0], np.int64)
        arriving, rows = broadcast(pair, who, comm=comm)
        raise agree.AgreedError(
            f"alltoallv: rank {who}'s out has {rows} rows but {arriving} arrive "
            f"(send_counts[{who}] of every rank, summed); they must be equal")
    dst, src = divmod(first, p)
    pair = np.array([arrived[src], recv_counts[src]] if comm.rank == dst else [0, 0], np.int64)
    sent, expected = broadcast(pair, dst, comm=comm)
    raise agree.AgreedError(
        f"alltoallv: rank {src} sends {sent} rows to rank {dst} (its send_counts[{dst}]) but "
        f"rank {dst} expects {expected} (its recv_counts[{src}]); the counts must agree "
        "between peers"
    )


def _alltoallv(x, send_counts, recv_counts, out, comm) -> PreparedCall:
    """Runs the exchange into ``out``; returns the prepared call."""
    row = _row_size(x)
    sent = tuple(c * row for c in send_counts)
    arrived = tuple(c * row for c in recv_counts)
    return _run(comm, Collective.ALLTOALL, x, out, None, "direct", sent, arrived)


def send(
    x: Array, dst: int, tag: int = 0, *, comm: Communicator | None = None, stream: Any = None,
    async_op: bool = False,
) -> None:
    """Send ``x`` to rank ``dst``; returns when ``x`` may be reused: ``dst`` has received it
    (in-process always; device arrays: the copy is enqueued on ``dst``'s stream), or MPI has
    buffered it (a short message, as MPI_Send may). Programs must not rely on either."""
    if async_op is not False and _async(async_op, "send"):
        return _posted(comm, "send", x, dst, tag, stream) or _submit(
            send, "send", x, dst, tag, comm=comm, stream=stream, lane=("send", int(dst)))
    comm, space, dst, tag = _point_to_point_arguments(comm, "send", x, dst, tag)
    if space.is_device:
        comm.drain(("send", dst))  # a pair's device Send/Recv run in call order
    with space.using(stream, "send"):
        _point_to_point(comm, x, x, comm.rank, dst, tag)


def recv(
    out: Array, src: int, tag: int = 0, *, comm: Communicator | None = None, stream: Any = None,
    async_op: bool = False,
) -> Array:
    """Receive into ``out`` what rank ``src`` sends with ``tag``; returns ``out``."""
    if async_op is not False and _async(async_op, "recv"):
        return _posted(comm, "recv", out, src, tag, stream) or _submit(
            recv, "recv", out, src, tag, comm=comm, stream=stream, lane=("recv", int(src)))
    comm, space, src, tag = _point_to_point_arguments(comm, "recv", out, src, tag)
    if space.is_device:
        comm.drain(("recv", src))
    with space.using(stream, "recv"):
        _point_to_point(comm, out, out, src, comm.rank, tag)
    return out


def _posted(comm: Communicator | None, direction: str, buf: Any, peer: Any, tag: Any,
            stream: Any) -> Any:
    """Async Send/Recv of a host array, posted now as MPI's Isend/Irecv are: the transport
    matches it by tag, no thread waits for it, and a deadline runs from ``wait()``. None
    where that does not apply (device arrays, which run on a worker per direction and peer,
    in call order). Bad arguments raise here, as they would blocking."""
    comm, space, peer, tag = _point_to_point_arguments(comm, direction, buf, peer, tag)
    with space.using(stream, direction):  # a stream the call would refuse
        pass
    if stream is not None or space is not HOST:
        return None
    sending = direction == "send"
    flat = buf if buf.ndim == 1 else buf.reshape(-1)
    return _post(comm, sending, flat, peer, tag, None if sending else buf)


def _point_to_point_arguments(comm: Communicator | None, direction: str, buf: Any, peer: Any,
                              tag: Any) -> tuple[Communicator, Any, int, int]:
    """Send's or Recv's arguments, checked: the communicator, ``buf``'s space, the peer and
    the tag. Send/Recv are ordered per peer, not with collectives: no drain here."""
    sending = direction == "send"
    comm = _comm(comm, drain=False)
    space = _space(buf, direction, "x" if sending else "out")
    if not sending:
        _writable(buf, "out", "recv")
    peer = _peer(peer, comm, direction, "dst" if sending else "src")
    return comm, space, peer, _tag(tag, direction)


def _post(comm: Communicator, sending: bool, flat: np.ndarray, peer: int, tag: int,
          result: Any) -> Posted:
    """Post one host message on ``comm``'s Send/Recv endpoint; its ``wait()`` returns
    ``result``."""
    transport = comm.p2p
    try:
        if sending:
            comm.traffic.add(peer, flat.nbytes)
            request = transport.isend(flat, peer, tag)
        else:
            request = transport.irecv(flat, peer, tag)
    except Exception as error:  # in-process, a mismatch found as it matches: for wait()
        return Posted(transport, None, (sending, peer, tag), result, error)
    comm.keep_until_done(request)
    return Posted(transport, request, (sending, peer, tag), result, comm=comm)


def plan(
    collective: str | Collective,
    nbytes: int,
    comm: Communicator | None = None,
    *,
    algorithm: str = "auto",
    dtype: Any = "float32",
    root: int = 0,
    device: bool = False,
) -> select.Plan:
    """What a call of ``collective`` on ``nbytes`` would run on ``comm``: the algorithm and
    segment count chosen, why, and every candidate's predicted time (seconds, fastest first).

    ``device=True`` plans for device (CuPy) arrays. Every rank may call it on its own: under
    MPI, before the communicator's first collective it reads this rank's own tuning file, where
    the calls use rank 0's costs (shared at the first collective), so where the ranks' files
    differ, ask after one collective for what will run.
    """
    comm = _comm(comm)
    valid = {c.value: c for c in Collective if c is not Collective.SENDRECV}
    kind = valid.get(collective.value if isinstance(collective, Collective) else collective)
    if kind is None:
        raise ValueError(f"plan: collective={collective!r} is unknown; allowed: {', '.join(valid)}")
    if not is_int(nbytes) or nbytes < 0:
        raise ValueError(f"plan: nbytes={nbytes!r} is invalid; allowed: an int >= 0")
    dtype = _named_dtype(dtype, "plan")
    _algorithm(algorithm, kind, "plan")
    if nbytes % dtype.itemsize:  # a call moves whole elements: 5 bytes of float32 was planned
        raise ValueError(f"plan: nbytes={nbytes!r} is no whole number of {dtype.name} elements; "
                         f"allowed: a multiple of {dtype.itemsize}")
    if kind is Collective.ALLTOALL and nbytes // dtype.itemsize % comm.size:
        raise ValueError(f"plan: nbytes={nbytes!r} is {nbytes // dtype.itemsize} {dtype.name} "
                         f"elements, which do not divide into {comm.size} equal pieces (one per "
                         f"rank) as alltoall's must; allowed: a multiple of "
                         f"{dtype.itemsize * comm.size}")
    if not isinstance(device, bool | np.bool_):  # "no" planned for CUDA
        raise ValueError(f"plan: device={device!r} is invalid; allowed: True or False")
    if kind is Collective.ALLTOALL and algorithm == "auto":
        algorithm = "direct"
    from pycoll import spaces

    space = spaces.CUDA if device else spaces.HOST
    chosen = select.plan_for(kind, int(nbytes), comm.size, algorithm,
                             select.topology_for(comm, space, alone=True), dtype.itemsize,
                             _root(root, comm, "plan"))
    # (AllGather's nbytes is its output's: the one-shot limit is on each rank's input)
    per_rank = int(nbytes) // comm.size if kind is Collective.ALLGATHER else int(nbytes)
    if algorithm == "auto" and not device and _one_shot_would_serve(comm, kind, per_rank):
        return dataclasses.replace(
            chosen, algorithm=select.ONE_SHOT, nsegments=1, predicted=math.nan,
            reason=select.ONE_SHOT_REASON + "; the candidates are the schedules'")
    return chosen


def barrier(comm: Communicator | None = None, *, async_op: bool = False) -> Any:
    """Return only once every rank of ``comm`` has entered the barrier."""
    if async_op is not False and _async(async_op, "barrier"):
        return _submit(barrier, "barrier", comm=comm)
    comm = _comm(comm)
    shared = comm.one_shot_for(Collective.ALLREDUCE)
    x = np.zeros(1, np.int8)
    try:
        allreduce(x, comm=comm, algorithm="auto" if shared is not None else "direct")
    except (ValueError, TimeoutError) as error:  # a peer in another call: named by its own
        raise type(error)(f"barrier (an allreduce of one int8): {error}") from None


def empty(shape: int | tuple[int, ...], dtype: Any = np.float64, *,
          comm: Communicator | None = None) -> np.ndarray:
    """A numpy array in memory that the other ranks of this node can read in place.

    Collective: every rank of ``comm`` calls it (shapes may differ). Collectives send from
    such an array without first copying it into the shared rings, and reductions read it
    where it lies. The memory lives as long as the communicator. Where no peer shares this
    rank's node (one rank, or ``PYCOLL_HOST_TRANSPORT=mpi``), it is a plain ``numpy.empty``.
    """
    comm = _comm(comm)
    dtype = _named_dtype(dtype, "empty")
    try:
        dims = (shape,) if isinstance(shape, int | np.integer) else tuple(shape)
    except TypeError:  # 2.5, None: not a sequence either
        dims = (None,)
    if not all(is_int(d) and d >= 0 for d in dims):
        raise ValueError(f"empty: shape={shape!r} is invalid; allowed: an int >= 0 or a "
                         "tuple of them")
    nbytes = math.prod(int(d) for d in dims) * dtype.itemsize
    if nbytes > np.iinfo(np.intp).max:  # numpy's "array is too big" named neither
        raise ValueError(f"empty: shape={shape!r} of {dtype} is {nbytes} bytes; allowed: at "
                         f"most {np.iinfo(np.intp).max}")
    return comm.shared_empty(tuple(int(d) for d in dims), dtype)


# --- helpers -------------------------------------------------------------------------------


def _named_dtype(dtype: Any, call: str) -> np.dtype:
    """``check_dtype``, its error naming ``call``."""
    try:
        return check_dtype(dtype)
    except TypeError as error:
        raise TypeError(f"{call}: {error}") from None


def _async(async_op: Any, what: str) -> bool:
    """Whether to run asynchronously: ``async_op`` must be True or False (numpy's too); "no",
    1.5, None and [] would have been read as what they look like to ``if``, and an array
    raised numpy's ambiguity error."""
    if async_op is not True and not isinstance(async_op, np.bool_):
        raise ValueError(f"{what}: async_op={async_op!r} is invalid; allowed: True or False")
    return bool(async_op)


def _before_submit(comm: Communicator | None, x: Array, what: str, algorithm: Any,
                   stream: Any) -> Communicator:
    """The checks every async collective makes at the call (each adds its own), so that bad
    input raises there as it would blocking (and as torch.distributed's does), not on the
    worker, where a rank's failed call would leave it a collective behind its peers. Returns
    the communicator, not drained."""
    comm = _comm(comm, drain=False)
    with _space(x, what).using(stream, what):  # a stream the call would refuse
        pass
    if what == "alltoallv":
        _algorithm(algorithm, Collective.ALLTOALL, what)
    else:
        _algorithm(algorithm, Collective(what))
    return comm


def _algorithm(algorithm: Any, collective: Collective, named: str | None = None) -> None:
    """Raise unless ``algorithm`` is 'auto' (and ``PYCOLL_ALGO`` reads) or names a family
    with a schedule for ``collective`` (``named``: the public call, where it is not
    ``collective``'s name)."""
    name = collective.value if named is None else named
    if not isinstance(algorithm, str):
        raise TypeError(f"{name}: algorithm={algorithm!r} is not a name; allowed: "
                        "'auto' or a family name")
    if algorithm == "auto":
        select.forced_algorithm(collective)
    else:
        try:
            algorithms.check_family(algorithm, collective)
        except ValueError as error:
            why = ("" if algorithm != select.ONE_SHOT else
                   " ('one_shot', as plans name it, is what 'auto' runs for small calls when "
                   "every rank shares a node, with no schedule to force)")
            raise ValueError(f"{name}: {error}{why}") from None


def _submit(fn: Any, what: str, *args: Any, comm: Communicator | None, **kwargs: Any) -> Any:
    """``fn`` run on ``comm``'s async worker (pycoll/work.py): returns a Work whose ``wait()``
    gives ``fn``'s result, or raises its error (its arguments were checked at the call:
    ``_before_submit``)."""
    comm = _comm(comm, drain=False)
    space = space_of(args[0]) if args else None
    if space is not None and space.is_device:
        # The caller's current stream and device, not the worker thread's: the call is
        # ordered after the work queued before it, as a blocking call is (torch.distributed's
        # rule too), on the caller's GPU (CUDA's current device is per thread).
        if kwargs.get("stream", False) is None:
            kwargs["stream"] = space.current_stream()
        if space.names_a_thread(kwargs.get("stream")):
            fn, finish = _handed_over(fn, space, kwargs)
            return comm.submit(_on_device(fn, space, space.current_device()), what, *args,
                               comm=comm, **kwargs).then(finish)
        fn = _on_device(fn, space, space.current_device())
    return comm.submit(fn, what, *args, comm=comm, **kwargs)


def _handed_over(fn: Any, space: Any, kwargs: dict) -> tuple[Any, Any]:
    """``fn`` for the worker when the caller's stream is CUDA's per-thread default, which the
    worker cannot name (the handle is its own stream there): ``fn`` runs on a stream of its
    own after an event recorded on the caller's, and ``wait()`` orders the waiting thread's
    current stream after it (as torch.distributed's ``Work.wait``)."""
    with space.using(kwargs["stream"]):
        ready = space.record_new_event()
    kwargs["stream"] = own = space.new_stream()

    def call(*args: Any, **kwargs: Any) -> Any:
        with space.using(own):
            space.wait(ready)
            result = fn(*args, **kwargs)
            return result, space.record_new_event()

    def finish(result_and_done: tuple[Any, Any]) -> Any:
        result, done = result_and_done
        space.wait(done)
        return result

    return call, finish


def _on_device(fn: Any, space: Any, device: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        with space.on_device(device):
            return fn(*args, **kwargs)

    return call


def _comm(comm: Communicator | None, drain: bool = True) -> Communicator:
    if comm is None:
        comm = world()
    elif not isinstance(comm, Communicator):
        raise TypeError(f"comm={comm!r} is not a pycoll.Communicator; allowed: one, or None")
    if comm.freed or comm.broken is not None:  # (two tests inline: every call makes them)
        comm.ensure_usable()  # raises, naming which
    if drain and comm.queue is not None:  # (drain's own test: no call on every collective)
        comm.drain()  # a blocking call runs after the async ones queued before it
    return comm


def _space(x: object, collective: str, name: str = "x") -> Any:
    """The memory space of ``x`` (numpy or a device), after checking ``x`` is usable."""
    if type(x) is np.ndarray and x.dtype in SUPPORTED_SET and x.flags.c_contiguous:
        return HOST  # every call's case, in one test (Send/Recv's time is mostly checks)
    space = space_of(x)
    if space is None:
        raise TypeError(
            f"{collective}: {name} is a {type(x).__name__}; allowed: a numpy.ndarray or a "
            "cupy.ndarray"
        )
    if isinstance(x, np.matrix | np.ma.MaskedArray):  # a shape of its own; a mask dropped
        raise TypeError(f"{collective}: {name} is a {type(x).__module__}.{type(x).__name__}; "
                        f"allowed: a numpy.ndarray (pass numpy.asarray({name}))")
    try:
        check_dtype(x.dtype)
    except TypeError as error:  # say which call and which array
        raise TypeError(f"{collective}: {name}.{error}") from None
    if not x.flags.c_contiguous:
        module = "numpy" if space.name == "host" else "cupy"
        if name == "out":  # a contiguous copy of out would get the result, and out not
            raise ValueError(
                f"{collective}: out is not C-contiguous (strides {x.strides}); pass a "
                f"C-contiguous array ({module}.empty({name}.shape, {name}.dtype)) and copy "
                "it into yours after"
            )
        raise ValueError(
            f"{collective}: {name} is not C-contiguous (strides {x.strides}); "
            f"pass {module}.ascontiguousarray({name})"
        )
    return space


def _writable(x: Array, name: str, collective: str) -> None:
    if not getattr(x.flags, "writeable", True):  # device arrays have no read-only flag
        raise ValueError(f"{collective}: {name} is read-only; the result is written into it")


_OPS_BY_NAME = {op.value: op for op in ReduceOp}


def _op(op: OpLike, x: Array, collective: str) -> ReduceOp:
    """The parsed ``op``, for an ``x`` already checked by ``_space``."""
    parsed = op if isinstance(op, ReduceOp) else _OPS_BY_NAME.get(op) if type(op) is str else None
    try:
        if parsed is None:
            parsed = ReduceOp.parse(op)  # other spellings, or the error naming the allowed ones
        if x.dtype.kind == "c":
            check_op_for_dtype(parsed, x.dtype)
    except ValueError as error:  # named by the call, as every other argument's error is
        raise ValueError(f"{collective}: {error}") from None
    return parsed


def _rows(x: Array, collective: str) -> int:
    if x.ndim == 0:
        raise ValueError(f"{collective}: x is 0-dimensional; allowed: an array of rows (ndim >= 1)")
    return x.shape[0]


def _row_size(x: np.ndarray) -> int:
    return math.prod(x.shape[1:])


def _block_at(x: Array, counts: list[int], rank: int) -> int:
    """The byte offset of ``rank``'s rows in an array of ``counts`` rows shaped as ``x``'s."""
    return sum(counts[:rank]) * _row_size(x) * x.itemsize


def _counts(counts, rows, nranks, collective, what, name="counts") -> list[int]:
    """Validate per-rank row counts, or split ``rows`` evenly when ``counts`` is None."""
    if counts is None:
        if rows % nranks:
            remedy = ("use alltoallv(x, send_counts)" if collective == "alltoall"
                      else f"pass {name}=[...]")
            raise ValueError(
                f"{collective}: {what}={rows} does not divide by the {nranks} ranks; "
                f"{remedy} ({nranks} row counts summing to {rows})"
            )
        return split(rows, nranks)
    try:
        if isinstance(counts, dict | set | frozenset | str | bytes):  # keys, or no order
            raise TypeError
        listed = list(counts)  # an iterator is read once (counts itself names the error)
        values = [int(c) for c in listed]
        integral = all(is_int(c) for c in listed)  # not bools, not floats that happen to be
    except (TypeError, ValueError):
        values, integral = [], False
    if not integral or len(values) != nranks or any(c < 0 for c in values):
        raise ValueError(
            f"{collective}: {name}={counts!r} is invalid; allowed: {nranks} non-negative ints, "
            "one per rank"
        )
    if rows is not None and sum(values) != rows:
        raise ValueError(
            f"{collective}: {name}={values} sums to {sum(values)} but {what}={rows}; "
            f"they must be equal"
        )
    return values


def _out(out, x, shape, collective, may_alias=False, block_at=None) -> Array:
    """``out`` checked against ``x`` (None: a new array). ``may_alias``: out may be x
    itself; ``block_at``: the byte offset of this rank's block, where the smaller of the two
    may lie in the larger (NCCL's in place: AllGather's x as out's block, ReduceScatter's out
    as x's)."""
    if out is None:
        try:
            return space_of(x).empty(shape, x.dtype)  # x was checked; this is its space
        except MemoryError:  # numpy's says only the size: from counts another rank refuses?
            size = math.prod(shape) * x.dtype.itemsize
            raise MemoryError(
                f"{collective}: the result, shape {tuple(shape)} of {x.dtype.name} "
                f"({size / 2**30:.3g} GiB), cannot be allocated here; allowed: a result that "
                "fits (are the counts, which every rank passes alike, what was meant?)"
            ) from None
    if (type(out) is np.ndarray and type(x) is np.ndarray and out.dtype == x.dtype
            and out.shape == shape and (flags := out.flags).c_contiguous and flags.writeable
            and ((may_alias and out is x)
                 or (out is not x and ((out.base is None and x.base is None)  # own memory
                                       or not np.may_share_memory(out, x))))):
        return out  # the common case, in few steps: a separate numpy array that fits, or x
    space = space_of(x)
    if _space(out, collective, "out") is not space:
        raise TypeError(
            f"{collective}: out is a {type(out).__name__} but x is a {type(x).__name__}; "
            "they must live in the same memory (both numpy or both on the device)"
        )
    _writable(out, "out", collective)
    if out.dtype != x.dtype:
        raise TypeError(
            f"{collective}: out.dtype={out.dtype} but x.dtype={x.dtype}; they must match"
        )
    if out.shape != tuple(shape):
        raise ValueError(f"{collective}: out.shape={out.shape}; allowed: {tuple(shape)}")
    overlaps = space.may_share_memory(out, x) and space.shares_memory(out, x)
    if overlaps and not (may_alias and _same_memory(space, out, x)) and not (
            block_at is not None and _is_block(space, out, x, block_at)):
        raise ValueError(_overlap_message(collective, x, out, may_alias, block_at))
    return out


def _is_block(space: Any, out: Array, x: Array, block_at: int) -> bool:
    """Whether the smaller of ``out`` and ``x`` is the larger's bytes from ``block_at``."""
    small, large = (x, out) if x.nbytes <= out.nbytes else (out, x)
    return space.address(small) == space.address(large) + block_at


def _overlap_message(collective: str, x: Array, out: Array, may_alias: bool,
                     block_at: int | None) -> str:
    if may_alias:
        return f"{collective}: out overlaps x; pass out=x exactly (in place)"
    if block_at is None:
        return f"{collective}: out overlaps x; allowed: separate arrays"
    rows, (larger, smaller) = ((x.shape[0], ("out", "x")) if collective == "allgather"
                               else (out.shape[0], ("x", "out")))
    start = block_at // (x.itemsize * max(_row_size(x), 1))
    return (f"{collective}: out overlaps x; allowed: separate arrays, or {smaller} as this "
            f"rank's rows of {larger} ({smaller} = {larger}[{start}:{start + rows}], in place)")


def _same_memory(space: Any, a: Array, b: Array) -> bool:
    return space.address(a) == space.address(b) and a.nbytes == b.nbytes


def _root(root: int, comm: Communicator, collective: str) -> int:
    return _peer(root, comm, collective, "root", allow_self=True)


def _peer(peer: int, comm: Communicator, collective: str, name: str, allow_self=False) -> int:
    if type(peer) is int and 0 <= peer < comm.size and (allow_self or peer != comm.rank):
        return peer
    if not is_int(peer) or not 0 <= peer < comm.size or (not allow_self and peer == comm.rank):
        others = "" if allow_self else f", other than this rank {comm.rank}"
        raise ValueError(
            f"{collective}: {name}={peer!r} is not a rank; allowed: 0..{comm.size - 1}{others}"
        )
    return int(peer)


def _tag(tag: int, collective: str) -> int:
    if type(tag) is int and 0 <= tag < 32767:
        return tag
    if not is_int(tag) or not 0 <= tag < 32767:
        raise ValueError(f"{collective}: tag={tag!r} is invalid; allowed: an int in 0..32766")
    return int(tag)


def _known(comm: Communicator, key: tuple) -> Any:
    """What an earlier host call with these very arguments (``key``: the public function's
    name, x's dtype and shape, the other arguments as given) found valid and prepared, so
    that repeating it skips the checks that passed then; None if none did."""
    try:
        return comm.prepared.get(key)
    except TypeError:  # an unhashable argument: the checks name it
        return None


def _remember(comm: Communicator, key: tuple | None, what: Any) -> None:
    """Keep ``what`` for calls with ``key`` (None: a call not to remember)."""
    if key is None:
        return
    if len(comm.prepared) >= PREPARED_CALLS:
        comm.prepared.clear()
    comm.prepared[key] = what


def _run(
    comm: Communicator,
    collective: Collective,
    x: Array,
    work: Array,
    op: ReduceOp | None,
    algorithm: str,
    input_blocks: tuple[int, ...] | None = None,
    blocks: tuple[int, ...] | None = None,
    nbytes: int | None = None,
    *,
    root: int | None = None,
    peer: int | None = None,
    tag: int | None = None,
) -> PreparedCall:
    """Run this rank's part of the schedule chosen for this call; returns what was prepared
    for calls of its shape.

    ``blocks`` are WORK's element counts per block and ``input_blocks`` INPUT's (None: even
    shares of ``x`` / the same as WORK). What a call of this shape needs (the choice, the
    schedule, its compiled program, the reducer) is prepared once per communicator, so the
    repeated small call does one dictionary lookup before moving data.
    """
    checking = comm.check and not comm.agreeing and collective is not Collective.SENDRECV
    if checking:  # before preparing, which may raise on some ranks only
        _agree(comm, collective, x, op, algorithm, blocks, root)
    space = space_of(x)
    # PYCOLL_ALGO is read when a call shape is first prepared (see select.py)
    key = (collective, algorithm, x.dtype, x.size, op, root, peer, input_blocks, blocks,
           nbytes, space, select.FORCED_SEGMENTS)
    try:
        prepared = comm.prepared.get(key)
    except TypeError:  # an unhashable algorithm, which _prepare names
        prepared = None
    if prepared is None:
        prepared = _prepare(comm, key)
    _execute(comm, prepared, x, work, tag, agreed=checking)
    return prepared


def _execute(comm: Communicator, call: PreparedCall, x: Array, work: Array,
             tag: int | None = None, agreed: bool = False) -> None:
    """Run a prepared call on this call's arrays (``x`` and ``work`` of the prepared shape)."""
    if (comm.check and not agreed and not comm.agreeing
            and call.collective is not Collective.SENDRECV):  # Send/Recv: no agreement
        _agree(comm, call.collective, x, call.op, call.algorithm, call.blocks, call.root)
    if select.DEBUG and not comm.agreeing:  # the agreement's own exchange is not news
        select.report(call.plan, comm.rank)
    source = x if x.ndim == 1 else x.reshape(-1)
    target = work if work.ndim == 1 else work.reshape(-1)
    if call.reads_input_late and call.space.shares_memory(source, target):
        # in place, yet the schedule reads INPUT after WORK changed
        space = call.space
        source, original = comm.buffer("input", source.size, source.dtype, space), source
        space.copy(source, original)
    if tag is None:  # the agreement's exchange: on a tag no collective takes
        tag = AGREEMENT_TAG if comm.agreeing else comm.next_tag()
    kept = call.kept
    try:
        if kept is None or kept[2] != (source.size, target.size):  # (not kept: device calls)
            kept = _player(comm, call, source, target)  # may connect a device route: waits
        play, scratch, _ = kept
        play(source, target, scratch, tag)
    except (CollectiveTimeout, ChannelsCrossed) as error:
        said = str(error)
        if call.collective is Collective.SENDRECV and said.startswith(call.what):
            # prepared once for every tag: this call's, as an async Send/Recv names it
            error = type(error)(f"{call.what} (tag {tag}){said[len(call.what):]}")
        raise comm.broken_by(error) from None
    except INTERRUPTS as stop:
        comm.interrupted(call.what, stop)
        raise


# A kept host call's own scratch, at most (larger ones borrow comm.buffer's per call): the
# small calls whose time is mostly pycoll's, and no more than PREPARED_CALLS of these (8 MiB)
KEPT_SCRATCH_BYTES = 8 << 10


def _player(comm: Communicator, call: PreparedCall, source: Array,
            target: Array) -> tuple[Any, Any, tuple[int, int]]:
    """How ``call`` runs on arrays of these sizes: (play(source, work, scratch, tag), its own
    scratch or None, the sizes). A host call keeps it for every later call (the transport,
    and over one that does not deliver, execute.player's slices, made once), and a small
    call its own scratch too."""
    space, sizes = call.space, (source.size, target.size)
    p2p = call.collective is Collective.SENDRECV  # Send/Recv: its own endpoint
    if space.is_device:  # Send/Recv's: to the one other rank of the pair
        try:
            transport = comm.device_transport(space, (call.root, call.peer) if p2p else None)
        except WaitTimeout as late:
            raise comm.timed_out(f"{call.what} (connecting)", late) from None
    else:
        transport = comm.p2p if p2p else comm.host_transport()
    program = call.program
    if space.is_device or getattr(transport, "delivers", False):
        def play_delivered(source: Array, work: Array, _: None, tag: int) -> None:
            run(program, source, work, transport, tag, call.reduce, space, None, call.what,
                comm.traffic.add, call.reduce_n, call.reduce_copy, call.copy_pair)

        kept = (play_delivered, None, sizes)
        if not space.is_device:  # (a device call asks for its endpoint each time)
            call.kept = kept
        return kept
    play = player(program, (*sizes, target.itemsize), transport, call.reduce, space, call.what,
                  comm.traffic.add)
    elements, dtype = program.scratch_elements, target.dtype
    if elements * dtype.itemsize <= KEPT_SCRATCH_BYTES:
        call.kept = (play, space.empty(elements, dtype) if elements else None, sizes)
    else:
        def play_in_shared(source: Array, work: Array, _: None, tag: int) -> None:
            play(source, work, comm.buffer("scratch", elements, dtype, space), tag)

        call.kept = (play_in_shared, None, sizes)
    return call.kept


def _agree(comm: Communicator, collective: Collective, x: Array, op: ReduceOp | None,
           algorithm: str, blocks: tuple[int, ...] | None, root: int | None,
           count: int | None = None, named: str | None = None) -> None:
    """The agreement check (pycoll/agree.py): what every rank must pass alike (``count``:
    AllToAll's, which its blocks do not tell; ``named``: the public call, where it is not
    ``collective``'s name)."""
    comm.agreements += 1
    if collective is Collective.ALLTOALL:  # per-peer counts: exchanged and checked already
        counts = None
    elif collective is Collective.ALLGATHER:  # ranks' inputs may differ; the output not
        count, counts = sum(blocks), blocks
    else:
        count, counts = x.size, blocks
    name = collective.value if named is None else named
    what = f"{name} (agreement check)"
    try:
        agree.agree(comm, agree.signature(
            name, str(algorithm), None if op is None else op.value, x.dtype, count,
            counts, root, comm.agreements, space_of(x).name, comm.verify,
            tuple(x.shape[1:]) if collective in SHARDED else None,
        ))
    except WaitTimeout as late:  # the shared-memory exchange
        raise comm.timed_out(what, late) from None
    except CollectiveTimeout as late:  # the exchange as a collective of its own
        raise comm.broken_by(CollectiveTimeout(f"{what}: {late}")) from None
    except ChannelsCrossed as error:  # the shared-memory exchange, with a peer in the rings
        raise comm.broken_by(error) from None
    except INTERRUPTS as stop:
        comm.interrupted(what, stop)
        raise


def _prepare(comm: Communicator, key: tuple) -> PreparedCall:
    collective, algorithm, dtype, size, op, root, peer, input_blocks, blocks, nbytes, space = key[
        :11
    ]
    _algorithm(algorithm, collective)
    nbytes = size * dtype.itemsize if nbytes is None else nbytes
    if collective is Collective.SENDRECV:  # one schedule; nothing to choose
        plan = select.Plan(collective, nbytes, comm.size, "direct", 1, 0.0, "point to point")
    else:
        topology = select.topology_for(comm, space)
        plan = select.plan_for(collective, nbytes, comm.size, algorithm, topology,
                               dtype.itemsize, root)
    schedule = algorithms.build(plan.algorithm, collective, comm.size, plan.nsegments, root, peer,
                                comm.ranks_per_node)
    work_blocks = tuple(split(size, schedule.nblocks)) if blocks is None else blocks
    input_blocks = work_blocks if input_blocks is None else input_blocks
    work_layout = Layout(list(work_blocks), schedule.nsegments)
    program = compile_program(
        schedule, comm.rank, Layout(list(input_blocks), schedule.nsegments), work_layout
    )
    reduce = space.reducer(op, dtype) if op is not None else _no_reduction
    # one pass over every rank's piece (device kernels), where the program has such steps
    reduce_n = (space.reducer_n(op, dtype)
                if op is not None and program.has_reduce_groups and hasattr(space, "reducer_n")
                else None)
    # copy or reduce, and send, in one pass (device kernels, peer memory within one node):
    # given on every rank where some rank forwards, whether or not this one does, as all
    # must post ahead alike
    copy_pair = (space.copy_pair if hasattr(space, "copy_pair") and len(set(comm.nodes())) == 1
                 and some_rank_forwards(schedule, work_layout) else None)
    reduce_copy = (space.reducer_copy(op, dtype)
                   if op is not None and copy_pair is not None and hasattr(space, "reducer_copy")
                   else None)
    if copy_pair is not None and not _forwarding():  # still posted ahead: safe if ranks differ
        program = dataclasses.replace(program, forwards=tuple(() for _ in program.steps))
    if len(comm.prepared) >= PREPARED_CALLS:  # a long size sweep: start over rather than grow
        comm.prepared.clear()
    if collective is Collective.SENDRECV:  # root sends to peer
        what = f"send to rank {peer}" if root == comm.rank else f"recv from rank {root}"
    else:
        what = f"{collective.value} ({schedule.algorithm})"
    comm.prepared[key] = prepared = PreparedCall(
        collective, algorithm, op, root, peer, blocks, space, plan, program, reduce, reduce_n,
        reduce_copy, copy_pair, comm.rank in schedule.input_read_late, what)
    return prepared


@dataclasses.dataclass(slots=True)
class PreparedCall:
    """What calls of one shape need, made once per communicator (``_prepare``); a host call
    keeps how it runs after its first (``_player``)."""

    collective: Collective
    algorithm: str
    op: ReduceOp | None
    root: int | None
    peer: int | None
    blocks: tuple[int, ...] | None
    space: Any
    plan: select.Plan
    program: Any  # execute.Program
    reduce: Any
    reduce_n: Any
    reduce_copy: Any
    copy_pair: Any
    reads_input_late: bool  # the schedule reads INPUT after WORK changed
    what: str  # the collective and family, for a timeout's message
    kept: tuple[Any, Any, tuple[int, int]] | None = dataclasses.field(default=None, repr=False,
                                                                      compare=False)


def _forwarding() -> bool:
    """``PYCOLL_FORWARD=0`` makes the ring reduce (or copy), then send (two passes), instead
    of writing the next rank's buffer as it does: to measure what the fused pass gains."""
    return bool(switch("PYCOLL_FORWARD", True))


def _point_to_point(comm, x, work, src, dst, tag) -> None:
    if x.size == 0:  # a schedule has no step for it, yet an empty message is one (as in MPI)
        _empty_message(comm, src, dst, tag)
        return
    _run(comm, Collective.SENDRECV, x, work, None, "direct", root=src, peer=dst, tag=tag)


def _empty_message(comm: Communicator, src: int, dst: int, tag: int) -> None:
    """Send/Recv of nothing, over the host endpoint whatever the array's memory: it orders
    with host messages of the same tag, and carries no data for a device stream to order."""
    sending = src == comm.rank
    try:
        _post(comm, sending, np.empty(0, np.uint8), dst if sending else src, tag, None).wait()
    except INTERRUPTS as stop:  # its receive stays posted, for a later message of the tag
        comm.interrupted("send" if sending else "recv", stop)
        raise


def _no_reduction(target: Array, incoming: Array) -> None:
    raise RuntimeError("this collective does not reduce, yet its schedule asked for a reduction")
