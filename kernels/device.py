"""Choose the GPU kernel backend: ``PYCOLL_KERNELS=cupy|numba``.

* ``cupy``: the CUDA C kernels (cuda_c.py), compiled by NVRTC through ``cupy.RawModule``,
  with 16-byte vector loads and stores;
* ``numba``: the Numba ``@cuda.jit`` kernels (numba_cuda.py), scalar element access.

Both implement the same interface (``GpuKernels``) on CuPy arrays. The default is the one
that measured faster: on an H200 (bench/results/gpu-h200.md) the CUDA C kernels' reductions
reach 94-101% of the device's copy bandwidth at >= 256 MiB, the Numba kernels' 43-98%
(bfloat16 the slowest: no vector loads). Nothing CUDA is imported until a backend is
constructed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .host import ReduceOp

__all__ = ["BACKENDS", "DEFAULT_BACKEND", "ENV_VAR", "GpuKernels", "kernel_backend", "gpu_kernels"]

ENV_VAR = "PYCOLL_KERNELS"
BACKENDS = ("cupy", "numba")
DEFAULT_BACKEND = "cupy"  # the faster on an H200: see the module docstring


class GpuKernels(Protocol):
    """What the collectives need from a GPU kernel backend (arrays on the device)."""

    def reducer(self, op: ReduceOp | str, dtype: object) -> Callable[..., None]: ...

    def reduce_n(self, dst: Any, sources: Sequence[Any], op: ReduceOp | str) -> None: ...

    def reduce_copy(self, dst: Any, peer: Any, a: Any, b: Any, op: ReduceOp | str) -> None: ...

    def copy(self, dst: Any, src: Any) -> None: ...

    def copy_pair(self, dst: Any, peer: Any, src: Any) -> None: ...

    def finish(self, work: Any, op: ReduceOp | str, nranks: int) -> None: ...


def kernel_backend(name: str | None = None) -> str:
    """The backend to use: ``name`` if given, else $PYCOLL_KERNELS, else the default."""
    source = "backend" if name is not None else ENV_VAR
    if name is None:
        name = os.environ.get(ENV_VAR) or DEFAULT_BACKEND
    if not isinstance(name, str) or name.strip().lower() not in BACKENDS:
        raise ValueError(
            f"{source}={name!r} is not a kernel backend; allowed: {', '.join(BACKENDS)}"
        )
    return name.strip().lower()


def gpu_kernels(stream: Any = None, backend: str | None = None) -> GpuKernels:
    """A GPU kernel backend launching on ``stream`` (None: CuPy's current stream)."""
    if kernel_backend(backend) == "numba":
        from .numba_cuda import NumbaKernels

        return NumbaKernels(stream=stream)
    from .cuda_c import CudaCKernels

    return CudaCKernels(stream=stream)
