"""Verify each collective's result against the numpy oracle as the program runs.

With ``PYCOLL_VERIFY=1`` (or ``comm.verify = True`` on every rank), every collective of that
communicator is checked after it returns: each rank copies its input to the host before the
call and its result after, the inputs travel to every rank by a direct AllGather over host
memory (so a device collective is checked over a path it does not use), every rank compares
its own result with what :mod:`pycoll.oracle` computes from all the inputs, and the ranks
exchange verdicts, so a wrong result anywhere raises the same :class:`VerificationError` on
every rank (none is left waiting), naming the ranks, how many elements differ and the first.

Integers, min and max, and every collective that only moves data must match exactly (copies
bit for bit). Sums, averages and products of floats may differ from the oracle, which
combines in rank order, by the rounding another order allows: at most 2γₙ·Σ|xᵣ| for a sum
(γₙ = n·u/(1 − n·u), u the unit roundoff of the dtype, n the rank count), that over n plus
two roundings of the quotient for an average, and 2γ₃ₙ·Π|xᵣ| for a product, per element;
where a partial sum or product could overflow or underflow in some order, anything passes.

Debugging only: every rank receives every rank's input (n times the input's memory) and the
check costs far more than the collective. Send and Recv are not verified: a receiver cannot
know what was sent without a message of its own.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from pycoll import oracle
from pycoll.kernels import ReduceOp

# Set once any communicator verifies: until then a collective pays one global read for this.
active = False
_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_REDUCING = ("allreduce", "reduce_scatter", "reduce")
_OK, _WRONG, _FAILED = 0, 1, 2  # a rank's verdict


class VerificationError(RuntimeError):
    """A collective's result differs from the numpy oracle (raised on every rank)."""


def enabled_by_default() -> bool:
    """``PYCOLL_VERIFY`` (0 or 1), read when a communicator is made."""
    global active
    text = os.environ.get("PYCOLL_VERIFY", "0").strip() or "0"
    if text not in ("0", "1"):
        raise ValueError(f"PYCOLL_VERIFY={text!r} is invalid; allowed: 0 or 1")
    active = active or text == "1"
    return text == "1"


def turn_on() -> None:
    """Some communicator verifies from now on (``comm.verify = True``)."""
    global active
    active = True


