"""Numba CUDA kernels: the reducer interface with ``@cuda.jit`` grid-stride kernels.

Kernels (one thread per element per grid stride; bytes per element as multiples of the
item size):

* ``reduce_inplace(dst, src)``: dst = dst op src (2 reads, 1 write);
* ``reduce_pair(dst, x, y)``: dst = x op y, the ``first=`` form (2 reads, 1 write);
* ``reduce_n(dst, srcs)``: dst = srcs[0] op ... op srcs[k-1], a tuple of arrays (k reads,
  1 write; compiled once per k);
* ``reduce_copy(dst, peer, x, y)``: dst = peer = x op y (2 reads, 2 writes);
* ``copy(dst, src)`` (1 read, 1 write), ``copy_pair(dst, peer, src)``: dst = peer = src
  (1 read, 2 writes), and ``divide(x, d)``, avg's finish (1 read, 1 write).

Element access is scalar: Numba has no portable 16-byte vector load, so the CUDA C path
(cuda_c.py) is the one with vectorized loads; here coalescing alone carries bandwidth.

Why the kernels are generated from source text (``kernel_source``), not closures over
``cuda.jit(device=True)`` op functions: numba-cuda 0.30 compiles a device function called
from a kernel for the *current device's* compute capability, so ``compile_ptx`` of such a
kernel needs a GPU; kernels with the op written inline compile to PTX anywhere, which the
tests rely on. The same holds for scalar ``.view`` (an overload); bit casts use libdevice.

Arithmetic matches the host reducer bit for bit:

* integers compute in int64/uint64 and are narrowed when stored (modular arithmetic
  commutes with the narrowing, so this is C's wrap-around);
* float32/float64 compute in their own type (Numba compiles without flush-to-zero);
* float16 and bfloat16 widen to float32, compute, and round once to nearest even, as numpy
  and ml_dtypes do (numba-cuda's own float16 operators and bfloat16 intrinsics are calls
  to linked C++ shims; these are plain instructions). bfloat16 travels as its uint16 bits
  (Numba has no bfloat16 arrays): widening is a 16-bit shift, rounding is done on the bits;
* min/max propagate NaN like numpy.minimum/maximum;
* avg divides the float64 value by nranks and rounds once (for bfloat16: round to odd
  into float32, then to nearest even, which is one correct rounding); integers truncate
  toward zero.

Under ``NUMBA_ENABLE_CUDASIM=1`` the same kernels run on numpy arrays on the CPU (the only
difference: the two bit casts use numpy views, since libdevice is stubs there), so every
dtype, bfloat16 included, is tested without a GPU. Numba is imported lazily.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import table
from .host import ReduceOp, check_op_for_dtype

__all__ = ["NumbaKernels", "python_kernel", "signature", "simulator_enabled"]

# Default grid cap. Scalar loads keep few bytes in flight per thread, so bandwidth needs
# every SM full of warps (an H200: 132 SMs of up to 2048 threads each).
BLOCKS_PER_SM = 32
# The simulator runs one Python thread per CUDA thread: its grid must stay tiny.
SIM_MAX_BLOCKS = 4

_BF16 = table.gpu_dtype("bfloat16").dtype
_F16 = np.dtype(np.float16)

# Per family: how an element becomes a compute value (LOAD) and back (STORE, with the
# storage dtype's numba name in {t}). Integers widen to 64 bits so that no mixed
# signed/unsigned arithmetic (which Numba types as float64) can occur.
_LOAD = {
    "float": "{x}",
    "float16": "nt.float32({x})",
    "signed": "nt.int64({x})",
    "unsigned": "nt.uint64({x})",
    # The bits are the top half of a float32's.
    "bfloat16": "_i2f(nt.int32(nt.uint32({x}) << 16))",
}
_STORE = {
    "float": "nt.{t}({x})",
    "float16": "nt.float16({x})",
    "signed": "nt.{t}({x})",
    "unsigned": "nt.{t}({x})",
    # Round to nearest even on the bits: add 0x7FFF plus the kept part's lowest bit, then
    # drop the low half; a NaN becomes the canonical quiet NaN. {x} is always a variable.
    "bfloat16": (
        "(nt.uint16((nt.uint32(_f2i({x})) + nt.uint32(0x7FFF)"
        " + ((nt.uint32(_f2i({x})) >> nt.uint32(16)) & nt.uint32(1))) >> nt.uint32(16))"
        " if {x} == {x} else nt.uint16(0x7FC0))"
    ),
}
# r = a op b on compute values; `a != a` is the NaN test (always False for integers).
_COMBINE = {
    ReduceOp.SUM: "r = a + b",
    ReduceOp.PROD: "r = a * b",
    ReduceOp.MIN: "r = a if (a != a or a < b) else b",
    ReduceOp.MAX: "r = a if (a != a or a > b) else b",
}
# avg's finish: d is float64 for float dtypes, int64 / uint64 for integers.
_DIVIDE = {
    "float": "r = nt.float64(a) / d",
    "float16": "r = nt.float64(a) / d",
    # float64 -> float32 rounded to odd, then (in STORE) to nearest even: one correct
    # rounding to bfloat16 overall, since float32 keeps 24 >= 8 + 2 bits.
    "bfloat16": """\
