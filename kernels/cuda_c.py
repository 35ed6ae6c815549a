"""CUDA C kernels (``reduce.cu`` + ``common.cuh``) through CuPy: the reducer interface.

The kernels, all grid-stride loops over n elements (traffic per element in item sizes):

* ``reduce_inplace``: dst = dst op src (2 reads + 1 write), ``reduce(dst, src)``;
* ``reduce_pair``: dst = a op b (2 + 1), ``reduce(dst, src, first=a)``, which seeds dst in
  the same pass instead of copying ``first`` first;
* ``reduce_n``: dst = s0 op ... op s(k-1) (k + 1), the direct schedules' reduce; up to 16
  sources per launch, more are chained;
* ``reduce_copy``: dst = peer = a op b (2 + 2), the ring's receive-reduce-send, writing the
  reduced chunk locally and into the next rank's (IPC-mapped) buffer in one pass;
* ``copy`` (1 + 1), ``copy_pair``: dst = peer = src (1 + 2), the ring's receive-copy-send,
  and ``divide``, avg's finish (1 + 1).

Vectorized access: each thread moves 16 bytes per load or store (``uint4``, i.e. 8 float16
or 4 float32 lanes), the widest access a thread can issue; for narrow dtypes that cuts
the instructions per byte 4-16x, which memory-bound kernels need to reach full bandwidth.
A 16-byte access must be 16-byte aligned (otherwise the kernel faults with a sticky
cudaErrorMisalignedAddress), so each kernel checks its pointers: when all of them sit at
the same offset modulo 16, a scalar head brings them to a 16-byte boundary together, the
body runs in vectors, and a scalar tail finishes the last n mod lanes elements; when the
offsets differ (say, a slice at an odd element offset against an aligned buffer), the
whole range runs scalar. CuPy allocations are 256-byte aligned, so whole arrays always
vectorize.

Compilation: one ``cupy.RawModule`` per dtype, built lazily on first use with that dtype's
``name_expressions`` from the table (about 0.5 s with NVRTC; CuPy caches the binary on disk,
so later processes skip it). The source handed to NVRTC is reduce.cu with common.cuh
inlined, so CuPy's cache key (which hashes the source, not included files) sees every edit.
CuPy is imported lazily: this module imports without it.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import table
from .host import ReduceOp, check_op_for_dtype

__all__ = ["CudaCKernels", "OPTIONS", "KERNEL_DIR", "source", "module", "nvrtc_compile"]

KERNEL_DIR = Path(__file__).resolve().parent
# CuPy adds -ftz=true itself; common.cuh's float32 helpers are written to be immune to it.
OPTIONS: tuple[str, ...] = ("--std=c++17",)
THREADS = 256
# Grid cap, as the Numba kernels': blocks past what an SM holds wait their turn, so a large
# cap costs nothing and keeps every SM full of warps (bandwidth needs bytes in flight).
BLOCKS_PER_SM = 32

# reduce_n's pointer pack: struct Sources<T> { const T* ptr[16]; }, passed by value.
_SOURCES_DTYPE = np.dtype([("ptr", np.uint64, (table.MAX_SOURCES,))])


@functools.cache
def source() -> str:
    """reduce.cu with common.cuh inlined: the text NVRTC compiles."""
    header = (KERNEL_DIR / "common.cuh").read_text()
    body = (KERNEL_DIR / "reduce.cu").read_text()
    include = '#include "common.cuh"'
    if include not in body:
        raise RuntimeError(f"{KERNEL_DIR / 'reduce.cu'} no longer includes common.cuh")
    return body.replace(include, header, 1)


@functools.cache
def module(dtype: object) -> Any:
    """The ``cupy.RawModule`` holding every kernel instance for ``dtype`` (built once)."""
    import cupy

    row = table.gpu_dtype(dtype)
    return cupy.RawModule(
        code=source(), options=OPTIONS, name_expressions=table.all_name_expressions(row.dtype)
    )


@functools.cache
def _function(kernel: str, dtype: np.dtype, op: ReduceOp | None) -> Any:
    return module(dtype).get_function(table.name_expression(kernel, dtype, op))


def nvrtc_compile(
    arch: str = "sm_90", dtype: object | None = None, extra_options: Sequence[str] = ()
) -> tuple[bytes, dict[str, str], str]:
    """Compile the kernels with NVRTC, as RawModule would, with no GPU needed.

    Returns (cubin, {name expression: lowered name}, binding) for ``arch`` (e.g. "sm_90"),
    for every instance or one dtype's. RawModule itself cannot do this without a device (it
    asks the current device for the architecture), so this drives NVRTC directly with
    RawModule's options: ours, the CUDA headers, and what CuPy adds (-ftz=true,
    --device-as-default-execution-space). The binding is CuPy's when CuPy is installed,
    else cuda-bindings' (which numba-cuda[cu13] installs, NVRTC wheel included); ``binding``
    says which. For CI and tests.
    """
    if not arch.startswith("sm_") or not arch[3:].isdigit():
        raise ValueError(f"arch={arch!r} is invalid; allowed: 'sm_<digits>', e.g. 'sm_90'")
    names = table.all_name_expressions(dtype)
    tail = (f"-arch={arch}", "-ftz=true", "--device-as-default-execution-space", *extra_options)
    try:
        from cupy._core.core import assemble_cupy_compiler_options
    except ImportError:
        options = (*OPTIONS, f"-I{_cuda_include_dir()}", *tail)
        return (*_nvrtc_cuda_bindings(names, options), "cuda-bindings")
    options = (*assemble_cupy_compiler_options(OPTIONS), *tail)
    return (*_nvrtc_cupy(names, options), "cupy")


def _nvrtc_cupy(names: list[str], options: tuple[str, ...]) -> tuple[bytes, dict[str, str]]:
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source(), "reduce.cu", (), ())
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed: {e}\n{nvrtc.getProgramLog(prog)}") from None
        lowered = {name: nvrtc.getLoweredName(prog, name) for name in names}
        return nvrtc.getCUBIN(prog), lowered
    finally:
        nvrtc.destroyProgram(prog)


def _nvrtc_cuda_bindings(
    names: list[str], options: tuple[str, ...]
) -> tuple[bytes, dict[str, str]]:
    from cuda.bindings import nvrtc

    def check(result: Any) -> Any:
        err, *rest = result
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC failed: {err!r}")
        return rest[0] if len(rest) == 1 else rest

    prog = check(nvrtc.nvrtcCreateProgram(source().encode(), b"reduce.cu", 0, [], []))
    try:
        for name in names:
            check(nvrtc.nvrtcAddNameExpression(prog, name.encode()))
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            log = b" " * check(nvrtc.nvrtcGetProgramLogSize(prog))
            check(nvrtc.nvrtcGetProgramLog(prog, log))
            raise RuntimeError(f"NVRTC failed: {err!r}\n{log.decode(errors='replace')}")
        lowered = {
            name: check(nvrtc.nvrtcGetLoweredName(prog, name.encode())).decode() for name in names
        }
        cubin = b" " * check(nvrtc.nvrtcGetCUBINSize(prog))
        check(nvrtc.nvrtcGetCUBIN(prog, cubin))
        return cubin, lowered
    finally:
        check(nvrtc.nvrtcDestroyProgram(prog))


def _cuda_include_dir() -> str:
    """Where cuda_fp16.h lives: cuda-pathfinder (the pip CUDA wheels), else $CUDA_PATH."""
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cudart")
    except ImportError:
        found = None
    for candidate in (found, os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if candidate is None:
            continue
        for inc in (Path(candidate), Path(candidate) / "include"):
            if (inc / "cuda_fp16.h").exists():
                return str(inc)
    raise RuntimeError("CUDA headers (cuda_fp16.h) not found; set CUDA_PATH")


@functools.cache
def _cupy() -> Any:
    """The cupy module, or None without CuPy (then no argument can be a CuPy array)."""
    try:
        import cupy
    except ImportError:
        return None
    return cupy


@functools.cache
def _sm_count(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


class CudaCKernels:
    """The reducer interface on the CUDA C kernels, for C-contiguous CuPy arrays.

    ``stream``: the CuPy stream to launch on; None means CuPy's current stream at each
    call. ``threads`` per block; the grid is enough blocks for one pass (counting 16-byte
    vectors), capped at ``blocks_per_sm`` per SM, the grid-stride loops doing the rest.
    """

    def __init__(
        self, stream: Any = None, threads: int = THREADS, blocks_per_sm: int = BLOCKS_PER_SM
    ) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 1024:
            raise ValueError(f"threads={threads!r} is invalid; allowed: an int in [1, 1024]")
        if isinstance(blocks_per_sm, bool) or not isinstance(blocks_per_sm, int):
            raise ValueError(f"blocks_per_sm={blocks_per_sm!r} is invalid; allowed: an int >= 1")
        if blocks_per_sm < 1:
            raise ValueError(f"blocks_per_sm={blocks_per_sm!r} is invalid; allowed: an int >= 1")
        self._stream = stream
        self._threads = threads
        self._blocks_per_sm = blocks_per_sm
        self._reducers: dict[tuple[ReduceOp, np.dtype], Callable[..., None]] = {}

    # ------------------------------------------------------------------ launching

    def _launch(
        self, kernel: str, dtype: np.dtype, op: ReduceOp | None, n: int, args: tuple
    ) -> None:
        if n == 0:
            return
        lanes = 16 // dtype.itemsize
        cap = self._blocks_per_sm * self._sms()
        blocks = max(1, min(math.ceil(n / (self._threads * lanes)), cap))
        self._run(kernel, dtype, op, blocks, args)

    # The three methods below are all that touch CuPy and the GPU: the tests' host build of
    # these kernels (tests/test_kernels_cuda.py, HostCudaCKernels) replaces them.
    def _sms(self) -> int:
        import cupy

        return _sm_count(cupy.cuda.runtime.getDevice())

    def _run(
        self, kernel: str, dtype: np.dtype, op: ReduceOp | None, blocks: int, args: tuple
    ) -> None:
        _function(kernel, dtype, op)((blocks,), (self._threads,), args, stream=self._stream)

    def _check_type(self, x: Any, name: str) -> None:
        cupy = _cupy()
        if cupy is None or not isinstance(x, cupy.ndarray):
            hint = "" if cupy is not None else " (CuPy is not installed)"
            raise TypeError(f"{name} must be a cupy.ndarray, got {type(x).__name__}{hint}")

    @staticmethod
    def _ptr(x: Any) -> int:
        return int(x.data.ptr)

    def _array(self, x: Any, name: str, dtype: np.dtype, size: int | None) -> Any:
        self._check_type(x, name)
        if x.dtype != dtype:
            raise TypeError(
                f"{name}.dtype={x.dtype.name} differs from {dtype.name}; "
                "every buffer of a reduction must have the same dtype"
            )
        if size is not None and x.size != size:
            raise ValueError(f"{name}.size={x.size} differs from {size}; sizes must match")
        if not x.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")
        return x

    # ------------------------------------------------------------------ the interface

    def reducer(self, op: ReduceOp | str, dtype: object) -> Callable[..., None]:
        """``reduce(dst, src)``: dst = dst op src; ``reduce(dst, src, first)``: dst = first
        op src, in one pass. AVG combines as SUM; call ``finish`` after the last piece."""
        op = ReduceOp.parse(op)
        row = table.gpu_dtype(dtype)
        key = (op, row.dtype)
        if key in self._reducers:
            return self._reducers[key]
        check_op_for_dtype(op, row.dtype)
        dt, cop = row.dtype, table.combine_op(op)

        def reduce(dst: Any, src: Any, first: Any = None) -> None:
            self._array(dst, "dst", dt, None)
            n = dst.size
            self._array(src, "src", dt, n)
            if first is None:
                self._launch("reduce_inplace", dt, cop, n, (dst, src, np.int64(n)))
            else:
                self._array(first, "first", dt, n)
                self._launch("reduce_pair", dt, cop, n, (dst, first, src, np.int64(n)))

        self._reducers[key] = reduce
        return reduce

    def reduce_n(self, dst: Any, sources: Sequence[Any], op: ReduceOp | str) -> None:
        """dst = sources[0] op sources[1] op ..., folded left to right (the host's order).

        dst may be sources[0]; beyond 16 sources the launches chain through dst, so there
        dst must not be any later source.
        """
        op = ReduceOp.parse(op)
        if not isinstance(sources, Sequence) or len(sources) == 0:
            raise ValueError("sources must be a non-empty sequence of cupy arrays")
        row = table.row_of(dst, "dst")
        check_op_for_dtype(op, row.dtype)
        self._array(dst, "dst", row.dtype, None)
        n = dst.size
        for i, s in enumerate(sources):
            self._array(s, f"sources[{i}]", row.dtype, n)
        m = table.MAX_SOURCES
        # Empty arrays all have pointer 0 in CuPy: they alias nothing.
        if n and len(sources) > m and any(self._ptr(s) == self._ptr(dst) for s in sources[1:]):
            raise ValueError(
                f"dst is one of sources[1:] with {len(sources)} sources; with more than {m} "
                "sources (chained launches) dst may only be sources[0] or a separate buffer"
            )
        cop = table.combine_op(op)
        chunk, rest = list(sources[:m]), list(sources[m:])
        while True:
            pack = np.zeros(1, dtype=_SOURCES_DTYPE)
            pack["ptr"][0, : len(chunk)] = [self._ptr(s) for s in chunk]
            self._launch(
                "reduce_n", row.dtype, cop, n, (dst, pack, np.int32(len(chunk)), np.int64(n))
            )
            if not rest:
                return
            # dst now holds the fold so far: it leads the next chunk.
            chunk, rest = [dst, *rest[: m - 1]], rest[m - 1 :]

    def reduce_copy(self, dst: Any, peer: Any, a: Any, b: Any, op: ReduceOp | str) -> None:
        """dst = peer = a op b in one pass (the ring's receive-reduce-send)."""
        op = ReduceOp.parse(op)
        row = table.row_of(dst, "dst")
        check_op_for_dtype(op, row.dtype)
        self._array(dst, "dst", row.dtype, None)
        n = dst.size
        for x, name in ((peer, "peer"), (a, "a"), (b, "b")):
            self._array(x, name, row.dtype, n)
        self._launch(
            "reduce_copy", row.dtype, table.combine_op(op), n, (dst, peer, a, b, np.int64(n))
        )

    def copy(self, dst: Any, src: Any) -> None:
        """dst = src."""
        row = table.row_of(dst, "dst")
        self._array(dst, "dst", row.dtype, None)
        self._array(src, "src", row.dtype, dst.size)
        self._launch("copy", row.dtype, None, dst.size, (dst, src, np.int64(dst.size)))

    def copy_pair(self, dst: Any, peer: Any, src: Any) -> None:
        """dst = peer = src in one pass (the ring's receive-copy-send)."""
        row = table.row_of(dst, "dst")
        self._array(dst, "dst", row.dtype, None)
        n = dst.size
        for x, name in ((peer, "peer"), (src, "src")):
            self._array(x, name, row.dtype, n)
        self._launch("copy_pair", row.dtype, None, n, (dst, peer, src, np.int64(n)))

    def finish(self, work: Any, op: ReduceOp | str, nranks: int) -> None:
        """After the last reduce: AVG divides by nranks (floats: the float64 quotient rounded
        once; integers: truncation toward zero); other ops do nothing."""
        op = ReduceOp.parse(op)
        nranks = table.check_nranks(nranks)
        row = table.row_of(work, "work")
        check_op_for_dtype(op, row.dtype)
        self._array(work, "work", row.dtype, None)
        if op is not ReduceOp.AVG or nranks == 1:
            return
        n = work.size
        self._launch("divide", row.dtype, None, n, (work, np.int64(n), np.int64(nranks)))
