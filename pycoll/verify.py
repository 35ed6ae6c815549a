"""Verify each collective's result against the numpy oracle as the program runs.

With ``PYCOLL_VERIFY=1`` (or ``comm.verify = True`` on every rank), every collective of that
communicator is checked after it returns: each rank copies its input to the host before the
call and its result after; the inputs travel to every rank as raw bytes, posted straight on
the host transport (no schedule, executor or reduction of pycoll's in between, so a bug there
cannot copy itself into the check); every rank compares its own result with what
:mod:`pycoll.oracle` computes from all the inputs, and that it left its input alone where the
call was not in place (in-place ReduceScatter: x's rows other than its result); and the
ranks exchange verdicts (and first what their calls say: each rank would check its own
reading of the call, and under a schedule where each rank reduces every input itself, pass),
so a wrong result anywhere raises the same :class:`VerificationError` on every rank (none is
left waiting), naming the ranks, how many elements differ and the first.

Integers, min and max, and every collective that only moves data must match exactly (copies
bit for bit). Sums, averages and products of floats may differ from the oracle, which
combines in rank order, by the rounding another order allows, per element: 2γₙ·Σ|xᵣ| for a sum
(γₙ = n·u/(1 − n·u), u the unit roundoff of the dtype, n the rank count), that over n plus two
roundings of the quotient for an average, 2γ₃ₙ·Π|xᵣ| for a product, plus n of the dtype's
smallest subnormal (times the product of the factors above 1, for a product: gradual
underflow). What falls outside is measured, in extended precision, against what some order
can give where partial results overflow or underflow, or inputs are infinite or NaN
(``_reachable``).

Debugging only: every rank receives every rank's input (n times the input's memory) and the
check costs far more than the collective (docs/reliability.md). Send and Recv are not
verified: a receiver cannot know what was sent without a message of its own.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from pycoll import agree, oracle
from pycoll.kernels import ReduceOp
from pycoll.settings import switch

# Set once any communicator verifies; until then a collective reads only this.
active = False
_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_REDUCING = ("allreduce", "reduce_scatter", "reduce")
_OK, _WRONG, _FAILED, _WROTE_INPUT = 0, 1, 2, 3  # a rank's verdict
_COUNTS = ("counts", "send_counts", "recv_counts")
_CHUNK = 1 << 18  # float elements compared at a time
_CALL_FIELDS = ("dtype", "row", "op", "root", "counts")  # see _call


class VerificationError(RuntimeError):
    """A collective's result differs from the numpy oracle (raised on every rank)."""


def enabled_by_default() -> bool:
    """``PYCOLL_VERIFY`` (0 or 1), read when a communicator is made."""
    on = bool(switch("PYCOLL_VERIFY", False))
    if on:
        turn_on()
    return on


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
            if not active:
                return fn(*args, **kwargs)
            flag = kwargs.get("async_op", False)
            if flag is not False and flag is not np.False_:
                return fn(*args, **kwargs)  # async: the worker calls this again (or fn says
                # what is wrong with async_op)
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
    rows = [agree.unpack(row) for row in
            _exchange(comm, name, agree.pack({"size": mine.size, **_call(arguments, mine)}))]
    differ = agree.differing(rows, _CALL_FIELDS)
    if differ:  # each rank would check its own reading of the call, and might pass it
        raise VerificationError(
            f"{name}: the ranks' calls differ, so no result can be verified: "
            f"{agree.holders(rows, differ)} (PYCOLL_CHECK=1 stops such calls before they run)")
    inputs = _exchange(comm, name, mine, [int(row["size"]) for row in rows])
    send_counts = None
    if name == "alltoallv":  # every rank's, in elements
        row = mine.size // max(len(arguments["x"]), 1)
        counts = np.array([int(c) * row for c in arguments["send_counts"]], np.int64)
        send_counts = [c.tolist() for c in _exchange(comm, name, counts)]
    verdict, local, wrong, first, size = _FAILED, "", 0, -1, 0
    try:
        size = 0 if result is None else int(result.size)
        verdict, local, wrong, first = _compare(name, comm, arguments, inputs, send_counts,
                                                result, space, stream)
        written = _written_input(name, arguments["x"], result, space)
        if verdict == _OK and written != slice(None):
            after = _to_host(space, arguments["x"], stream)
            changed, _ = _differs(after, mine, None, None, comm.size)
            changed[written] = False
            if changed.any():
                verdict, wrong, first = _WROTE_INPUT, int(changed.sum()), int(np.argmax(changed))
                local = (f"the call changed its input x (not given in place): index {first} "
                         f"was {mine[first].item()!r}, is {after[first].item()!r}")
    except Exception as error:  # said on every rank: no rank may skip the verdicts' exchange
        verdict, local = _FAILED, f"{type(error).__name__}: {error}"
    verdicts = np.stack(_exchange(comm, name, np.array([verdict, wrong, first, size], np.int64)))
    if (verdicts[:, 0] == _OK).all():
        return
    raise VerificationError(_describe(name, comm, arguments, mine.dtype, verdicts, local))


