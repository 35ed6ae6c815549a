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

and is reported against the device-to-device copy bandwidth measured in the same run (the
roofline for a streaming kernel) and against CuPy's add at the same size and dtype. Times are
CUDA-event times, the median of several repeats of a batch of launches.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from pycoll.kernels import ReduceOp, check_dtype

KERNELS = ("reduce", "reduce_pair", "reduce_n", "reduce_copy")
SOURCES = 4  # reduce_n's k
BYTES_PER_ELEMENT = {"copy": 2, "cupy_add": 3, "reduce": 3, "reduce_pair": 3,
                     "reduce_n": SOURCES + 1, "reduce_copy": 4}


@dataclass
class KernelRow:
    size: int  # bytes of one operand
    dtype: str
    kernel: str
    backend: str
    time_us: float
    bandwidth: float  # GB/s of bytes read plus written
    of_copy: float | None  # fraction of the measured copy bandwidth
    vs_cupy_add: float | None  # cupy add time / this time (above 1: faster than CuPy)


def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, or no device: all mean "no GPU here"
        return False


def _timer(cupy, call: Callable[[], None], repeats: int, batch: int) -> float:
    """Median over ``repeats`` of the mean time of ``batch`` back-to-back launches (s)."""
    call()  # compile and warm up
    cupy.cuda.get_current_stream().synchronize()
    samples = []
    for _ in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(batch):
            call()
        stop.record()
        stop.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3 / batch)
    return statistics.median(samples)


def run(sizes: list[int], dtypes: list[str], backends: list[str], op: str = "sum",
        repeats: int = 5, batch: int = 10) -> list[KernelRow]:
    """Measure every kernel of every backend at every size (bytes per operand) and dtype."""
    if not gpu_available():
        raise RuntimeError("pycoll bench kernels needs a CUDA GPU and CuPy; none found")
    import cupy

    reduce_op = ReduceOp.parse(op)
    rows: list[KernelRow] = []
    for name in dtypes:
        dtype = check_dtype(np.dtype(name))
        for size in sizes:
            rows += _measure(cupy, dtype, max(size // dtype.itemsize, 1), backends, reduce_op,
                             repeats, batch)
            cupy.get_default_memory_pool().free_all_blocks()
    return rows


def _measure(cupy, dtype: np.dtype, n: int, backends: list[str], op: ReduceOp, repeats: int,
             batch: int) -> list[KernelRow]:
    from pycoll.kernels.device import gpu_kernels

    nbytes = n * dtype.itemsize
    a, b, c = cupy.ones(n, dtype), cupy.ones(n, dtype), cupy.empty(n, dtype)
    extra = [cupy.ones(n, dtype) for _ in range(SOURCES - 2)]
    stream_ptr = cupy.cuda.get_current_stream().ptr

    def copy() -> None:
        cupy.cuda.runtime.memcpyAsync(c.data.ptr, a.data.ptr, nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToDevice, stream_ptr)

    copy_time = _timer(cupy, copy, repeats, batch)
    copy_bw = 2 * nbytes / copy_time / 1e9
    rows = [KernelRow(nbytes, dtype.name, "copy", "cuda", copy_time * 1e6, copy_bw, 1.0, None)]
    try:
        add_time = _timer(cupy, lambda: cupy.add(a, b, out=c), repeats, batch)
        rows.append(_row(nbytes, dtype, "cupy_add", "cupy", add_time, copy_bw, add_time))
    except Exception:  # CuPy's add may not take this dtype (bfloat16)
        add_time = None
    for backend in backends:
        kernels = gpu_kernels(backend=backend)
        reduce = kernels.reducer(op, dtype)
        calls = {
            "reduce": lambda: reduce(c, a),  # noqa: B023 - each call runs before the next loop
            "reduce_pair": lambda: reduce(c, a, b),  # noqa: B023
            "reduce_n": lambda: kernels.reduce_n(c, [a, b, *extra], op),  # noqa: B023
            "reduce_copy": lambda: kernels.reduce_copy(c, extra[0], a, b, op),  # noqa: B023
        }
        for kernel, call in calls.items():
            seconds = _timer(cupy, call, repeats, batch)
            rows.append(_row(nbytes, dtype, kernel, backend, seconds, copy_bw, add_time))
    return rows


def _row(nbytes: int, dtype: np.dtype, kernel: str, backend: str, seconds: float,
         copy_bw: float, add_time: float | None) -> KernelRow:
    bandwidth = BYTES_PER_ELEMENT[kernel] * nbytes / seconds / 1e9
    return KernelRow(nbytes, dtype.name, kernel, backend, seconds * 1e6, bandwidth,
                     bandwidth / copy_bw, add_time / seconds if add_time else None)


def format_table(rows: list[KernelRow]) -> str:
    lines = ["#     size(B)     type       kernel backend   time(us)  GB/s(r+w)  of copy  vs add"]
    for r in rows:
        of_copy = f"{100 * r.of_copy:6.1f}%" if r.of_copy is not None else "      -"
        vs_add = f"{r.vs_cupy_add:6.2f}" if r.vs_cupy_add is not None else "     -"
        lines.append(f"{r.size:>13} {r.dtype:>8} {r.kernel:>12} {r.backend:>7} "
                     f"{r.time_us:>10.1f} {r.bandwidth:>10.1f} {of_copy} {vs_add}")
    return "\n".join(lines)


def write_json(rows: list[KernelRow], path: str) -> None:
    with open(path, "w") as f:
        json.dump([asdict(r) for r in rows], f, indent=1)
