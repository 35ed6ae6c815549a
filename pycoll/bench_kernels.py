"""`pycoll bench kernels`: the GPU reduction kernels' achieved bandwidth.

Each kernel's bandwidth counts the bytes it reads plus the bytes it writes, per element:

| kernel | what | bytes per element |
|---|---|---|
| copy (device memcpy) | dst = src | 2 |
| cupy add | cupy.add(a, b, out=c), CuPy's own elementwise kernel | 3 |
| reduce | dst = dst op src | 3 |
| reduce_pair | dst = a op b (the fused seed) | 3 |
| reduce_n (k=4) | dst = s0 op s1 op s2 op s3 | 5 |
| reduce_copy | dst = peer = a op b | 4 |
| copy_pair | dst = peer = src, as unsigned words (the ring's receive-copy-send) | 3 |

and is reported against the device-to-device copy bandwidth measured in the same run (the
roofline for a streaming kernel) and against CuPy's add at the same size and dtype. Times are
CUDA-event times, the median of several repeats of a batch of launches.

So that the numbers are HBM bandwidth, not the host's launch rate or the L2's bandwidth:

* a spin kernel keeps the GPU busy, untimed, while the host queues each batch (``_timer``);
* when one call's buffers would fit in twice the L2, the launches rotate among enough sets
  of buffers that together exceed twice the L2, so a set's buffers have left the L2 when it
  comes round again (``buffer_sets``); every kernel and both baselines rotate alike.

Rows are handed over as they are measured (``run``'s ``on_row``; the CLI prints each and
rewrites the JSON file), so a run killed by a time limit keeps what finished. A kernel that
fails (to compile, say) gives a row with ``error`` set, and the others still run.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import statistics
import sys
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np

from pycoll.kernels import ReduceOp, table
from pycoll.spaces import as_words

KERNELS = ("reduce", "reduce_pair", "reduce_n", "reduce_copy", "copy_pair")
SOURCES = 4  # reduce_n's k
BYTES_PER_ELEMENT = {"copy": 2, "cupy_add": 3, "reduce": 3, "reduce_pair": 3,
                     "reduce_n": SOURCES + 1, "reduce_copy": 4, "copy_pair": 3}
BUFFERS_PER_SET = SOURCES + 1  # reduce_n's sources and dst; the other calls use a subset
# The rotated sets together exceed this many L2s: then more than one L2 of other buffers
# is touched between two uses of a set, whatever the size.
L2_MULTIPLE = 2
# Below about 1 MiB per operand the count would grow without bound (and launches dominate).
MAX_BUFFER_SETS = 64
BATCH = 10  # launches per timed batch (-n)
WARMUP = 1  # untimed launches before timing a kernel (-w); the first compiles

# Busy-waits `cycles` GPU clocks; clock64() is volatile, so the loop is kept.
SPIN_SOURCE = r"""
extern "C" __global__ void pycoll_spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
}
"""
SPIN_CYCLES_PER_LAUNCH = 100_000  # about 50 us at 2 GHz; a Numba launch costs tens of us
SPIN_MIN_CYCLES = 4_000_000  # about 2 ms
SPIN_MAX_CYCLES = 1 << 28  # about 0.15 s: the doubling in _timer stops here


@dataclasses.dataclass
class KernelRow:
    size: int  # bytes of one operand
    dtype: str
    kernel: str
    backend: str
    time_us: float  # NaN when error is set
    bandwidth: float  # GB/s of bytes read plus written; NaN when error is set
    of_copy: float | None  # fraction of the measured copy bandwidth
    vs_cupy_add: float | None  # cupy add time / this time (above 1: faster than CuPy)
    error: str | None = None  # why this kernel could not be measured


def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, or no device: all mean "no GPU here"
        return False


def buffer_sets(call_bytes: int, l2_bytes: int, max_sets: int = MAX_BUFFER_SETS) -> int:
    """How many buffer sets to rotate among, for calls that each touch ``call_bytes``.

    The fewest sets whose calls together touch more than ``L2_MULTIPLE`` L2s, so a set is
    out of L2 when it comes round again; 1 when one call alone does; at most ``max_sets``.
    """
    if call_bytes < 1 or l2_bytes < 0 or max_sets < 1:
        raise ValueError(f"call_bytes={call_bytes}, l2_bytes={l2_bytes}, max_sets={max_sets}; "
                         "allowed: call_bytes >= 1, l2_bytes >= 0, max_sets >= 1")
    return min(max_sets, L2_MULTIPLE * l2_bytes // call_bytes + 1)


class _Spin:
    """The spin kernel of ``_timer``, and how long it spins (doubled when too short)."""

    def __init__(self, cupy: Any, batch: int) -> None:
        self._kernel = cupy.RawKernel(SPIN_SOURCE, "pycoll_spin")
        self.cycles = max(SPIN_MIN_CYCLES, batch * SPIN_CYCLES_PER_LAUNCH)
        self(0)  # compile now: a failure is reported before any row

    def __call__(self, cycles: int | None = None) -> None:
        self._kernel((1,), (1,), (np.int64(self.cycles if cycles is None else cycles),))

    def lengthen(self) -> bool:
        """Double the spin; False when it is already at its cap."""
        if self.cycles >= SPIN_MAX_CYCLES:
            return False
        self.cycles = min(2 * self.cycles, SPIN_MAX_CYCLES)
        return True


def _timer(cupy: Any, call: Callable[[], None], repeats: int, batch: int, spin: _Spin,
           warmup: int = WARMUP) -> float:
    """Median over ``repeats`` of the mean time of ``batch`` back-to-back launches (s), after
    ``warmup`` untimed launches (the first compiles)."""
    for _ in range(warmup):
        call()
    cupy.cuda.get_current_stream().synchronize()
    samples: list[float] = []
    while len(samples) < repeats:
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        # The untimed spin holds the GPU while the host queues the whole batch behind
        # `start`, so the events time the kernels back to back, not the host's launch rate.
        spin()
        start.record()
        for _ in range(batch):
            call()
        stop.record()
        spun_out = start.done  # the GPU got to start before the batch was all queued
        stop.synchronize()
        if spun_out and spin.lengthen():
            continue
        samples.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3 / batch)
    return statistics.median(samples)


def run(sizes: list[int], dtypes: list[str], backends: list[str], op: str = "sum",
        repeats: int = 5, batch: int = BATCH, warmup: int = WARMUP,
        on_row: Callable[[KernelRow], None] | None = None) -> list[KernelRow]:
    """Measure every kernel of every backend at every size (bytes per operand) and dtype:
    the median of ``repeats`` timings of ``batch`` launches, after ``warmup`` untimed ones.

    ``on_row`` is called with each row as soon as it is measured; all rows are returned.
    """
    from pycoll.kernels.device import kernel_backend

    # Refuse a bad op, dtype, backend or count before measuring anything.
    if repeats < 1 or batch < 1 or warmup < 0:
        raise ValueError(f"-n={batch} (launches per timed batch), -w={warmup} (launches before "
                         f"timing), repeats={repeats}; allowed: -n >= 1, -w >= 0, repeats >= 1")
    reduce_op = ReduceOp.parse(op)
    checked = [table.gpu_dtype(name).dtype for name in dtypes]
    backends = [kernel_backend(b) for b in backends]
    if not gpu_available():
        raise RuntimeError("no CUDA GPU with CuPy found; it measures a GPU's kernels")
    import cupy

    rows: list[KernelRow] = []

    def emit(row: KernelRow) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(row)

    try:
        spin = _Spin(cupy, batch)
    except Exception as error:  # NVRTC or the CUDA headers missing: CuPy compiles nothing
        raise RuntimeError(f"the timing spin kernel failed: {type(error).__name__}: {error}"
                           ) from error
    l2_bytes = _l2_bytes(cupy)
    for dtype in checked:
        for size in sizes:
            n = max(size // dtype.itemsize, 1)
            try:
                _measure(cupy, dtype, n, backends, reduce_op, repeats, batch, spin, l2_bytes,
                         emit, warmup)
            except Exception as error:  # the buffers or the copy baseline (out of memory, a
                # fill CuPy refuses): that size's copy row says so, and the other sizes still run
                emit(KernelRow(n * dtype.itemsize, dtype.name, "copy", "cuda", math.nan,
                               math.nan, None, None, f"{type(error).__name__}: {error}"))
            cupy.get_default_memory_pool().free_all_blocks()
    return rows


def _l2_bytes(cupy: Any) -> int:
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    return int(props["l2CacheSize"])


def _measure(cupy: Any, dtype: np.dtype, n: int, backends: list[str], op: ReduceOp,
             repeats: int, batch: int, spin: _Spin, l2_bytes: int,
             emit: Callable[[KernelRow], None], warmup: int = WARMUP) -> None:
    from pycoll.kernels.device import gpu_kernels

    nbytes = n * dtype.itemsize
    # Sized by the copy, the call touching least (2 buffers), so every call rotates alike.
    count = buffer_sets(2 * nbytes, l2_bytes)
    sets = [[cupy.ones(n, dtype) for _ in range(BUFFERS_PER_SET)] for _ in range(count)]
    rotation = itertools.cycle(sets)
    stream_ptr = cupy.cuda.get_current_stream().ptr

    def timed(kernel: Callable[..., None]) -> float:
        # Each launch takes the next set: (a, b, c, s2, s3), dst c.
        return _timer(cupy, lambda: kernel(*next(rotation)), repeats, batch, spin, warmup)

    def copy(a: Any, b: Any, c: Any, *extra: Any) -> None:
        cupy.cuda.runtime.memcpyAsync(c.data.ptr, a.data.ptr, nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToDevice, stream_ptr)

    copy_time = timed(copy)
    copy_bw = 2 * nbytes / copy_time / 1e9
    emit(KernelRow(nbytes, dtype.name, "copy", "cuda", copy_time * 1e6, copy_bw, 1.0, None))
    try:
        add_time: float | None = timed(lambda a, b, c, *extra: cupy.add(a, b, out=c))
    except Exception:  # CuPy's add may not take this dtype (bfloat16): no baseline then
        add_time = None
    if add_time is not None:
        emit(_row(nbytes, dtype, "cupy_add", "cupy", add_time, copy_bw, add_time))
    for backend in backends:
        for kernel, call in _kernel_calls(gpu_kernels, backend, op, dtype).items():
            try:
                seconds = timed(call)
            except Exception as error:  # CuPy's CompileException, Numba's errors, launches
                emit(KernelRow(nbytes, dtype.name, kernel, backend, math.nan, math.nan, None,
                               None, f"{type(error).__name__}: {error}"))
                continue
            emit(_row(nbytes, dtype, kernel, backend, seconds, copy_bw, add_time))


def _kernel_calls(gpu_kernels: Callable[..., Any], backend: str, op: ReduceOp,
                  dtype: np.dtype) -> dict[str, Callable[..., None]]:
    """Each kernel as a call on one buffer set (a, b, c, s2, s3); building the backend or
    the reducer is deferred to the first call, so its failure is that kernel's row."""

    @functools.cache
    def kernels() -> Any:
        return gpu_kernels(backend=backend)

    @functools.cache
    def reducer() -> Callable[..., None]:
        return kernels().reducer(op, dtype)

    return {
        "reduce": lambda a, b, c, *extra: reducer()(c, a),
        "reduce_pair": lambda a, b, c, *extra: reducer()(c, a, b),
        "reduce_n": lambda a, b, c, *extra: kernels().reduce_n(c, [a, b, *extra], op),
        "reduce_copy": lambda a, b, c, *extra: kernels().reduce_copy(c, extra[0], a, b, op),
        # as the device space calls it: any dtype moved as unsigned words of its width
        "copy_pair": lambda a, b, c, *extra: kernels().copy_pair(
            *(as_words(x) for x in (c, extra[0], a))),
    }