def _call(arguments: dict, mine: np.ndarray) -> dict:
    """What every rank's call must agree on for its result to mean one thing (the call has
    accepted these values): the dtype and row shape, and the op, root and counts given."""
    op, root, counts = (arguments.get(key) for key in ("op", "root", "counts"))
    return {
        "dtype": str(mine.dtype),
        "row": list(np.shape(arguments["x"])[1:]),
        "op": None if op is None else ReduceOp.parse(op).value,
        "root": None if root is None else int(root),
        "counts": agree.counts_field(None if counts is None else [int(c) for c in counts]),
    }


def _exchange(comm: Any, name: str, mine: np.ndarray, sizes: list[int] | None = None
              ) -> list[np.ndarray]:
    """Every rank's ``mine`` (flat; ``sizes``: each rank's element count, when they differ),
    in rank order: raw bytes posted straight on the host transport, with a tag of their own."""
    from pycoll.bindings.transport import INTERRUPTS, ChannelsCrossed, WaitTimeout

    if sizes is None:
        sizes = [mine.size] * comm.size
    transport, tag = comm.host_transport(), _comm_module().VERIFICATION_TAG
    raw = mine.view(np.uint8)
    got = [raw if r == comm.rank else np.empty(sizes[r] * mine.itemsize, np.uint8)
           for r in range(comm.size)]
    others = [r for r in range(comm.size) if r != comm.rank]
    try:
        requests = [transport.irecv(got[r], r, tag) for r in others if got[r].size]
        requests += [transport.isend(raw, r, tag) for r in others if raw.size]
        transport.waitall(requests)
    except WaitTimeout as late:
        raise comm.timed_out(f"{name} (verification)", late) from None
    except ChannelsCrossed as error:  # a message left in a ring: no later call can run
        raise comm.broken_by(error) from None
    except INTERRUPTS as stop:
        comm.interrupted(f"{name} (verification)", stop)
        raise
    return [g.view(mine.dtype) for g in got]


def _written_input(name: str, x: Any, result: Any, space: Any) -> slice:
    """The elements of flat ``x`` the call may write: none out of place; the result's own
    rows of an in-place ReduceScatter (the rest must be left as they were); else all."""
    if name != "broadcast" and (result is None or not space.may_share_memory(result, x)):
        return slice(0, 0)
    if name == "reduce_scatter" and result.size < x.size:
        start = (space.address(result) - space.address(x)) // x.itemsize
        return slice(start, start + result.size)
    return slice(None)


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
    differs, allowed = np.zeros(got.size, bool), np.zeros(got.size)
    for start in range(0, got.size, _CHUNK):  # bounds the wide temporaries
        part = slice(start, start + _CHUNK)
        differs[part], allowed[part] = _float_differs(
            got[part], expected[part], [p[part] for p in parts], op, nranks)
    return differs, allowed


def _float_differs(got: np.ndarray, expected: np.ndarray, parts: list[np.ndarray], op: str,
                   nranks: int) -> tuple[np.ndarray, np.ndarray]:
    """Float sums, averages and products: first what is surely within rounding of the
    oracle's result, in float64; then, for the rest only, what some order of combining can
    give (overflow, underflow, infinite and NaN inputs), in extended precision."""
    info = _finfo(got.dtype)
    if got.dtype.kind == "c" and op != "prod":  # complex sums and averages: two real ones
        real = [_float_differs(part(got).astype(info.dtype), part(expected).astype(info.dtype),
                               [part(p) for p in parts], op, nranks)
                for part in (np.real, np.imag)]
        return real[0][0] | real[1][0], np.maximum(real[0][1], real[1][1])
    unit, subnormal = float(info.eps) / 2, float(info.smallest_subnormal)
    wide = np.complex128 if got.dtype.kind == "c" else np.float64
    with np.errstate(all="ignore"):
        g, e = got.astype(wide), expected.astype(wide)
        if op == "prod":
            magnitude = np.abs(parts[0].astype(wide))
            for p in parts[1:]:
                magnitude *= np.abs(p.astype(wide))
            allowed = 2 * _gamma(3 * nranks, unit) * magnitude
        else:
            magnitude = np.zeros(got.size)
            for p in parts:
                magnitude += np.abs(p.astype(wide))
            allowed = 2 * _gamma(nranks, unit) * magnitude
            if op == "avg":
                allowed = allowed / nranks + 2 * unit * np.abs(e)
        allowed += nranks * subnormal
        same = functools.reduce(np.logical_and, [  # per component: NaN where the oracle's is
            (part(g) == part(e)) | (np.isnan(part(g)) & np.isnan(part(e)))
            for part in ((np.real, np.imag) if got.dtype.kind == "c" else (np.real,))])
        sure = ((np.abs(g - e) <= allowed) & np.isfinite(allowed)) | same
    suspects = np.flatnonzero(~sure)
    if suspects.size:
        sure[suspects] = _reachable(got[suspects], [p[suspects] for p in parts], op, nranks)
    return ~sure, allowed