def verified(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The public collective ``name``, checked against the oracle where its communicator
    verifies; otherwise called as it is."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def collective(*args: Any, **kwargs: Any) -> Any:
            if not active:
                return fn(*args, **kwargs)
            call = signature.bind(*args, **kwargs)
            call.apply_defaults()
            arguments = call.arguments
            comm = _communicator(arguments["comm"])
            if arguments["async_op"] or comm is None:
                return fn(*args, **kwargs)  # async: the worker calls this again, blocking
            comm.drain()  # async calls queued before may be verifying on the worker
            if not comm.verify or comm.verifying or comm.agreeing:
                return fn(*args, **kwargs)
            return _verify(fn, name, comm, arguments, args, kwargs)

        return collective

    return wrap


def _communicator(comm: Any) -> Any:
    from pycoll.comm import Communicator, world

    if comm is None:
        return world()
    return comm if isinstance(comm, Communicator) else None  # the call says what is wrong


def _verify(fn: Callable[..., Any], name: str, comm: Any, arguments: dict, args: tuple,
            kwargs: dict) -> Any:
    from pycoll.spaces import space_of

    x, stream = arguments["x"], arguments.get("stream")
    space = space_of(x)
    if space is None:
        return fn(*args, **kwargs)  # not an array: the call names it
    before = _to_host(space, x, stream)  # before the call: it may write x (in place)
    comm.verifying = True  # what the call and the check run inside is not verified itself
    try:
        result = fn(*args, **kwargs)
        _check(name, comm, arguments, before, result, space, stream)
    finally:
        comm.verifying = False
    return result


def _to_host(space: Any, x: Any, stream: Any) -> np.ndarray:
    if not space.is_device:
        return np.array(x, copy=True).reshape(-1)
    host = np.empty(x.size, x.dtype)
    with space.using(stream):
        space.to_host(host, x.reshape(-1))
        space.synchronize()
    return host


def _check(name: str, comm: Any, arguments: dict, mine: np.ndarray, result: Any, space: Any,
           stream: Any) -> None:
    from pycoll.api import allgather

    inputs = _gather(comm, mine)
    send_counts = None
    if name == "alltoallv":  # every rank's, in elements
        row = mine.size // max(len(arguments["x"]), 1)
        counts = np.array(arguments["send_counts"], np.int64) * row
        table = allgather(counts, comm=comm, algorithm="direct")
        send_counts = table.reshape(comm.size, comm.size).tolist()
    verdict, local = _FAILED, ""
    try:
        verdict, local, wrong, first = _compare(name, comm, arguments, inputs, send_counts,
                                                result, space, stream)
    except Exception as error:  # said on every rank: no rank may skip the verdicts' exchange
        local, wrong, first = f"{type(error).__name__}: {error}", 0, -1
    size = 0 if result is None else int(result.size)
    verdicts = allgather(np.array([verdict, wrong, first, size], np.int64), comm=comm,
                         algorithm="direct").reshape(comm.size, 4)
    if (verdicts[:, 0] == _OK).all():
        return
    raise VerificationError(_describe(name, comm, arguments, mine.dtype, verdicts, local))


def _gather(comm: Any, mine: np.ndarray) -> list[np.ndarray]:
    """Every rank's input (flat, on the host), by direct AllGathers."""
    from pycoll.api import allgather

    sizes = allgather(np.array([mine.size], np.int64), comm=comm, algorithm="direct")
    counts = [int(s) for s in sizes]
    everything = allgather(mine, counts=counts, comm=comm, algorithm="direct")
    starts = np.cumsum([0, *counts])
    return [everything[starts[r] : starts[r + 1]] for r in range(comm.size)]


def _compare(name: str, comm: Any, arguments: dict, inputs: list[np.ndarray],
             send_counts: list | None, result: Any, space: Any, stream: Any
             ) -> tuple[int, str, int, int]:
    """(verdict, what this rank saw, elements wrong, first wrong flat index)."""
    rank, n = comm.rank, comm.size
    op = arguments.get("op")
    op = None if op is None else ReduceOp.parse(op).value  # the call accepted it
    parts: list[np.ndarray] | None = None  # each rank's contribution to each element
    if name == "allreduce":
        expected, parts = oracle.allreduce(inputs, op), inputs
    elif name == "reduce":
        if rank != arguments["root"]:
            if result is not None:
                return _WRONG, f"rank {rank} is not the root but got {type(result).__name__}", 0, -1
            return _OK, "", 0, -1
        expected, parts = oracle.reduce(inputs, op, arguments["root"]), inputs
    elif name == "reduce_scatter":
        x = arguments["x"]
        row = inputs[rank].size // max(len(x), 1)
        counts = arguments["counts"] or [len(x) // n] * n
        starts = np.cumsum([0, *(int(c) * row for c in counts)])
        lo, hi = starts[rank], starts[rank + 1]
        parts = [inp[lo:hi] for inp in inputs]
        expected = oracle.allreduce(parts, op)
    elif name == "allgather":
        expected = oracle.allgather(inputs)
    elif name == "broadcast":
        expected = oracle.broadcast(inputs, arguments["root"])
    elif name == "alltoall":
        expected = oracle.alltoall(inputs)[rank]
    elif name == "alltoallv":
        expected = oracle.alltoallv(inputs, send_counts)[rank]
    else:
        raise ValueError(f"no oracle for {name}")
    got = _to_host(space, result, stream)
    if got.size != expected.size:
        return _WRONG, f"{got.size} elements where the oracle has {expected.size}", got.size, 0
    differs, allowed = _differs(got, expected, parts if name in _REDUCING else None, op, n)
    wrong = int(differs.sum())
    if not wrong:
        return _OK, "", 0, -1
    first = int(np.argmax(differs))
    said = f"index {first}: got {got[first].item()!r}, expected {expected[first].item()!r}"
    if allowed is not None:
        said += f" (rounding allows {float(allowed[first]):.3g})"
    return _WRONG, said, wrong, first


def _differs(got: np.ndarray, expected: np.ndarray, parts: list[np.ndarray] | None,
             op: str | None, nranks: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Which elements differ by more than the op allows; and what it allows (floats)."""
    dtype = got.dtype
    if parts is None:  # moved, not combined: bit for bit
        width = np.dtype(f"u{min(dtype.itemsize, 8)}")
        words = dtype.itemsize // width.itemsize  # 16-byte elements: two words each
        unequal = got.view(width) != expected.view(width)
        return unequal.reshape(got.size, words).any(axis=1), None
    floating = dtype.kind in "fc" or dtype == _BFLOAT16
    if not floating or op in ("min", "max"):
        same = got == expected
        if floating:
            same |= np.isnan(got.astype(np.float64)) & np.isnan(expected.astype(np.float64))
        return ~same, None
    info = ml_dtypes.finfo(dtype) if dtype == _BFLOAT16 else np.finfo(dtype)
    unit, largest = float(info.eps) / 2, float(info.max)
    wide = np.complex128 if dtype.kind == "c" else np.float64
    g, e = got.astype(wide), expected.astype(wide)
    with np.errstate(invalid="ignore", over="ignore", under="ignore", divide="ignore"):
        sizes = [np.abs(p.astype(wide)) for p in parts]
        if op == "prod":
            product = functools.reduce(np.multiply, sizes, np.ones(got.size))
            allowed = 2 * _gamma(3 * nranks, unit) * product
            # A partial product in some order may overflow or underflow: any result goes.
            grows = functools.reduce(np.multiply, [np.maximum(s, 1) for s in sizes],
                                     np.ones(got.size))
            shrinks = functools.reduce(np.multiply, [np.minimum(s, 1) for s in sizes],
                                       np.ones(got.size))
            out_of_range = (grows > largest) | (shrinks < float(info.tiny))
        else:
            if dtype.kind == "c":
                sizes = [np.abs(p.real.astype(np.float64)) + np.abs(p.imag.astype(np.float64))
                         for p in parts]
            total = functools.reduce(np.add, sizes, np.zeros(got.size))
            allowed = 2 * _gamma(nranks, unit) * total
            if op == "avg":
                allowed = allowed / nranks + 2 * unit * np.abs(e)
            out_of_range = total > largest  # a partial sum in some order may overflow
        allowed = allowed + nranks * float(info.smallest_subnormal)
        close = ((np.abs(g - e) <= allowed) | (g == e) | (np.isnan(g) & np.isnan(e))
                 | out_of_range)
    return ~close, allowed


def _gamma(k: int, unit: float) -> float:
    return k * unit / (1 - k * unit) if k * unit < 1 else float("inf")


def _describe(name: str, comm: Any, arguments: dict, dtype: np.dtype, verdicts: np.ndarray,
              local: str) -> str:
    op = arguments.get("op")
    details = [f"op={ReduceOp.parse(op).value}"] if op is not None else []
    if "root" in arguments:
        details.append(f"root={arguments['root']}")
    details += [dtype.name, f"algorithm={arguments.get('algorithm', 'direct')!r}",
                f"{comm.size} ranks"]
    wrong = [f"rank {r}: {v[1]} of {v[3]} elements differ, the first at index {v[2]}"
             for r, v in enumerate(verdicts) if v[0] == _WRONG]
    failed = [str(r) for r, v in enumerate(verdicts) if v[0] == _FAILED]
    if failed:
        wrong.append(f"rank(s) {', '.join(failed)} could not verify")
    here = f" | here (rank {comm.rank}): {local}" if local else ""
    return (f"{name} ({', '.join(details)}): the result differs from the numpy oracle: "
            + "; ".join(wrong) + here)
