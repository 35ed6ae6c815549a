"""Host (numpy) element-wise reduction: the lowest layer of pycoll.

Every collective that combines data (AllReduce, ReduceScatter, Reduce) does so
through two calls, ``reduce_into(dst, src, op)`` once per incoming piece and
``finish(work, op, nranks)`` once at the end. This module is the numpy instance of
that reducer interface; later Numba/CuPy kernels implement the same two functions,
so algorithms never care where the arithmetic runs.

Semantics, chosen to match NCCL:

* ``reduce_into`` works in place, in the buffer's own dtype, with the numpy ufunc
  (``np.add``, ``np.multiply``, ``np.minimum``, ``np.maximum``) and ``out=dst``, so
  it allocates nothing for the common dtypes. Integer overflow wraps silently, as
  in C; float overflow gives inf and NaN propagates through min/max, with numpy's
  usual RuntimeWarning but never an error, even where the caller's ``np.errstate`` or
  warning filters would raise one (only the ranks that overflowed would raise).
* ``avg`` combines exactly like ``sum``; the division by the rank count happens
  once, in ``finish``. For floats and complex the quotient is rounded once to the
  array's dtype (complex divides the real and imaginary parts separately). For
  integers avg means *sum first, then divide with truncation toward zero* (C
  semantics, as NCCL's integer average): ``-7`` averaged over 2 ranks is ``-3``.
  Because the sum is taken in the integer dtype, it may wrap before the division,
  exactly as in NCCL; use a wider dtype if the sum can overflow.
* ``min`` and ``max`` are not defined for complex dtypes and are rejected.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable

import ml_dtypes
import numpy as np

__all__ = [
    "ReduceOp",
    "SUPPORTED_DTYPES",
    "SUPPORTED_SET",
    "check_dtype",
    "check_op_for_dtype",
    "reduce_into",
    "reducer",
    "finish",
]


class ReduceOp(enum.Enum):
    """How element-wise values from different ranks are combined."""

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"

    @classmethod
    def parse(cls, op: str | ReduceOp) -> ReduceOp:
        """Return ``op`` as a ReduceOp; accepts a ReduceOp or a case-insensitive name."""
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str):
            try:
                return cls(op.lower())
            except ValueError:
                pass
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"op={op!r} is not a reduction; allowed: {allowed} or a pycoll.ReduceOp")


_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

SUPPORTED_DTYPES: tuple[np.dtype, ...] = (
    np.dtype(np.int8),
    np.dtype(np.int16),
    np.dtype(np.int32),
    np.dtype(np.int64),
    np.dtype(np.uint8),
    np.dtype(np.uint16),
    np.dtype(np.uint32),
    np.dtype(np.uint64),
    np.dtype(np.float16),
    np.dtype(np.float32),
    np.dtype(np.float64),
    _BFLOAT16,
    np.dtype(np.complex64),
    np.dtype(np.complex128),
)

# bfloat16 has kind 'V' (it is not an np.floating subtype), so classify explicitly.
_FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64), _BFLOAT16)
_COMPLEX_DTYPES = (np.dtype(np.complex64), np.dtype(np.complex128))

_UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,  # avg divides once, in finish()
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}


SUPPORTED_SET = frozenset(SUPPORTED_DTYPES)  # for the hot paths' membership tests
_ALLOWED_NAMES = ", ".join(d.name for d in SUPPORTED_DTYPES)


def check_dtype(dtype: object) -> np.dtype:
    """Return ``dtype`` as an np.dtype if pycoll can reduce it, else raise TypeError."""
    if isinstance(dtype, np.dtype) and dtype in SUPPORTED_SET:
        return dtype  # the hot path: called on every collective
    allowed = _ALLOWED_NAMES
    if dtype is None:  # np.dtype(None) would silently mean float64
        raise TypeError(f"dtype=None is not supported; allowed: {allowed}")
    try:
        dt = np.dtype(dtype)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise TypeError(f"dtype={dtype!r} is not a dtype; allowed: {allowed}") from None
    if dt not in SUPPORTED_SET:
        native = dt.newbyteorder("=")
        hint = (f" ({native} in the other byte order: convert with "
                f".astype({str(native)!r}))" if native != dt and native in SUPPORTED_SET
                else "")
        raise TypeError(f"dtype={str(dt)!r} is not supported{hint}; allowed: {allowed}")
    return dt


def check_op_for_dtype(op: ReduceOp, dtype: object) -> None:
    """Raise ValueError if ``op`` has no meaning for ``dtype`` (min/max on complex)."""
    op = ReduceOp.parse(op)
    dt = check_dtype(dtype)
    if dt in _COMPLEX_DTYPES and op in (ReduceOp.MIN, ReduceOp.MAX):
        raise ValueError(
            f"op={op.value!r} is not defined for {dt.name}; allowed for complex: 'sum', 'prod', "
            "'avg'"
        )


def _probe(ufunc: np.ufunc, dtype: np.dtype) -> bool:
    """True if ``ufunc`` has a native in-place loop for ``dtype``."""
    a = np.ones(2, dtype=dtype)
    try:
        with np.errstate(all="ignore"):
            ufunc(a, a, out=a)
    except TypeError:  # UFuncTypeError subclasses TypeError
        return False
    return True


def _float32_fallback(ufunc: np.ufunc) -> Callable[[np.ndarray, np.ndarray], None]:
    # Rounding a float32 result to bfloat16 is exact for min/max and correctly rounded
    # for add/mul (24 >= 2*8+2 bits: double rounding is innocuous).
    def apply(dst: np.ndarray, src: np.ndarray) -> None:
        tmp = dst.astype(np.float32)
        ufunc(tmp, src.astype(np.float32), out=tmp)
        dst[...] = tmp.astype(dst.dtype)

    return apply


# ml_dtypes registers bfloat16 loops for these ufuncs; probe once so an older or
# different build that lacks one still works, via float32.
_BF16_FALLBACK: dict[np.ufunc, Callable[[np.ndarray, np.ndarray], None]] = {
    uf: _float32_fallback(uf) for uf in set(_UFUNCS.values()) if not _probe(uf, _BFLOAT16)
}


def reduce_into(dst: np.ndarray, src: np.ndarray, op: ReduceOp) -> None:
    """In place ``dst = dst (op) src``, element-wise, in dst's dtype.

    AVG combines as SUM; call ``finish`` once after the last piece.
    """
    if not isinstance(dst, np.ndarray):
        raise TypeError(f"dst must be a numpy.ndarray, got {type(dst).__name__}")
    if not isinstance(src, np.ndarray):
        raise TypeError(f"src must be a numpy.ndarray, got {type(src).__name__}")
    if dst.dtype != src.dtype:
        raise TypeError(
            f"src.dtype={src.dtype.name} differs from dst.dtype={dst.dtype.name}; "
            "both buffers of a reduction must have the same dtype"
        )
    if dst.shape != src.shape:
        raise ValueError(
            f"src.shape={src.shape} differs from dst.shape={dst.shape}; "
            "both buffers of a reduction must have the same shape"
        )
    # C semantics, silently: integers wrap, floats overflow to inf, NaN propagates.
    with np.errstate(all="ignore"):
        reducer(ReduceOp.parse(op), dst.dtype)(dst, src)


@functools.cache
def reducer(op: ReduceOp, dtype: np.dtype) -> Callable[..., None]:
    """``reduce(dst, src)``: in place ``dst = dst (op) src`` for arrays of ``dtype``;
    ``reduce(dst, src, first)``: ``dst = first (op) src``, sparing a copy of ``first``.

    Validated once per (op, dtype); the executor calls the result on its hot path, where
    the arrays are known to match. IEEE floats get no ``np.errstate`` block, which would
    cost more than a small reduction: an overflow gives inf, as in C, and numpy reports it
    with its usual RuntimeWarning, as for any numpy add (never an error: see below).
    bfloat16 keeps one, since ml_dtypes warns spuriously when min/max meet a NaN.
    """
    check_op_for_dtype(op, dtype)
    ufunc = _UFUNCS[op]
    if np.dtype(dtype) != _BFLOAT16:

        def reduce(dst: np.ndarray, src: np.ndarray, first: np.ndarray | None = None) -> None:
            try:
                ufunc(dst if first is None else first, src, out=dst)
            except (FloatingPointError, RuntimeWarning):
                # np.errstate(over="raise") or warnings as errors: numpy raises after the
                # loop has written inf. Raising on the ranks whose piece overflowed alone
                # would leave the others waiting; the collective gives inf, as MPI does.
                pass

        if ufunc is np.multiply and np.dtype(dtype) in _COMPLEX_DTYPES:
            return _complex_product(reduce)
        reduce.ufunc = ufunc  # what it calls: a caller with both operands may call it directly
        return reduce

    combine = _BF16_FALLBACK.get(ufunc)

    def reduce_bfloat16(
        dst: np.ndarray, src: np.ndarray, first: np.ndarray | None = None
    ) -> None:
        with np.errstate(all="ignore"):
            if combine is not None:
                if first is not None:
                    dst[...] = first
                combine(dst, src)
            else:
                ufunc(dst if first is None else first, src, out=dst)

    return reduce_bfloat16


def _complex_product(reduce: Callable[..., None]) -> Callable[..., None]:
    """``reduce`` for complex ``prod``, whose last bits depend on numpy's loop: one element
    written over an operand takes a loop of its own (without the fused multiply-add of the
    others), so a block of one element would come out unlike the same product in a longer
    array (as on a rank whose block is longer, or the oracle's). Written from a copy there."""

    def product(dst: np.ndarray, src: np.ndarray, first: np.ndarray | None = None) -> None:
        if dst.size == 1:
            product = np.empty_like(dst)
            reduce(product, src, dst if first is None else first)  # inf, never an error
            dst[...] = product
        else:
            reduce(dst, src, first)

    return product


def _trunc_div_int(work: np.ndarray, n: int) -> None:
    """In place ``work = trunc(work / n)`` for an integer array, C semantics."""
    info = np.iinfo(work.dtype)
    if n > info.max:
        # Only for narrow dtypes with huge rank counts: every |x| < n, except x == min
        # when n == -min, whose quotient is -1.
        hit = work == info.min if info.min < 0 and n == -info.min else None
        work[...] = 0
        if hit is not None:
            work[hit] = -1
        return
    d = work.dtype.type(n)
    if info.min == 0:
        np.floor_divide(work, d, out=work)  # unsigned: floor is truncation
        return
    # x - fmod(x, n) is an exact multiple of n between 0 and x, so it cannot overflow
    # and floor division of it truncates toward zero.
    rem = np.fmod(work, d)
    np.subtract(work, rem, out=work)
    np.floor_divide(work, d, out=work)


def finish(work: np.ndarray, op: ReduceOp, nranks: int) -> None:
    """In place post-processing after the last ``reduce_into``; only AVG does anything.

    Floats: the quotient ``work / nranks`` is rounded once to work's dtype (for
    float16/bfloat16/float32 it is computed in float64, so nranks itself is never
    rounded to the narrow dtype). Complex: real and imaginary parts are divided
    separately. Integers: truncation toward zero, e.g. -7 over 2 ranks -> -3.
    """
    if not isinstance(work, np.ndarray):
        raise TypeError(f"work must be a numpy.ndarray, got {type(work).__name__}")
    if isinstance(nranks, bool) or not isinstance(nranks, int | np.integer):
        raise TypeError(f"nranks={nranks!r} must be an int >= 1")
    if nranks < 1:
        raise ValueError(f"nranks={nranks!r} is invalid; allowed: an int >= 1")
    op = ReduceOp.parse(op)
    check_op_for_dtype(op, work.dtype)
    if op is not ReduceOp.AVG or nranks == 1:
        return
    n = int(nranks)
    dt = work.dtype
    # A float64 array of ones-shape, not a scalar: numpy 1.x value-based casting would
    # otherwise demote a scalar divisor to work's dtype.
    divisor = np.full((1,) * work.ndim, n, dtype=np.float64)
    with np.errstate(all="ignore"):
        if dt in _FLOAT_DTYPES:
            # float64 quotient then one rounding is correctly rounded for every float
            # here (53 >= 2p+2); a bfloat16 divisor would round nranks > 256.
            np.divide(work, divisor, out=work, casting="same_kind")
        elif dt in _COMPLEX_DTYPES:
            # numpy's complex/real multiplies by a reciprocal (not exact) and turns
            # inf+1j into nan; dividing each part is what "divide by n" means.
            for part in (work.real, work.imag):
                np.divide(part, divisor, out=part, casting="same_kind")
        else:
            _trunc_div_int(work, n)
