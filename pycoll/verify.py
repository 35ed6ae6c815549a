"""Verify each collective's result against the numpy oracle as the program runs.

With ``PYCOLL_VERIFY=1`` (or ``comm.verify = True`` on every rank), every collective of that
communicator is checked after it returns: each rank copies its input to the host before the
call and its result after; the inputs travel to every rank as raw bytes, posted straight on
the host transport (no schedule, executor or reduction of pycoll's in between, so a bug there
cannot copy itself into the check); every rank compares its own result with what
:mod:`pycoll.oracle` computes from all the inputs, and that it left its input alone where the
call was not in place; and the ranks exchange verdicts, so a wrong result anywhere raises the
same :class:`VerificationError` on every rank (none is left waiting), naming the ranks, how
many elements differ and the first.

Integers, min and max, and every collective that only moves data must match exactly (copies
bit for bit). Sums, averages and products of floats may differ from the oracle, which
combines in rank order, by the rounding another order allows, per element: 2γₙ·Σ|xᵣ| for a sum
(γₙ = n·u/(1 − n·u), u the unit roundoff of the dtype, n the rank count), that over n plus two
roundings of the quotient for an average, 2γ₃ₙ·Π|xᵣ| for a product, plus n of the dtype's
smallest subnormal (times the product of the factors above 1, for a product: gradual
underflow). Where a partial sum or product could overflow in some order (the sum of the
positive or of the negative terms, or the product of the factors above 1, past the dtype's
largest value), an infinite or NaN result passes too, and a finite one is measured against
the exact value, not the oracle's (which may itself have overflowed).

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

# Set once any communicator verifies; until then a collective reads only this.
active = False
_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_REDUCING = ("allreduce", "reduce_scatter", "reduce")
_OK, _WRONG, _FAILED, _WROTE_INPUT = 0, 1, 2, 3  # a rank's verdict
_COUNTS = ("counts", "send_counts", "recv_counts")


class VerificationError(RuntimeError):
    """A collective's result differs from the numpy oracle (raised on every rank)."""


def enabled_by_default() -> bool:
    """``PYCOLL_VERIFY`` (0 or 1), read when a communicator is made."""
    text = os.environ.get("PYCOLL_VERIFY", "0").strip() or "0"
    if text not in ("0", "1"):
        raise ValueError(f"PYCOLL_VERIFY={text!r} is invalid; allowed: 0 or 1")
    if text == "1":
        turn_on()
    return text == "1"


def turn_on() -> None:
    """Some communicator verifies from now on."""
    global active
    active = True


