"""The mathematical result of each collective, computed straightforwardly in numpy.

Each function takes ALL ranks' inputs (a list of 1-D arrays, index = rank) and
returns what the collective's contract says the receiving rank(s) end with. It is
an independent statement of the math that pycoll's algorithms are checked
against, so it deliberately does not import ``pycoll.kernels``: a bug in the
reducer cannot hide by appearing on both sides of a comparison.

Reductions fold in rank order 0, 1, 2, ... in the inputs' dtype (integers wrap).
``avg`` is the sum divided by the rank count: integers truncate toward zero (C,
as NCCL), floats round the quotient once to the dtype, complex divides real and
imaginary parts separately.

Algorithms may combine ranks in other orders, so with rounding floats they can
differ in the last bits; with integer-valued inputs whose partial sums are
exactly representable every algorithm's result is exactly equal to this oracle
(as values: min/max of 0.0 and -0.0 may give either zero, by the order).
"""

from __future__ import annotations

from collections.abc import Sequence

import ml_dtypes
import numpy as np

__all__ = [
    "allreduce",
    "reduce",
    "reduce_scatter",
    "allgather",
    "broadcast",
    "alltoall",
    "alltoallv",
    "sendrecv",
]

_OPS = ("sum", "prod", "min", "max", "avg")
_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_UFUNCS = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def _op_name(op: object) -> str:
    name = op.value if hasattr(op, "value") else op
    if isinstance(name, str) and name.lower() in _OPS:
        return name.lower()
    allowed = ", ".join(repr(o) for o in _OPS)
    raise ValueError(f"op={op!r} is not a reduction; allowed: {allowed} or a pycoll.ReduceOp")