def _row(nbytes: int, dtype: np.dtype, kernel: str, backend: str, seconds: float,
         copy_bw: float, add_time: float | None) -> KernelRow:
    bandwidth = BYTES_PER_ELEMENT[kernel] * nbytes / seconds / 1e9
    return KernelRow(nbytes, dtype.name, kernel, backend, seconds * 1e6, bandwidth,
                     bandwidth / copy_bw, add_time / seconds if add_time else None)


TABLE_HEADER = "#     size(B)     type       kernel backend   time(us)  GB/s(r+w)  of copy  vs add"


def format_row(r: KernelRow) -> str:
    """One table line; a failed kernel's line has the error's first line instead of numbers
    and the rest of the error on following lines starting with '#'."""
    head = f"{r.size:>13} {r.dtype:>8} {r.kernel:>12} {r.backend:>7} "
    if r.error is not None:
        first, *rest = r.error.strip().splitlines() or [""]
        return "\n".join([f"{head}  error: {first}", *(f"#   {line}" for line in rest)])
    of_copy = f"{100 * r.of_copy:6.1f}%" if r.of_copy is not None else "      -"
    vs_add = f"{r.vs_cupy_add:6.2f}" if r.vs_cupy_add is not None else "     -"
    return f"{head}{r.time_us:>10.1f} {r.bandwidth:>10.1f} {of_copy} {vs_add}"


