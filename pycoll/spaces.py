"""Memory spaces: where a collective's arrays live and what the executor may do to them.

A space answers, for one kind of array: allocate, copy, reduce (the kernels), order work on a
stream, and, for device spaces, the pieces the device transports need (registered exchange
memory, events, staging to the host). ``HOST`` is numpy, synchronous, stream-less. ``CUDA`` is
CuPy: every operation is enqueued on the current stream (``with stream:``) and returns before
the GPU runs it, so a collective on CuPy arrays is ordered on its stream like any CuPy call.

The API picks the space from the array's type (:func:`space_of`). Other spaces can be
registered (the tests register a stand-in device whose streams run work lazily, in a random
valid order, so that a missing event wait shows up as a wrong result without a GPU).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from pycoll import kernels
from pycoll.kernels import ReduceOp

# Registered exchange memory is allocated in these units: cudaMalloc may sub-allocate smaller
# requests, and an IPC handle then exposes the whole block (see the GPU notes).
EXCHANGE_GRANULE = 2 << 20


class Space(Protocol):
    name: str

    def owns(self, x: object) -> bool: ...
    def empty(self, shape: Any, dtype: Any) -> Any: ...
    def copy(self, dst: Any, src: Any) -> None: ...
    def may_share_memory(self, a: Any, b: Any) -> bool: ...
    def shares_memory(self, a: Any, b: Any) -> bool: ...
    def address(self, x: Any) -> int: ...
    def reducer(self, op: ReduceOp, dtype: np.dtype) -> Callable[..., None]: ...
    def finish(self, work: Any, op: ReduceOp, nranks: int) -> None: ...
    def using(self, stream: Any, named: str = "") -> contextlib.AbstractContextManager: ...


_NO_STREAM = contextlib.nullcontext()  # reusable: host work needs no stream


class HostSpace:
    """numpy arrays in this process's memory: every operation completes before it returns."""

    name = "host"
    is_device = False

    def owns(self, x: object) -> bool:
        return isinstance(x, np.ndarray)

    def empty(self, shape: Any, dtype: Any) -> np.ndarray:
        return np.empty(shape, dtype)

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        dst[...] = src

    may_share_memory = staticmethod(np.may_share_memory)

    @staticmethod
    def shares_memory(a: np.ndarray, b: np.ndarray) -> bool:
        if a.base is None and b.base is None and a is not b:
            return False  # each owns its memory (as _out's test): known without numpy's 0.5 us
        return bool(np.shares_memory(a, b))

    def address(self, x: np.ndarray) -> int:
        return x.__array_interface__["data"][0]

    def reducer(self, op: ReduceOp, dtype: np.dtype) -> Callable[..., None]:
        return kernels.reducer(op, dtype)

    def finish(self, work: np.ndarray, op: ReduceOp, nranks: int) -> None:
        kernels.finish(work, op, nranks)

    def using(self, stream: Any, named: str = "") -> contextlib.AbstractContextManager:
        """Nothing to order; ``named`` (the collective) starts the refusal of a stream."""
        if stream is not None:
            raise ValueError(
                f"{named}{': ' if named else ''}stream={stream!r} was given for numpy arrays; "
                "allowed: None "
                "(streams order device arrays only)"
            )
        return _NO_STREAM