def _check_inputs(inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    arrays = [np.asarray(x) for x in inputs]
    if not arrays:
        raise ValueError("inputs is empty; allowed: one 1-D array per rank (at least one rank)")
    for r, x in enumerate(arrays):
        if x.ndim != 1:
            raise ValueError(f"inputs[{r}] has ndim={x.ndim}; allowed: 1-D arrays")
        if x.dtype != arrays[0].dtype:
            raise TypeError(
                f"inputs[{r}].dtype={x.dtype.name} differs from inputs[0].dtype="
                f"{arrays[0].dtype.name}; all ranks must use the same dtype"
            )
    return arrays


def _check_rank(name: str, value: int, nranks: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name}={value!r} must be an int rank in [0, {nranks})")
    if not 0 <= value < nranks:
        raise ValueError(f"{name}={value!r} is out of range; allowed: 0..{nranks - 1}")
    return int(value)


def _combine(a: np.ndarray, b: np.ndarray, op: str) -> np.ndarray:
    ufunc = _UFUNCS[op]
    with np.errstate(all="ignore"):
        if a.dtype == _BFLOAT16:
            # The IEEE op rounded to bfloat16, stated without ml_dtypes' own loops:
            # float32 holds every bfloat16 exactly and rounding twice is innocuous.
            return ufunc(a.astype(np.float32), b.astype(np.float32)).astype(_BFLOAT16)
        return ufunc(a, b)


def _average(total: np.ndarray, n: int) -> np.ndarray:
    dt = total.dtype
    if dt.kind in "iu":
        # Python ints: exact, truncation toward zero written out.
        q = [abs(v) // n * (-1 if v < 0 else 1) for v in total.tolist()]
        return np.array(q, dtype=dt)
    with np.errstate(all="ignore"):
        if dt.kind == "c":
            out = np.empty_like(total)
            out.real = total.real.astype(np.float64) / n
            out.imag = total.imag.astype(np.float64) / n
            return out
        # float64 quotient rounded once to the dtype == the correctly rounded quotient
        return (total.astype(np.float64) / n).astype(dt)


def allreduce(inputs: Sequence[np.ndarray], op: object) -> np.ndarray:
    """What every rank ends with: inputs combined element-wise in rank order."""
    arrays = _check_inputs(inputs)
    name = _op_name(op)
    for r, x in enumerate(arrays):
        if x.shape != arrays[0].shape:
            raise ValueError(
                f"inputs[{r}] has length {x.shape[0]} but inputs[0] has {arrays[0].shape[0]}; "
                "all ranks must contribute the same number of elements"
            )
    if arrays[0].dtype.kind == "c" and name in ("min", "max"):
        raise ValueError(
            f"op={name!r} is not defined for {arrays[0].dtype.name}; "
            "allowed for complex: 'sum', 'prod', 'avg'"
        )
    total = arrays[0].copy()
    for x in arrays[1:]:
        total = _combine(total, x, name)
    if name == "avg":
        total = _average(total, len(arrays))
    return total


def reduce(inputs: Sequence[np.ndarray], op: object, root: int) -> np.ndarray:
    """Root's result of Reduce (the same values as AllReduce)."""
    _check_rank("root", root, len(_check_inputs(inputs)))
    return allreduce(inputs, op)


def _check_counts(name: str, counts: Sequence[int], nranks: int, total: int) -> list[int]:
    c = list(counts)
    if len(c) != nranks:
        raise ValueError(f"{name} has {len(c)} entries; allowed: one per rank ({nranks})")
    for r, v in enumerate(c):
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 0:
            raise ValueError(f"{name}[{r}]={v!r} is invalid; allowed: an int >= 0")
    if sum(c) != total:
        raise ValueError(f"{name}={c} sums to {sum(c)}; it must equal the input length {total}")
    return [int(v) for v in c]


def reduce_scatter(
    inputs: Sequence[np.ndarray], op: object, counts: Sequence[int] | None = None
) -> list[np.ndarray]:
    """Rank r's piece: elements [sum(counts[:r]), sum(counts[:r+1])) of the reduction."""
    total = allreduce(inputs, op)
    p = len(inputs)
    if counts is None:
        if total.shape[0] % p:
            raise ValueError(
                f"input length {total.shape[0]} does not divide by {p} ranks; pass counts"
            )
        counts = [total.shape[0] // p] * p
    c = _check_counts("counts", counts, p, total.shape[0])
    starts = np.concatenate(([0], np.cumsum(c, dtype=np.int64)))
    return [total[starts[r] : starts[r + 1]].copy() for r in range(p)]


def allgather(inputs: Sequence[np.ndarray]) -> np.ndarray:
    """Every rank's shard concatenated in rank order (shards may differ in length)."""
    arrays = _check_inputs(inputs)
    return np.concatenate(arrays)


def broadcast(inputs: Sequence[np.ndarray], root: int) -> np.ndarray:
    """What every rank ends with: the root's input."""
    arrays = _check_inputs(inputs)
    return arrays[_check_rank("root", root, len(arrays))].copy()


def alltoall(inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Rank j receives piece j of every rank's input (split into nranks equal pieces)."""
    arrays = _check_inputs(inputs)
    p = len(arrays)
    for r, x in enumerate(arrays):
        if x.shape[0] % p or x.shape != arrays[0].shape:
            raise ValueError(
                f"inputs[{r}] has length {x.shape[0]}; alltoall needs every rank to hold "
                f"the same length, divisible by {p} ranks (use alltoallv otherwise)"
            )
    k = arrays[0].shape[0] // p
    return [np.concatenate([x[j * k : (j + 1) * k] for x in arrays]) for j in range(p)]


def alltoallv(
    inputs: Sequence[np.ndarray], send_counts: Sequence[Sequence[int]]
) -> list[np.ndarray]:
    """Rank j receives, in source order i, the send_counts[i][j] elements i sends it.

    Rank i's pieces are taken from inputs[i] consecutively in destination order.
    """
    arrays = _check_inputs(inputs)
    p = len(arrays)
    if len(send_counts) != p:
        raise ValueError(f"send_counts has {len(send_counts)} rows; allowed: one per rank ({p})")
    pieces: list[list[np.ndarray]] = []
    for i, x in enumerate(arrays):
        c = _check_counts(f"send_counts[{i}]", send_counts[i], p, x.shape[0])
        starts = np.concatenate(([0], np.cumsum(c, dtype=np.int64)))
        pieces.append([x[starts[j] : starts[j + 1]] for j in range(p)])
    return [np.concatenate([pieces[i][j] for i in range(p)]) for j in range(p)]


def sendrecv(inputs: Sequence[np.ndarray], src: int, dst: int) -> np.ndarray:
    """What rank dst receives from rank src: inputs[src]."""
    arrays = _check_inputs(inputs)
    _check_rank("dst", dst, len(arrays))
    return arrays[_check_rank("src", src, len(arrays))].copy()