q = nt.float64(a) / d
        r = nt.float32(q)
        if nt.float64(r) != q:
            u = nt.uint32(_f2i(r))
            if (u & nt.uint32(1)) == 0:
                if abs(nt.float64(r)) > abs(q):
                    u = nt.uint32(u - nt.uint32(1))
                else:
                    u = nt.uint32(u + nt.uint32(1))
                r = _i2f(nt.int32(u))""",
    # Numba's // floors like Python's; step back toward zero for inexact negatives.
    "signed": "r = a // d\n        if a < 0 and a % d != 0:\n            r += 1",
    "unsigned": "r = a // d",
}

_LOOP = """\
    start = cuda.grid(1)
    stride = cuda.gridsize(1)
    for i in range(start, dst.size, stride):
"""

_TEMPLATES = {
    "reduce_inplace": "def reduce_inplace(dst, src):\n"
    + _LOOP
    + """\
        a = LOAD(dst[i])
        b = LOAD(src[i])
        COMBINE
        dst[i] = STORE(r)
""",
    "reduce_pair": "def reduce_pair(dst, x, y):\n"
    + _LOOP
    + """\
        a = LOAD(x[i])
        b = LOAD(y[i])
        COMBINE
        dst[i] = STORE(r)
""",
    "reduce_copy": "def reduce_copy(dst, peer, x, y):\n"
    + _LOOP
    + """\
        a = LOAD(x[i])
        b = LOAD(y[i])
        COMBINE
        v = STORE(r)
        dst[i] = v
        peer[i] = v
""",
    # srcs is a homogeneous tuple of arrays; the fold is left to right, as on the host.
    "reduce_n": "def reduce_n(dst, srcs):\n"
    + _LOOP
    + """\
        acc = LOAD(srcs[0][i])
        for j in range(1, len(srcs)):
            a = acc
            b = LOAD(srcs[j][i])
            COMBINE
            acc = ROUND(r)
        dst[i] = STORE(acc)
""",
    "copy": "def copy(dst, src):\n"
    + _LOOP
    + """\
        dst[i] = src[i]
""",
    "copy_pair": "def copy_pair(dst, peer, src):\n"
    + _LOOP
    + """\
        v = src[i]
        dst[i] = v
        peer[i] = v
""",
    "divide": "def divide(dst, d):\n"
    + _LOOP
    + """\
        a = LOAD(dst[i])
        DIVIDE
        dst[i] = STORE(r)