class CudaSpace:
    """CuPy arrays on the current device; work is enqueued on CuPy's current stream."""

    name = "cuda"
    is_device = True

    def __init__(self) -> None:
        self._peer_access: dict[tuple[int, int], bool] = {}  # (device, peer) -> reachable

    def owns(self, x: object) -> bool:
        cupy = sys.modules.get("cupy")  # an array of a module never imported cannot be here
        return cupy is not None and isinstance(x, cupy.ndarray)

    @property
    def _cupy(self) -> Any:
        import cupy

        return cupy

    def empty(self, shape: Any, dtype: Any) -> Any:
        return self._cupy.empty(shape, dtype)

    def copy(self, dst: Any, src: Any) -> None:
        # the same memory (an in-place AllGather's own block): CUDA's memcpy takes no overlap
        if dst.nbytes and dst.data.ptr != src.data.ptr:
            dst.data.copy_from_device_async(src.data, src.nbytes, self.current_stream())

    def may_share_memory(self, a: Any, b: Any) -> bool:
        return bool(self._cupy.may_share_memory(a, b))

    def shares_memory(self, a: Any, b: Any) -> bool:
        # Only contiguous arrays get here, whose bounds overlap exactly when they share
        # memory; cupy.shares_memory's exact test would launch a sort and synchronise.
        return bool(self._cupy.may_share_memory(a, b))

    def address(self, x: Any) -> int:
        return int(x.data.ptr)

    def reducer(self, op: ReduceOp, dtype: np.dtype) -> Callable[..., None]:
        return complex_as_real(_gpu_kernels().reducer, op, dtype)

    def reducer_n(self, op: ReduceOp, dtype: np.dtype) -> Callable[[Any, list], None]:
        """``reduce_n(dst, sources)``: dst = sources[0] op sources[1] op ... in one pass over
        memory (the direct schedules' reduction of every rank's piece)."""
        return complex_as_real_n(_gpu_kernels().reduce_n, op, dtype)

    def reducer_copy(self, op: ReduceOp, dtype: np.dtype) -> Callable[[Any, Any, Any, Any], None]:
        """``reduce_copy(dst, peer, a, b)``: dst = peer = a op b in one pass (the ring's
        receive-reduce-send: ``peer`` is the next rank's inbox slot)."""
        return complex_as_real_copy(_gpu_kernels().reduce_copy, op, dtype)

    def copy_pair(self, dst: Any, peer: Any, src: Any) -> None:
        """dst = peer = src in one pass (the ring's receive-copy-send: ``peer`` is the next
        rank's inbox slot), any dtype: as unsigned integers of its width."""
        _gpu_kernels().copy_pair(*(as_words(x) for x in (dst, peer, src)))

    def finish(self, work: Any, op: ReduceOp, nranks: int) -> None:
        _gpu_kernels().finish(real_view(work), op, nranks)

    def kernels_reach(self, x: Any) -> bool:
        """Whether a kernel on the current device may write ``x``: memory of this device
        (an inbox opened through CUDA IPC is mapped here), or of another one this device
        has peer access to (enabled here, once; threads of one process on several GPUs)."""
        device, current = x.data.device_id, self.current_device()
        if device == current:
            return True
        reach = self._peer_access.get((current, device))
        if reach is None:
            runtime = self._cupy.cuda.runtime
            reach = bool(runtime.deviceCanAccessPeer(current, device))
            if reach:
                try:
                    runtime.deviceEnablePeerAccess(device)
                except runtime.CUDARuntimeError as error:  # already on: CuPy's copies do it
                    reach = error.status == getattr(runtime, "errorPeerAccessAlreadyEnabled",
                                                    704)  # (CUDA's number; as CuPy compares)
            self._peer_access[(current, device)] = reach
        return reach

    def current_stream(self) -> Any:
        return self._cupy.cuda.get_current_stream()

    def names_a_thread(self, stream: Any) -> bool:
        """Whether ``stream`` is CUDA's per-thread default stream (CuPy's ``Stream.ptds``,
        current under ``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``): its handle names, in each
        thread, that thread's own stream, so no other thread can enqueue on the caller's."""
        cuda = self._cupy.cuda
        return (isinstance(stream, cuda.Stream | cuda.ExternalStream)  # else using() names it
                and stream.ptr == cuda.runtime.streamPerThread)

    def new_stream(self) -> Any:
        return self._cupy.cuda.Stream()

    def current_device(self) -> int:
        return self._cupy.cuda.runtime.getDevice()

    def on_device(self, device: int) -> Any:
        """Make ``device`` current in this thread (CUDA's current device is per thread)."""
        return self._cupy.cuda.Device(device)

    @contextlib.contextmanager
    def using(self, stream: Any, named: str = "") -> Iterator[None]:
        """Within: ``stream`` is current (None: as it was); ``named`` (the collective) starts
        the refusal of what is not a stream."""
        if stream is None:
            yield
            return
        if not isinstance(stream, self._cupy.cuda.Stream | self._cupy.cuda.ExternalStream):
            raise TypeError(f"{named}{': ' if named else ''}stream={stream!r} is not a "
                            "cupy.cuda.Stream; allowed: one, or None")
        with stream:
            yield

    def synchronize(self) -> None:
        self.current_stream().synchronize()

    # -- what the device transports need

    @property
    def ipc_access(self) -> Any:
        """What maps other processes' inboxes and events on this node: CUDA IPC."""
        from pycoll.bindings.cuda_ipc import CudaIpcAccess

        return CudaIpcAccess

    def allocate(self, nbytes: int) -> Any:
        """Registered exchange memory: a direct cudaMalloc outside CuPy's pool, so that its
        IPC handle names exactly this buffer (a pool chunk may sit inside a larger block)."""
        return self._cupy.cuda.Memory(_round_up(max(nbytes, 1), EXCHANGE_GRANULE))

    def free(self, allocation: Any) -> None:
        """Nothing to do: CuPy frees a ``Memory`` when its last reference goes, and the
        caller drops its own (stand-in devices check here that no peer still maps it)."""

    def capacity(self, allocation: Any) -> int:
        return int(allocation.size)

    def view(self, allocation: Any, offset: int, count: int, dtype: np.dtype) -> Any:
        cupy = self._cupy
        return cupy.ndarray((count,), dtype, cupy.cuda.MemoryPointer(allocation, offset))

    def new_event(self, interprocess: bool = True) -> Any:
        """An event peers wait on: made for IPC where they are other processes (CUDA IPC
        events need a /dev/shm shared with them; threads of this process need none)."""
        return self._cupy.cuda.Event(disable_timing=True, interprocess=interprocess)

    def record(self, event: Any) -> None:
        event.record(self.current_stream())

    def wait(self, event: Any) -> None:
        """Order the current stream after ``event``'s latest record (an Event, or the raw
        handle that opening an IPC event gives)."""
        pointer = event if isinstance(event, int) else event.ptr
        self._cupy.cuda.runtime.streamWaitEvent(self.current_stream().ptr, pointer, 0)

    def record_new_event(self) -> Any:
        """A fresh event recorded on the current stream, for the host to wait on."""
        event = self._cupy.cuda.Event(disable_timing=True)
        event.record(self.current_stream())
        return event

    def wait_host(self, event: Any) -> None:
        event.synchronize()

    def host_buffer(self, count: int, dtype: np.dtype) -> np.ndarray:
        """Page-locked host memory, so device copies to and from it run asynchronously."""
        import cupyx

        return cupyx.empty_pinned((count,), dtype)

    def to_host(self, dst: np.ndarray, src: Any) -> None:
        src.get(stream=self.current_stream(), out=dst, blocking=False)

    def to_device(self, dst: Any, src: np.ndarray) -> None:
        dst.set(src, stream=self.current_stream())