def _reachable(got: np.ndarray, parts: list[np.ndarray], op: str, nranks: int) -> np.ndarray:
    """Whether some order of combining ``parts`` gives ``got``, within rounding (elementwise,
    in extended precision, so that the bounds themselves do not overflow: numpy's longdouble,
    80-bit on x86-64; where it is float64, float64 bounds near the largest value are loose)."""
    if got.dtype.kind == "c" and op != "prod":  # complex sums are two real sums
        real = _finfo(got.dtype).dtype
        return (_reachable(got.real.astype(real), [p.real for p in parts], op, nranks)
                & _reachable(got.imag.astype(real), [p.imag for p in parts], op, nranks))
    info = _finfo(got.dtype)
    unit, largest = float(info.eps) / 2, float(info.max)
    subnormal = float(info.smallest_subnormal)
    wide = np.clongdouble if got.dtype.kind == "c" else np.longdouble
    with np.errstate(all="ignore"):
        values = [p.astype(wide) for p in parts]
        g = got.astype(wide)
        nan_in = functools.reduce(np.logical_or, [np.isnan(v) for v in values])
        if op == "prod":
            return _product_reachable(g, values, nan_in, nranks, unit, largest, subnormal)
        finite = [np.where(np.isfinite(v), v, 0) for v in values]
        gamma = _gamma(nranks, unit)
        exact = functools.reduce(np.add, finite)
        allowed = 2 * gamma * functools.reduce(np.add, [np.abs(v) for v in finite])
        if op == "avg":
            exact = exact / nranks
            allowed = allowed / nranks + 2 * unit * np.abs(exact)
        allowed += nranks * subnormal
        # A partial sum reaches, in some order, all the positive terms (or all the negative):
        # past the largest value, with two terms at least, it overflows.
        up, down = (_overflows([np.maximum(sign * v, 0) for v in finite], gamma, largest)
                    for sign in (1, -1))
        plus_inf = functools.reduce(np.logical_or, [v == np.inf for v in values])
        minus_inf = functools.reduce(np.logical_or, [v == -np.inf for v in values])
        up, down = up | plus_inf, down | minus_inf
        finite_in = ~nan_in & ~plus_inf & ~minus_inf
        return ((finite_in & np.isfinite(g) & (np.abs(g - exact) <= allowed))
                | ((g == np.inf) & up & ~minus_inf & ~nan_in)
                | ((g == -np.inf) & down & ~plus_inf & ~nan_in)
                | (np.isnan(g) & (nan_in | (up & down))))


def _overflows(terms: list[np.ndarray], gamma: float, largest: float) -> np.ndarray:
    """Whether a partial sum of the nonnegative ``terms`` can pass ``largest`` in rounded
    arithmetic (one term alone never overflows: two at least)."""
    nonzero = functools.reduce(np.add, [(t > 0).astype(np.int64) for t in terms])
    return (functools.reduce(np.add, terms) * (1 + gamma) > largest) & (nonzero >= 2)


def _product_reachable(g: np.ndarray, values: list[np.ndarray], nan_in: np.ndarray,
                       nranks: int, unit: float, largest: float, subnormal: float
                       ) -> np.ndarray:
    sizes = [np.abs(v) for v in values]
    inf_in = functools.reduce(np.logical_or, [np.isinf(s) for s in sizes])
    zero_in = functools.reduce(np.logical_or, [s == 0 for s in sizes])
    finite = [np.where(np.isfinite(s), s, 1) for s in sizes]
    grows = functools.reduce(np.multiply, [np.maximum(s, 1) for s in finite])
    shrinks = functools.reduce(np.multiply, [np.where(s < 1, s, 1) for s in finite])
    gamma = _gamma(3 * nranks, unit)
    complex_ = np.iscomplexobj(g)
    # An order multiplying the factors above 1 first may overflow (two of them at least;
    # complex: its parts may), or the ones below 1 first underflow to zero.
    above = functools.reduce(np.add, [(s > 1).astype(np.int64) for s in finite])
    over = (grows * (1 + gamma) * (2 if complex_ else 1) > largest) & (above >= 2)
    vanish = (shrinks < np.longdouble(subnormal) / 2) & ~zero_in
    exact = functools.reduce(np.multiply, values)
    allowed = (2 * gamma * functools.reduce(np.multiply, finite) + nranks * subnormal * grows)
    near = np.isfinite(g) & (np.abs(g - exact) <= allowed) & ~inf_in & ~nan_in
    near = np.where(zero_in, (g == 0) & ~inf_in & ~nan_in, near)  # a zero factor: 0, exactly
    if complex_:  # the parts' signs after an overflow are not worth modelling: any
        return near | (~np.isfinite(g) & (over | inf_in | nan_in))
    same_sign = np.signbit(g) == np.signbit(exact)
    infinite = np.isinf(g) & same_sign & (over | inf_in) & ~zero_in & ~nan_in
    nan = np.isnan(g) & (nan_in | ((inf_in | over) & (zero_in | vanish)))
    return near | infinite | nan


def _finfo(dtype: np.dtype) -> Any:
    return ml_dtypes.finfo(dtype) if dtype == _BFLOAT16 else np.finfo(dtype)


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