def format_table(rows: list[KernelRow]) -> str:
    return "\n".join([TABLE_HEADER, *(format_row(r) for r in rows)])


def _record(r: KernelRow) -> dict[str, Any]:
    record = dataclasses.asdict(r)
    if r.error is None:
        del record["error"]  # measured rows keep the fields they always had
    else:
        record["time_us"] = record["bandwidth"] = None  # JSON has no NaN
    return record


def write_json(rows: list[KernelRow], path: str) -> None:
    """Write the rows as JSON to ``path`` ('-': stdout)."""
    from pycoll.bench import write_whole

    write_whole(json.dumps([_record(r) for r in rows], indent=1) + "\n", path)


def write_csv(rows: list[KernelRow], path: str) -> None:
    """Write the rows as CSV to ``path`` ('-': stdout); an unmeasured row's numbers are empty."""
    from pycoll.bench import write_records_csv

    write_records_csv([field.name for field in dataclasses.fields(KernelRow)],
                      [_record(r) for r in rows], path)


def outputs(json_path: str | None, csv_path: str | None
            ) -> list[tuple[Callable[[list, str], None], str | None, str]]:
    """The (write, path, flag) of each output, for ``bench.write_outputs``."""
    return [(write_json, json_path, "--json"), (write_csv, csv_path, "--csv")]


def stream_rows(json_path: str | None = None, csv_path: str | None = None,
                out: TextIO | None = None) -> Callable[[KernelRow], None]:
    """An ``on_row`` for ``run``: prints each row to ``out`` (default: stdout; the header
    first) and rewrites the JSON and CSV files with every row so far, so a killed run keeps
    them (not '-', stdout, a pipe or a device: written once, at the end, by the caller)."""
    from pycoll.bench import write_outputs

    rows: list[KernelRow] = []

    def on_row(row: KernelRow) -> None:
        stream = sys.stdout if out is None else out
        if not rows:
            print(TABLE_HEADER, file=stream, flush=True)
        rows.append(row)
        print(format_row(row), file=stream, flush=True)
        write_outputs(outputs(json_path, csv_path), rows, at_end=False)

    return on_row