def complex_as_real(reducer_of: Callable[[ReduceOp, np.dtype], Callable[..., None]],
                    op: ReduceOp, dtype: Any) -> Callable[..., None]:
    """A device reducer for ``dtype``: ``reducer_of(op, dtype)``, the kernels' own, except for
    complex data, which has no kernels: sum and avg are the same reductions of the float
    (real, imaginary) pairs (as NCCL users view complex tensors as real); prod is not."""
    real = _pairs_of(op, dtype)
    if real is None:
        return reducer_of(op, dtype)
    reduce = reducer_of(op, real)

    def reduce_pairs(dst: Any, src: Any, first: Any = None) -> None:
        reduce(dst.view(real), src.view(real), None if first is None else first.view(real))

    return reduce_pairs


def complex_as_real_n(reduce_n: Callable[[Any, Sequence[Any], ReduceOp], None], op: ReduceOp,
                      dtype: Any) -> Callable[[Any, Sequence[Any]], None]:
    """``complex_as_real`` for the kernels' n-ary ``reduce_n(dst, sources, op)``."""
    real = _pairs_of(op, dtype)
    if real is None:
        return lambda dst, sources: reduce_n(dst, sources, op)
    return lambda dst, sources: reduce_n(dst.view(real), [s.view(real) for s in sources], op)


def complex_as_real_copy(reduce_copy: Callable[[Any, Any, Any, Any, ReduceOp], None],
                         op: ReduceOp, dtype: Any) -> Callable[[Any, Any, Any, Any], None]:
    """``complex_as_real`` for the kernels' ``reduce_copy(dst, peer, a, b, op)``."""
    real = _pairs_of(op, dtype)
    if real is None:
        return lambda dst, peer, a, b: reduce_copy(dst, peer, a, b, op)
    return lambda dst, peer, a, b: reduce_copy(dst.view(real), peer.view(real), a.view(real),
                                               b.view(real), op)


def _pairs_of(op: ReduceOp, dtype: Any) -> np.dtype | None:
    """The float dtype whose pairs stand for complex ``dtype`` (None: not complex)."""
    dtype = np.dtype(dtype)
    if dtype.kind != "c":
        return None
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise TypeError(f"op={op.value!r} on {dtype.name} device arrays has no GPU kernel; "
                        "allowed for complex device arrays: sum, avg")
    return _real_of(dtype)


def as_words(x: Any) -> Any:
    """``x`` as unsigned integers of its element's width (16-byte elements as two 8-byte
    words): what a copy kernel moves for any dtype."""
    itemsize = np.dtype(x.dtype).itemsize
    return x.view(f"u{min(itemsize, 8)}")


def real_view(work: Any) -> Any:
    """``work`` as its float (real, imaginary) pairs when complex (see ``complex_as_real``)."""
    dtype = np.dtype(work.dtype)
    return work.view(_real_of(dtype)) if dtype.kind == "c" else work


def _real_of(complex_dtype: np.dtype) -> np.dtype:
    return np.dtype(f"f{complex_dtype.itemsize // 2}")  # complex64 -> float32, 128 -> 64


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


_kernels: Any = None


def _gpu_kernels() -> Any:
    global _kernels
    if _kernels is None:
        from pycoll.kernels.device import gpu_kernels

        _kernels = gpu_kernels()  # launches on the current stream at each call
    return _kernels


HOST = HostSpace()
CUDA = CudaSpace()
_device_spaces: list[Any] = [CUDA]


def register(space: Any) -> None:
    """Let the collectives accept ``space``'s arrays (checked before numpy's)."""
    if space not in _device_spaces:
        _device_spaces.insert(0, space)


def unregister(space: Any) -> None:
    if space in _device_spaces:
        _device_spaces.remove(space)


def space_of(x: object) -> Any:
    """The space of array ``x``, or None when no space owns it."""
    if type(x) is np.ndarray:  # the common case first: no device array is exactly this
        return HOST
    for space in _device_spaces:
        if space.owns(x):
            return space
    return HOST if HOST.owns(x) else None