""",
}


def simulator_enabled() -> bool:
    """True when NUMBA_ENABLE_CUDASIM is set (it must be before numba.cuda is imported)."""
    from numba import config

    return bool(config.ENABLE_CUDASIM)


def _load_numpy_support() -> None:
    import numba.cuda.np.arrayobj  # noqa: F401


@functools.cache
def check_numba_cuda_loads() -> None:
    """numba-cuda 0.30 loads its numpy overloads at the first compile, and under numpy >= 2.5
    that fails (np.row_stack is gone; NVIDIA/numba-cuda#907, which its maintainers will not
    fix): say so when the kernels are made, not deep inside the first launch."""
    try:
        _load_numpy_support()
    except AttributeError as error:
        raise RuntimeError(
            f"the Numba kernels need numba-cuda's numpy support, which fails to load under "
            f"numpy {np.__version__} ({error}; NVIDIA/numba-cuda#907); allowed: "
            "PYCOLL_KERNELS=cupy (the CUDA C kernels), or numpy<2.5"
        ) from None
    except ImportError as error:  # an older numba-cuda: its modules lie elsewhere
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = f"numba-cuda {version('numba-cuda')}"
        except PackageNotFoundError:
            found = "no numba-cuda package (numba's own CUDA target?)"
        raise RuntimeError(
            f"the Numba kernels need numba-cuda's numpy support (numba-cuda >= 0.30), which "
            f"failed to import from {found} ({error}); allowed: PYCOLL_KERNELS=cupy (the CUDA "
            "C kernels), or pip install 'numba-cuda>=0.30'"
        ) from None


def _family(row: table.GpuDtype) -> str:
    if row.dtype in (_BF16, _F16):
        return row.dtype.name
    return row.kind


def _storage(row: table.GpuDtype) -> np.dtype:
    """The dtype Numba sees: bfloat16 travels as its uint16 bits."""
    return np.dtype(np.uint16) if row.dtype == _BF16 else row.dtype


def _expand(text: str, call: str, template: str, t: str) -> str:
    """Replace every ``call(arg)`` in text by template with {x}=arg, {t}=t.

    ``arg`` may hold parentheses; the inserted text is not expanded again.
    """
    out = []
    pos = 0
    while (start := text.find(call + "(", pos)) >= 0:
        depth, end = 0, start + len(call)
        for end in range(start + len(call), len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        arg = text[start + len(call) + 1 : end]
        out.append(text[pos:start] + template.format(x=arg, t=t))
        pos = end + 1
    return "".join(out) + text[pos:]


def kernel_source(kernel: str, dtype: object, op: ReduceOp | str | None = None) -> str:
    """The Python source of one kernel instance (what ``python_kernel`` compiles)."""
    if kernel not in _TEMPLATES:
        allowed = ", ".join(_TEMPLATES)
        raise ValueError(f"kernel={kernel!r} is unknown; allowed: {allowed}")
    row = table.gpu_dtype(dtype)
    fam = _family(row)
    text = _TEMPLATES[kernel]
    if "COMBINE" in text:
        if op is None:
            raise ValueError(f"kernel {kernel} needs an op")
        text = text.replace("COMBINE", _COMBINE[table.combine_op(op)])
    text = text.replace("DIVIDE", _DIVIDE[fam])
    t = _storage(row).name
    # ROUND(x) = LOAD(STORE(x)): each step of the fold rounds to the dtype, as on the host.
    text = _expand(text, "ROUND", "LOAD(" + _STORE[fam] + ")", t)
    text = _expand(text, "LOAD", _LOAD[fam], t)
    return _expand(text, "STORE", _STORE[fam], t)


def python_kernel(
    kernel: str, dtype: object, op: ReduceOp | str | None = None
) -> Callable[..., None]:
    """The plain Python function of one kernel instance, for ``cuda.jit`` or ``compile_ptx``."""
    row = table.gpu_dtype(dtype)
    return _python_kernel(kernel, row.dtype, None if op is None else table.combine_op(op))


@functools.cache
def _python_kernel(kernel: str, dtype: np.dtype, op: ReduceOp | None) -> Callable[..., None]:
    from numba import cuda
    from numba.cuda import types

    row = table.gpu_dtype(dtype)
    # nt.<type>(x) is a cast, in kernels and (as numpy scalars) under the simulator.
    namespace: dict[str, Any] = {"cuda": cuda, "nt": types}
    if simulator_enabled():  # libdevice is stubs there; numpy views do the same bit casts
        namespace["_i2f"] = lambda x: np.int32(x).view(np.float32)
        namespace["_f2i"] = lambda x: np.float32(x).view(np.int32)
    else:
        from numba.cuda import libdevice

        namespace["_i2f"] = libdevice.int_as_float
        namespace["_f2i"] = libdevice.float_as_int
    source = kernel_source(kernel, row.dtype, op)
    filename = f"<pycoll.kernels.numba_cuda {kernel} {row.name} {op.value if op else ''}>"
    exec(compile(source, filename, "exec"), namespace)  # our own template, see kernel_source
    return namespace[kernel]


def signature(kernel: str, dtype: object, nsources: int = 2) -> tuple[Any, ...]:
    """Numba argument types of one kernel for C-contiguous 1-D arrays of ``dtype``."""
    from numba.cuda import types

    row = table.gpu_dtype(dtype)
    arr = types.Array(getattr(types, _storage(row).name), 1, "C")
    divisor = {"float": types.float64, "signed": types.int64, "unsigned": types.uint64}[row.kind]
    return {
        "reduce_inplace": (arr, arr),
        "reduce_pair": (arr, arr, arr),
        "reduce_copy": (arr, arr, arr, arr),
        "reduce_n": (arr, types.UniTuple(arr, nsources)),
        "copy": (arr, arr),
        "copy_pair": (arr, arr, arr),
        "divide": (arr, divisor),
    }[kernel]


@functools.cache
def _jitted(kernel: str, dtype: np.dtype, op: ReduceOp | None) -> Any:
    from numba import cuda

    return cuda.jit(_python_kernel(kernel, dtype, op))


class NumbaKernels:
    """The reducer interface on Numba CUDA kernels, for CuPy arrays (or anything with
    ``__cuda_array_interface__``; numpy arrays under the simulator).

    ``stream``: a CuPy stream (anything with ``.ptr``) or a Numba stream to launch on;
    None launches on CuPy's current stream when CuPy is installed, else Numba's default
    stream. ``threads`` per block; ``max_blocks`` caps the grid (default: ``BLOCKS_PER_SM``
    per SM; ``SIM_MAX_BLOCKS`` under the simulator), the grid-stride loops cover the rest.
    """

    def __init__(
        self, stream: Any = None, threads: int = 256, max_blocks: int | None = None
    ) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 1024:
            raise ValueError(f"threads={threads!r} is invalid; allowed: an int in [1, 1024]")
        if max_blocks is not None and (
            isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 1
        ):
            raise ValueError(f"max_blocks={max_blocks!r} is invalid; allowed: None or an int >= 1")
        self._stream = stream
        self._threads = threads
        self._max_blocks = max_blocks
        self._sim = simulator_enabled()
        if not self._sim:  # the simulator has no numba.cuda.np
            check_numba_cuda_loads()
        self._reducers: dict[tuple[ReduceOp, np.dtype], Callable[..., None]] = {}

    # ------------------------------------------------------------------ launching

    def _grid(self, n: int) -> int:
        if self._max_blocks is None:
            if self._sim:
                self._max_blocks = SIM_MAX_BLOCKS
            else:
                from numba import cuda

                sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
                self._max_blocks = BLOCKS_PER_SM * sms
        return max(1, min(math.ceil(n / self._threads), self._max_blocks))

    def _launch_stream(self) -> Any:
        if self._sim:
            return 0
        from numba import cuda

        stream = self._stream
        if stream is None:
            try:
                import cupy
            except ImportError:
                return cuda.default_stream()
            stream = cupy.cuda.get_current_stream()
        ptr = getattr(stream, "ptr", None)
        if ptr is None:  # already a Numba stream
            return stream
        if ptr == 0:
            return cuda.default_stream()
        return _external_stream(ptr)

    def _launch(self, kernel: str, dtype: np.dtype, op: ReduceOp | None, n: int, *args: Any):
        if n == 0:
            return
        k = _jitted(kernel, dtype, op)
        if self._sim:
            # The simulator copies each top-level numpy argument in and back out, so an
            # output that aliases an input (dst is first) would be overwritten by the stale
            # input's copy-back; its no-copy wrapper shares the memory like device arrays do.
            from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

            args = tuple(FakeCUDAArray(a) if isinstance(a, np.ndarray) else a for a in args)
        k[self._grid(n), self._threads, self._launch_stream()](*args)

    def _array(self, x: Any, name: str, dtype: np.dtype, size: int | None) -> Any:
        """Check one array argument and return what the kernel takes."""
        if not hasattr(x, "__cuda_array_interface__") and not (
            self._sim and isinstance(x, np.ndarray)
        ):
            what = "numpy arrays" if self._sim else "CUDA arrays (__cuda_array_interface__)"
            raise TypeError(f"{name} must be one of {what}, got {type(x).__name__}")
        if x.dtype != dtype:
            raise TypeError(
                f"{name}.dtype={np.dtype(x.dtype).name} differs from {dtype.name}; "
                "every buffer of a reduction must have the same dtype"
            )
        if size is not None and x.size != size:
            raise ValueError(f"{name}.size={x.size} differs from {size}; sizes must match")
        if not _c_contiguous(x):
            raise ValueError(f"{name} must be C-contiguous")
        if dtype == _BF16:
            x = x.view(np.uint16)
        x = x.reshape(x.size)  # the kernels index 1-D; a view, since x is contiguous
        if self._sim or type(x).__module__.startswith("numba"):
            return x
        from numba import cuda

        # No stream sync on import: we launch on the stream the caller's work is on.
        return cuda.from_cuda_array_interface(x.__cuda_array_interface__, owner=x, sync=False)

    # ------------------------------------------------------------------ the interface

    def reducer(self, op: ReduceOp | str, dtype: object) -> Callable[..., None]:
        """``reduce(dst, src)``: dst = dst op src; ``reduce(dst, src, first)``: dst = first
        op src. AVG combines as SUM; call ``finish`` after the last piece."""
        op = ReduceOp.parse(op)
        row = table.gpu_dtype(dtype)
        key = (op, row.dtype)
        if key in self._reducers:
            return self._reducers[key]
        check_op_for_dtype(op, row.dtype)
        dt, cop = row.dtype, table.combine_op(op)

        def reduce(dst: Any, src: Any, first: Any = None) -> None:
            d = self._array(dst, "dst", dt, None)
            s = self._array(src, "src", dt, dst.size)
            if first is None:
                self._launch("reduce_inplace", dt, cop, dst.size, d, s)
            else:
                f = self._array(first, "first", dt, dst.size)
                self._launch("reduce_pair", dt, cop, dst.size, d, f, s)

        self._reducers[key] = reduce
        return reduce

    def reduce_n(self, dst: Any, sources: Sequence[Any], op: ReduceOp | str) -> None:
        """dst = sources[0] op sources[1] op ..., folded left to right; dst may be sources[0]."""
        op = ReduceOp.parse(op)
        if not isinstance(sources, Sequence) or len(sources) == 0:
            raise ValueError("sources must be a non-empty sequence of arrays")
        row = table.row_of(dst, "dst")
        check_op_for_dtype(op, row.dtype)
        d = self._array(dst, "dst", row.dtype, None)
        srcs = tuple(
            self._array(s, f"sources[{i}]", row.dtype, dst.size) for i, s in enumerate(sources)
        )
        self._launch("reduce_n", row.dtype, table.combine_op(op), dst.size, d, srcs)

    def reduce_copy(self, dst: Any, peer: Any, a: Any, b: Any, op: ReduceOp | str) -> None:
        """dst = peer = a op b in one pass (the ring's receive-reduce-send)."""
        op = ReduceOp.parse(op)
        row = table.row_of(dst, "dst")
        check_op_for_dtype(op, row.dtype)
        n = dst.size
        args = [
            self._array(x, name, row.dtype, n)
            for x, name in ((dst, "dst"), (peer, "peer"), (a, "a"), (b, "b"))
        ]
        self._launch("reduce_copy", row.dtype, table.combine_op(op), n, *args)

    def copy(self, dst: Any, src: Any) -> None:
        """dst = src."""
        row = table.row_of(dst, "dst")
        d = self._array(dst, "dst", row.dtype, None)
        s = self._array(src, "src", row.dtype, dst.size)
        self._launch("copy", row.dtype, None, dst.size, d, s)

    def copy_pair(self, dst: Any, peer: Any, src: Any) -> None:
        """dst = peer = src in one pass (the ring's receive-copy-send)."""
        row = table.row_of(dst, "dst")
        n = dst.size
        args = [self._array(x, name, row.dtype, n)
                for x, name in ((dst, "dst"), (peer, "peer"), (src, "src"))]
        self._launch("copy_pair", row.dtype, None, n, *args)

    def finish(self, work: Any, op: ReduceOp | str, nranks: int) -> None:
        """After the last reduce: AVG divides by nranks (floats round once, integers
        truncate toward zero); other ops do nothing."""
        op = ReduceOp.parse(op)
        nranks = table.check_nranks(nranks)
        row = table.row_of(work, "work")
        check_op_for_dtype(op, row.dtype)
        w = self._array(work, "work", row.dtype, None)
        if op is not ReduceOp.AVG or nranks == 1:
            return
        if row.kind == "float":
            d: Any = np.float64(nranks)
        elif row.kind == "signed":
            d = np.int64(nranks)
        else:
            d = np.uint64(nranks)
        self._launch("divide", row.dtype, None, work.size, w, d)


@functools.cache
def _external_stream(ptr: int) -> Any:
    from numba import cuda

    return cuda.external_stream(ptr)


def _c_contiguous(x: Any) -> bool:
    flags = getattr(x, "flags", None)
    if flags is None:
        return True
    try:
        return bool(flags["C_CONTIGUOUS"])
    except (KeyError, TypeError):
        return bool(getattr(flags, "c_contiguous", True))
