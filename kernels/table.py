"""The one dtype x op table the GPU kernels are generated from.

Pure Python (numpy and ml_dtypes only), so it imports anywhere. Everything dtype- or
op-specific downstream is derived from it: the CuPy ``name_expressions`` and nvcc explicit
instantiations of the CUDA C templates in ``reduce.cu`` (cuda_c.py, the tests), the Numba
kernels and their signatures (numba_cuda.py), and the test matrices.

The GPU supports every dtype of the host reducer except complex (no kernels for it:
complex device arrays reduce as their float (real, imaginary) pairs, sum and avg only; see
pycoll/spaces.py ``complex_as_real``), with all four combining ops; ``avg`` combines as
``sum`` and divides once, in ``finish``.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .host import ReduceOp

__all__ = [
    "GpuDtype",
    "Kernel",
    "GPU_DTYPES",
    "KERNELS",
    "OP_FUNCTORS",
    "MAX_SOURCES",
    "combine_op",
    "gpu_dtype",
    "name_expression",
    "instantiation",
    "instances",
    "all_name_expressions",
    "check_nranks",
    "row_of",
]

# Source pointers one reduce_n launch takes (kMaxSources in common.cuh).
MAX_SOURCES = 16


@dataclass(frozen=True)
class GpuDtype:
    """One row of the table: a numpy dtype and how the kernels see it."""

    dtype: np.dtype
    ctype: str  # CUDA C type, spelled as in the name expressions
    kind: str  # "float", "signed" or "unsigned": picks the numba arithmetic
    ops: tuple[ReduceOp, ...]  # combining ops (avg combines as sum)

    @property
    def name(self) -> str:
        return self.dtype.name


_COMBINING = (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX)

GPU_DTYPES: tuple[GpuDtype, ...] = (
    GpuDtype(np.dtype(np.float16), "__half", "float", _COMBINING),
    GpuDtype(np.dtype(ml_dtypes.bfloat16), "__nv_bfloat16", "float", _COMBINING),
    GpuDtype(np.dtype(np.float32), "float", "float", _COMBINING),
    GpuDtype(np.dtype(np.float64), "double", "float", _COMBINING),
    GpuDtype(np.dtype(np.int8), "signed char", "signed", _COMBINING),
    GpuDtype(np.dtype(np.int16), "short", "signed", _COMBINING),
    GpuDtype(np.dtype(np.int32), "int", "signed", _COMBINING),
    GpuDtype(np.dtype(np.int64), "long long", "signed", _COMBINING),
    GpuDtype(np.dtype(np.uint8), "unsigned char", "unsigned", _COMBINING),
    GpuDtype(np.dtype(np.uint16), "unsigned short", "unsigned", _COMBINING),
    GpuDtype(np.dtype(np.uint32), "unsigned int", "unsigned", _COMBINING),
    GpuDtype(np.dtype(np.uint64), "unsigned long long", "unsigned", _COMBINING),
)

_BY_DTYPE = {row.dtype: row for row in GPU_DTYPES}
_ALLOWED = ", ".join(row.name for row in GPU_DTYPES)

# The CUDA C functor for each op (common.cuh); AVG reduces with Sum.
OP_FUNCTORS: dict[ReduceOp, str] = {
    ReduceOp.SUM: "pycoll::Sum",
    ReduceOp.PROD: "pycoll::Prod",
    ReduceOp.MIN: "pycoll::Min",
    ReduceOp.MAX: "pycoll::Max",
}


@dataclass(frozen=True)
class Kernel:
    """A kernel template of reduce.cu: its name, whether it takes an op, its C parameters."""

    name: str
    has_op: bool
    params: str  # parameter types with T for the element type

    def template_args(self, row: GpuDtype, op: ReduceOp | None) -> str:
        if not self.has_op:
            return row.ctype
        if op is None:
            raise ValueError(f"kernel {self.name} needs an op")
        return f"{row.ctype}, {OP_FUNCTORS[combine_op(op)]}"


KERNELS: tuple[Kernel, ...] = (
    Kernel("reduce_inplace", True, "T*, const T*, long long"),
    Kernel("reduce_pair", True, "T*, const T*, const T*, long long"),
    Kernel("reduce_n", True, "T*, pycoll::Sources<T>, int, long long"),
    Kernel("reduce_copy", True, "T*, T*, const T*, const T*, long long"),
    Kernel("copy", False, "T*, const T*, long long"),
    Kernel("copy_pair", False, "T*, T*, const T*, long long"),
    Kernel("divide", False, "T*, long long, long long"),
)
_KERNELS_BY_NAME = {k.name: k for k in KERNELS}


def combine_op(op: ReduceOp) -> ReduceOp:
    """The op the kernels combine with: AVG combines as SUM (finish divides)."""
    op = ReduceOp.parse(op)
    return ReduceOp.SUM if op is ReduceOp.AVG else op


def gpu_dtype(dtype: object) -> GpuDtype:
    """The table row for ``dtype``; TypeError if the GPU kernels do not support it."""
    try:
        dt = np.dtype(dtype)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise TypeError(f"dtype={dtype!r} is not a dtype; allowed: {_ALLOWED}") from None
    row = _BY_DTYPE.get(dt) if dtype is not None else None
    if row is None:
        raise TypeError(
            f"dtype={str(dt) if dtype is not None else None!r} has no GPU kernels; "
            f"allowed: {_ALLOWED}"
        )
    return row


def _kernel(name: str) -> Kernel:
    try:
        return _KERNELS_BY_NAME[name]
    except KeyError:
        allowed = ", ".join(_KERNELS_BY_NAME)
        raise ValueError(f"kernel={name!r} is unknown; allowed: {allowed}") from None


def name_expression(kernel: str, dtype: object, op: ReduceOp | None = None) -> str:
    """The C++ name of one instance, e.g. ``pycoll::reduce_pair<float, pycoll::Sum>``.

    The exact string CuPy's RawModule takes in ``name_expressions`` and ``get_function``.
    """
    k = _kernel(kernel)
    return f"pycoll::{k.name}<{k.template_args(gpu_dtype(dtype), op)}>"


def instantiation(kernel: str, dtype: object, op: ReduceOp | None = None) -> str:
    """An explicit instantiation definition of one instance, for nvcc."""
    k = _kernel(kernel)
    row = gpu_dtype(dtype)
    params = k.params.replace("T", row.ctype)
    return f"template __global__ void {name_expression(kernel, row.dtype, op)}({params});"


def instances(dtype: object | None = None) -> list[tuple[str, np.dtype, ReduceOp | None]]:
    """Every (kernel, dtype, op) instance, optionally for one dtype; AVG shares SUM's."""
    rows = GPU_DTYPES if dtype is None else (gpu_dtype(dtype),)
    out: list[tuple[str, np.dtype, ReduceOp | None]] = []
    for row in rows:
        for k in KERNELS:
            if k.has_op:
                out.extend((k.name, row.dtype, op) for op in row.ops)
            else:
                out.append((k.name, row.dtype, None))
    return out


def all_name_expressions(dtype: object | None = None) -> list[str]:
    """Name expressions of every instance (optionally one dtype's), in table order."""
    return [name_expression(k, dt, op) for k, dt, op in instances(dtype)]


_INT64_MAX = int(np.iinfo(np.int64).max)


def check_nranks(nranks: object) -> int:
    """``nranks`` as an int in [1, 2**63 - 1] (the kernels take it as a 64-bit integer)."""
    if isinstance(nranks, bool) or not isinstance(nranks, int | np.integer):
        raise TypeError(f"nranks={nranks!r} must be an int >= 1")
    if not 1 <= nranks <= _INT64_MAX:
        raise ValueError(f"nranks={nranks!r} is invalid; allowed: an int in [1, 2**63 - 1]")
    return int(nranks)


def row_of(array: object, name: str) -> GpuDtype:
    """The table row for an array argument's dtype; TypeError naming ``name`` otherwise."""
    dtype = getattr(array, "dtype", None)
    if dtype is None:
        raise TypeError(f"{name} must be an array, got {type(array).__name__}")
    try:
        return gpu_dtype(dtype)
    except TypeError as e:
        raise TypeError(f"{name}: {e}") from None