def verified(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The public collective ``name`` (``comm`` and ``async_op`` keyword-only), checked
    against the oracle where its communicator verifies; otherwise called as it is."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def collective(*args: Any, **kwargs: Any) -> Any:
            if not active or kwargs.get("async_op"):  # async: the worker calls this again
                return fn(*args, **kwargs)
            comm = _communicator(kwargs.get("comm"))
            if comm is None or not comm.verify:
                return fn(*args, **kwargs)
            comm.drain()  # async calls queued before may be inside their own verification
            if comm.verifying or comm.agreeing:  # inside a verified call, or the agreement
                return fn(*args, **kwargs)
            return _verify(fn, name, comm, signature, args, kwargs)

        return collective

    return wrap


@functools.cache
def _comm_module() -> Any:
    from pycoll import comm  # not at import: pycoll.comm imports this module

    return comm


def _communicator(comm: Any) -> Any:
    module = _comm_module()
    if comm is None:
        return module.world()
    return comm if isinstance(comm, module.Communicator) else None  # the call names it


def _verify(fn: Callable[..., Any], name: str, comm: Any, signature: inspect.Signature,
            args: tuple, kwargs: dict) -> Any:
    from pycoll.spaces import space_of

    try:
        call = signature.bind(*args, **kwargs)
    except TypeError:
        return fn(*args, **kwargs)  # the call's own error
    call.apply_defaults()
    arguments = call.arguments
    for key in _COUNTS:  # an iterator would be used up by the call: read it once, here
        counts = arguments.get(key)
        if counts is not None and not isinstance(counts, list | tuple | np.ndarray):
            try:
                arguments[key] = list(counts)
            except TypeError:
                return fn(*args, **kwargs)  # not counts at all: the call names it
    x, stream = arguments["x"], arguments.get("stream")
    space = space_of(x)
    if space is None:
        return fn(*args, **kwargs)  # not an array: the call names it
    before = _to_host(space, x, stream)  # before the call: it may write x (in place)
    comm.verifying = True  # calls made inside the call are not verified themselves
    try:
        result = fn(*call.args, **call.kwargs)
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
    sizes = [int(s[0]) for s in _exchange(comm, name, np.array([mine.size], np.int64))]
    inputs = _exchange(comm, name, mine, sizes)
    send_counts = None
    if name == "alltoallv":  # every rank's, in elements
        row = mine.size // max(len(arguments["x"]), 1)
        counts = np.array([int(c) * row for c in arguments["send_counts"]], np.int64)
        send_counts = [c.tolist() for c in _exchange(comm, name, counts)]
    verdict, local, wrong, first = _FAILED, "", 0, -1
    try:
        verdict, local, wrong, first = _compare(name, comm, arguments, inputs, send_counts,
                                                result, space, stream)
        if verdict == _OK and not _in_place(name, arguments["x"], result, space):
            after = _to_host(space, arguments["x"], stream)
            changed, _ = _differs(after, mine, None, None, comm.size)
            if changed.any():
                verdict, wrong, first = _WROTE_INPUT, int(changed.sum()), int(np.argmax(changed))
                local = (f"the call changed its input x (not given in place): index {first} "
                         f"was {mine[first].item()!r}, is {after[first].item()!r}")
    except Exception as error:  # said on every rank: no rank may skip the verdicts' exchange
        local = f"{type(error).__name__}: {error}"
    size = 0 if result is None else int(result.size)
    verdicts = np.stack(_exchange(comm, name, np.array([verdict, wrong, first, size], np.int64)))
    if (verdicts[:, 0] == _OK).all():
        return
    raise VerificationError(_describe(name, comm, arguments, mine.dtype, verdicts, local))


def _exchange(comm: Any, name: str, mine: np.ndarray, sizes: list[int] | None = None
              ) -> list[np.ndarray]:
    """Every rank's ``mine`` (flat; ``sizes``: each rank's element count, when they differ),
    in rank order: raw bytes posted straight on the host transport, with a tag of their own."""
    from pycoll.api import _timed_out
    from pycoll.bindings.transport import WaitTimeout

    if sizes is None:
        sizes = [mine.size] * comm.size
    transport, tag = comm.host_transport(), comm.next_tag()
    raw = mine.view(np.uint8)
    got = [raw if r == comm.rank else np.empty(sizes[r] * mine.itemsize, np.uint8)
           for r in range(comm.size)]
    others = [r for r in range(comm.size) if r != comm.rank]
    try:
        requests = [transport.irecv(got[r], r, tag) for r in others if got[r].size]
        requests += [transport.isend(raw, r, tag) for r in others if raw.size]
        transport.waitall(requests)
    except WaitTimeout as late:
        raise _timed_out(comm, f"{name} (verification)", late) from None
    return [g.view(mine.dtype) for g in got]


def _in_place(name: str, x: Any, result: Any, space: Any) -> bool:
    return name == "broadcast" or (result is not None and space.may_share_memory(result, x))


def _compare(name: str, comm: Any, arguments: dict, inputs: list[np.ndarray],
             send_counts: list | None, result: Any, space: Any, stream: Any
             ) -> tuple[int, str, int, int]:
    """(verdict, what this rank saw, elements wrong, first wrong flat index)."""
    rank, n = comm.rank, comm.size
    op = arguments.get("op")
    op = None if op is None else ReduceOp.parse(op).value  # the call accepted it
    x = arguments["x"]
    parts: list[np.ndarray] | None = None  # each rank's contribution to each element
    if name == "reduce" and rank != arguments["root"]:
        if result is not None:
            return _WRONG, f"rank {rank} is not the root but got {type(result).__name__}", 0, -1
        return _OK, "", 0, -1
    if name in ("allreduce", "reduce"):
        expected, parts = oracle.allreduce(inputs, op), inputs
    elif name == "reduce_scatter":
        row = inputs[rank].size // max(len(x), 1)
        counts = arguments["counts"]
        counts = [len(x) // n] * n if counts is None else [int(c) for c in counts]
        starts = np.cumsum([0, *(c * row for c in counts)])
        parts = [part[starts[rank] : starts[rank + 1]] for part in inputs]
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
    if result.dtype != x.dtype or result.shape[1:] != x.shape[1:]:
        return (_WRONG, f"the result is {result.dtype}{list(result.shape)} for an input of "
                f"{x.dtype}{list(x.shape)}", int(result.size), 0)
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
    unit, largest, subnormal = float(info.eps) / 2, float(info.max), float(info.smallest_subnormal)
    wide = np.complex128 if dtype.kind == "c" else np.float64
    g, e = got.astype(wide), expected.astype(wide)
    values = [p.astype(wide) for p in parts]
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        if op == "prod":
            sizes = [np.abs(v) for v in values]
            exact = functools.reduce(np.multiply, values)
            grows = functools.reduce(np.multiply, [np.maximum(s, 1) for s in sizes])
            allowed = (2 * _gamma(3 * nranks, unit) * functools.reduce(np.multiply, sizes)
                       + nranks * subnormal * grows)
            may_overflow = grows > largest
        else:
            components = [v.real for v in values] + ([v.imag for v in values]
                                                     if dtype.kind == "c" else [])
            exact = functools.reduce(np.add, values)
            total = functools.reduce(np.add, [np.abs(c) for c in components])
            allowed = 2 * _gamma(nranks, unit) * total
            # a partial sum in some order reaches the positive terms' sum, or the negatives'
            reach = [functools.reduce(np.add, [np.maximum(sign * c, 0) for c in part])
                     for part in ([v.real for v in values], [v.imag for v in values])
                     for sign in (1, -1)]
            may_overflow = functools.reduce(np.maximum, reach) * (1 + _gamma(nranks, unit)) > (
                largest)
            if op == "avg":
                exact = exact / nranks
                allowed = allowed / nranks + 2 * unit * np.abs(exact)
            allowed = allowed + nranks * subnormal
        close = (np.abs(g - e) <= allowed) | (g == e) | (np.isnan(g) & np.isnan(e))
        # where some order overflows: inf or NaN, or (the oracle's may have) the exact value
        close |= may_overflow & (~np.isfinite(g) | (np.abs(g - exact) <= allowed))
    return ~close, allowed


def _gamma(k: int, unit: float) -> float:
    return k * unit / (1 - k * unit) if k * unit < 1 else float("inf")


def _describe(name: str, comm: Any, arguments: dict, dtype: np.dtype, verdicts: np.ndarray,
              local: str) -> str:
    details = []
    if arguments.get("op") is not None:
        details.append(f"op={ReduceOp.parse(arguments['op']).value}")
    if "root" in arguments:
        details.append(f"root={arguments['root']}")
    details.append(dtype.name)
    if "algorithm" in arguments:
        details.append(f"algorithm={arguments['algorithm']!r}")
    details.append(f"{comm.size} ranks")
    wrong = [f"rank {r}: {v[1]} of {v[3]} elements differ, the first at index {v[2]}"
             if v[0] == _WRONG else
             f"rank {r} changed {v[1]} elements of its input x, the first at index {v[2]}"
             for r, v in enumerate(verdicts) if v[0] in (_WRONG, _WROTE_INPUT)]
    failed = [str(r) for r, v in enumerate(verdicts) if v[0] == _FAILED]
    head = f"{name} ({', '.join(details)}): "
    if wrong:
        head += "the result differs from the numpy oracle: " + "; ".join(wrong)
        if failed:
            head += f"; rank(s) {', '.join(failed)} could not verify"
    else:
        head += f"the result could not be verified on rank(s) {', '.join(failed)}"
    return head + (f" | here (rank {comm.rank}): {local}" if local else "")
