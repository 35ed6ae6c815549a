"""A stand-in device for checking the GPU path's protocol without a GPU.

Memory is host memory (``DeviceArray``, a numpy subclass, so that pycoll routes it to this
space), but every operation on it is *enqueued* on the calling thread's current stream, as on
a GPU, and runs only when the host waits for it (a stream synchronisation, or an event's
host wait). Then the operations it depends on run in a random order that respects stream
order and event waits, and nothing else. So a missing event wait reads stale or poisoned
data, and a buffer reused before its reader ran gets overwritten first with fair odds: the
result is wrong, and the test sees it.

``FakeIpcAccess`` keeps CUDA IPC's rules: a rank cannot open its own handle, every open is
counted, freeing memory that a peer still has open is an error, and so is running a copy or
reduction (queued before or after) on freed memory; an opened event, once closed, cannot be
waited on.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import threading
import types
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np

from pycoll import kernels, spaces
from pycoll.kernels import table

POISON = 0xA5  # fresh device memory holds this byte, never zeros


class DeviceArray(np.ndarray):
    """An array in fake device memory; read it on the host only after synchronising."""

    def get(self) -> np.ndarray:  # as cupy.ndarray.get, minus the synchronisation
        return host_array(self)


def device_array(host: np.ndarray) -> DeviceArray:
    """A copy of ``host`` in fake device memory (ready at once, like a finished upload)."""
    return np.ascontiguousarray(host).copy().view(DeviceArray)


def host_array(x: DeviceArray) -> np.ndarray:
    return np.asarray(x).view(np.ndarray).copy()


class _Op:
    __slots__ = ("fn", "deps", "done", "label")

    def __init__(self, fn, deps, label):
        self.fn, self.deps, self.done, self.label = fn, deps, False, label


class FakeStream:
    def __init__(self, name: str, device: FakeDevice):
        self.name, self.device = name, device
        self.last: _Op | None = None

    def synchronize(self) -> None:
        self.device._run_until(self.last)

    def __enter__(self) -> FakeStream:  # `with stream:` as with a CuPy stream
        self._using = self.device.using(self)
        self._using.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._using.__exit__(*exc)

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class PerThreadDefaultStream(FakeStream):
    """CUDA's per-thread default stream (CuPy's ``Stream.ptds``, what
    ``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1`` makes current): one handle that names, in each
    thread, that thread's own stream."""

    def __init__(self, device: FakeDevice):
        self.device = device

    @property
    def name(self) -> str:
        return self.device._own_stream().name

    @property
    def last(self) -> _Op | None:
        return self.device._own_stream().last

    @last.setter
    def last(self, op: _Op | None) -> None:
        self.device._own_stream().last = op


class FakeEvent:
    def __init__(self, interprocess: bool = False) -> None:
        self.op: _Op | None = None  # the stream position of the latest record
        self.destroyed = False
        self.interprocess = interprocess  # CUDA exports only events made for IPC


class OpenedEvent:
    """A peer's event as this rank opened it: its own handle, closed on its own."""

    def __init__(self, event: FakeEvent):
        self.event = event
        self.destroyed = False

    @property
    def op(self) -> _Op | None:
        return self.event.op


class FakeAllocation:
    def __init__(self, nbytes: int, owner: int | None, buffer: np.ndarray | None = None):
        self.buffer = np.full(nbytes, POISON, np.uint8) if buffer is None else buffer
        self.owner = owner
        self.freed = False
        self.ipc_entry: dict | None = None  # its export, counting the peers that have it open


class FakeIpcAccess:
    """One rank's CUDA-IPC-like access to a world's shared handle registry."""

    interprocess = True

    def __init__(self, registry: dict, rank: int, lock: threading.Lock):
        self.registry, self.rank, self.lock = registry, rank, lock

    def _export(self, thing: Any) -> bytes:
        with self.lock:
            handle = len(self.registry).to_bytes(8, "little") + b"fake-ipc".ljust(56, b"\0")
            entry = self.registry[handle] = {"thing": thing, "exporter": self.rank, "opens": 0}
            if isinstance(thing, FakeAllocation):
                thing.ipc_entry = entry
            return handle

    def _open(self, handle: bytes) -> Any:
        with self.lock:
            entry = self.registry[handle]
            if entry["exporter"] == self.rank:
                raise RuntimeError("invalid device context: a process cannot open its own handle")
            entry["opens"] += 1
            return entry["thing"]

    def export(self, allocation: FakeAllocation) -> bytes:
        return self._export(allocation)

    def open(self, handle: bytes, capacity: int) -> FakeAllocation:
        allocation = self._open(handle)
        if capacity != allocation.buffer.size:
            raise ValueError(f"capacity {capacity} != {allocation.buffer.size}")
        if allocation.freed:
            raise RuntimeError("opened an allocation its owner freed")
        return allocation

    def close(self, opened: FakeAllocation) -> None:
        with self.lock:
            for entry in self.registry.values():
                if entry["thing"] is opened:
                    entry["opens"] -= 1

    def export_event(self, event: FakeEvent) -> bytes:
        if not event.interprocess:  # cudaIpcGetEventHandle: cudaErrorInvalidResourceHandle
            raise RuntimeError("an event not made for IPC cannot be exported")
        return self._export(event)

    def open_event(self, handle: bytes) -> OpenedEvent:
        return OpenedEvent(self._open(handle))

    def close_event(self, opened: OpenedEvent) -> None:
        if opened.destroyed:
            raise RuntimeError("closed an opened event twice")
        opened.destroyed = True
        self.close(opened.event)

    def open_count(self, thing: Any) -> int:
        with self.lock:
            return sum(e["opens"] for e in self.registry.values() if e["thing"] is thing)


class FakeDevice:
    """The space pycoll sees (``name``, ``owns``, ``empty``, ``copy``, events, ...)."""

    is_device = True
    ipc_access = None  # one process: under MPI only the staged transport applies

    def __init__(self, seed: int = 0, name: str = "fake", per_thread_default: bool = False):
        self.name = name
        self._lock = threading.RLock()
        self._rng = random.Random(seed)
        self._local = threading.local()
        self._streams: list[FakeStream] = []
        self.operations = 0
        self.n_ary_reductions = 0  # reduce_n launches (the direct schedules' one-pass fold)
        self.reduce_copies = 0  # reduce_copy launches (the ring's receive-reduce-send)
        self.copy_pairs = 0  # copy_pair launches (the ring's receive-copy-send)
        self.allocations: list[FakeAllocation] = []
        self._freed: dict[int, np.ndarray] = {}  # id -> buffer of each freed allocation
        # A thread's current stream when none is set: its own (as each thread's own legacy
        # stream would be), or one handle naming each thread's own (CUDA's per-thread default)
        self.per_thread = PerThreadDefaultStream(self) if per_thread_default else None

    # -- streams

    def new_stream(self, name: str = "stream") -> FakeStream:
        stream = FakeStream(name, self)
        with self._lock:
            self._streams.append(stream)
        return stream

    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    @contextlib.contextmanager
    def on_device(self, device: int) -> Iterator[None]:
        saved = self.current_device()
        self._local.device = device
        try:
            yield
        finally:
            self._local.device = saved

    def current_stream(self) -> FakeStream:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            if self.per_thread is not None:
                return self.per_thread
            stream = self._local.stream = self._own_stream()
        return stream

    def _own_stream(self) -> FakeStream:
        stream = getattr(self._local, "own", None)
        if stream is None:
            stream = self._local.own = self.new_stream(threading.current_thread().name)
        return stream

    def names_a_thread(self, stream: Any) -> bool:
        return stream is not None and stream is self.per_thread

    @contextlib.contextmanager
    def using(self, stream: Any, named: str = "") -> Iterator[None]:
        if stream is None:
            yield
            return
        if not isinstance(stream, FakeStream):
            raise TypeError(f"{named}{': ' if named else ''}stream={stream!r} is not a "
                            "FakeStream")
        saved = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = saved

    def _enqueue(self, fn, label: str, after: _Op | None = None) -> None:
        with self._lock:
            stream = self.current_stream()
            deps = [op for op in (stream.last, after) if op is not None and not op.done]
            stream.last = _Op(fn, deps, f"{stream.name}:{label}")

    def _run_until(self, target: _Op | None) -> None:
        with self._lock:
            pending, stack = [], [target] if target is not None else []
            seen: set[int] = set()
            while stack:
                op = stack.pop()
                if op.done or id(op) in seen:
                    continue
                seen.add(id(op))
                pending.append(op)
                stack.extend(op.deps)
            while pending:
                ready = [op for op in pending if all(d.done for d in op.deps)]
                op = self._rng.choice(ready)
                pending.remove(op)
                if op.fn is not None:
                    op.fn()
                    self.operations += 1
                op.done = True
                op.deps = []

    def synchronize(self) -> None:
        self._run_until(self.current_stream().last)

    def synchronize_all(self) -> None:
        for stream in list(self._streams):
            self._run_until(stream.last)

    # -- arrays

    def owns(self, x: object) -> bool:
        return isinstance(x, DeviceArray)

    def empty(self, shape: Any, dtype: Any) -> DeviceArray:
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        raw = np.full(count * dtype.itemsize, POISON, np.uint8)
        return raw.view(dtype).reshape(shape).view(DeviceArray)

    def _check_live(self, *arrays: Any) -> None:
        """At run time: no operand lies in freed memory (CUDA would read or corrupt it)."""
        for a in arrays:
            while isinstance(a, np.ndarray) and isinstance(a.base, np.ndarray):
                a = a.base
            if id(a) in self._freed:
                raise RuntimeError("a queued copy or reduction touches freed memory")

    def copy(self, dst: Any, src: Any) -> None:
        if (np.shares_memory(dst, src)
                and self.address(dst) != self.address(src)):  # as cudaMemcpy: undefined
            raise AssertionError("a copy between arrays that partly overlap")

        def run() -> None:
            self._check_live(dst, src)
            np.copyto(np.asarray(dst), np.asarray(src).reshape(np.shape(dst)), casting="no")

        self._enqueue(run, "copy")

    may_share_memory = staticmethod(np.may_share_memory)
    shares_memory = staticmethod(np.shares_memory)

    def address(self, x: Any) -> int:
        return x.__array_interface__["data"][0]

    def reducer(self, op: Any, dtype: Any):
        # as the GPU space: complex as float pairs, and only what GPU kernels exist for
        return spaces.complex_as_real(self._kernel_reducer, kernels.ReduceOp.parse(op), dtype)

    def _kernel_reducer(self, op: Any, dtype: Any):
        host = kernels.reducer(op, table.gpu_dtype(dtype).dtype)

        def reduce(dst: Any, src: Any, first: Any = None) -> None:
            def run() -> None:
                self._check_live(dst, src, first)
                also = None if first is None else np.asarray(first)
                with np.errstate(all="ignore"):
                    host(np.asarray(dst), np.asarray(src), also)

            self._enqueue(run, "reduce")

        return reduce

    def reducer_n(self, op: Any, dtype: Any):
        op = kernels.ReduceOp.parse(op)
        return spaces.complex_as_real_n(self._kernel_reduce_n, op, dtype)

    def _kernel_reduce_n(self, dst: Any, sources: list, op: Any) -> None:
        # as the GPU's reduce_n: one launch of at most MAX_SOURCES sources, each element read
        # from every source before dst's is written (dst may be any of them)
        host = kernels.reducer(table.combine_op(op), table.gpu_dtype(dst.dtype).dtype)
        if not 1 <= len(sources) <= table.MAX_SOURCES:
            raise ValueError(f"{len(sources)} sources; one launch takes 1..{table.MAX_SOURCES}")
        if any(s.shape != dst.shape or s.dtype != dst.dtype for s in sources):
            raise ValueError("reduce_n: every source must have dst's shape and dtype")
        with self._lock:
            self.n_ary_reductions += 1

        def run() -> None:
            self._check_live(dst, *sources)
            acc = np.array(sources[0], copy=True).view(np.ndarray)
            with np.errstate(all="ignore"):
                for src in sources[1:]:
                    host(acc, np.asarray(src).view(np.ndarray))
            np.asarray(dst)[...] = acc

        self._enqueue(run, "reduce_n")

    def reducer_copy(self, op: Any, dtype: Any):
        op = kernels.ReduceOp.parse(op)
        return spaces.complex_as_real_copy(self._kernel_reduce_copy, op, dtype)

    def _kernel_reduce_copy(self, dst: Any, peer: Any, a: Any, b: Any, op: Any) -> None:
        # as the GPU's reduce_copy: dst = peer = a op b, one launch (dst may be a or b)
        host = kernels.reducer(table.combine_op(op), table.gpu_dtype(dst.dtype).dtype)
        if any(x.shape != dst.shape or x.dtype != dst.dtype for x in (peer, a, b)):
            raise ValueError("reduce_copy: peer, a and b must have dst's shape and dtype")
        with self._lock:
            self.reduce_copies += 1

        def run() -> None:
            self._check_live(dst, peer, a, b)
            result = np.empty(dst.shape, dst.dtype)
            with np.errstate(all="ignore"):
                host(result, np.asarray(b).view(np.ndarray), np.asarray(a).view(np.ndarray))
            np.asarray(dst)[...] = result
            np.asarray(peer)[...] = result

        self._enqueue(run, "reduce_copy")

    def copy_pair(self, dst: Any, peer: Any, src: Any) -> None:
        # as the GPU space's: one launch on the arrays as words (dst, peer: src's shape)
        dst, peer, src = (spaces.as_words(x) for x in (dst, peer, src))
        table.gpu_dtype(dst.dtype)
        if any(x.shape != dst.shape or x.dtype != dst.dtype for x in (peer, src)):
            raise ValueError("copy_pair: peer and src must have dst's shape and dtype")
        with self._lock:
            self.copy_pairs += 1

        def run() -> None:
            self._check_live(dst, peer, src)
            np.asarray(dst)[...] = src
            np.asarray(peer)[...] = src

        self._enqueue(run, "copy_pair")

    def finish(self, work: Any, op: Any, nranks: int) -> None:
        work = spaces.real_view(work)
        table.gpu_dtype(work.dtype)
        kernels.finish(np.empty(0, work.dtype), op, nranks)  # validate now, as a launch would
        host = np.asarray(work).view(np.ndarray)
        self._enqueue(lambda: kernels.finish(host, op, nranks), "finish")

    # -- what the device transports need

    def allocate(self, nbytes: int) -> FakeAllocation:
        allocation = FakeAllocation(-(-max(nbytes, 1) // 4096) * 4096, owner=None)  # pages
        self.allocations.append(allocation)
        return allocation

    def free(self, allocation: FakeAllocation) -> None:
        with self._lock:
            opens = allocation.ipc_entry["opens"] if allocation.ipc_entry else 0
            if opens:
                raise RuntimeError(f"freed memory that {opens} peer mapping(s) still have open")
            allocation.freed = True
            self._freed[id(allocation.buffer)] = allocation.buffer  # kept: ids stay unique

    def capacity(self, allocation: FakeAllocation) -> int:
        return allocation.buffer.size

    def view(self, allocation: FakeAllocation, offset: int, count: int, dtype: Any) -> DeviceArray:
        if allocation.freed:
            raise RuntimeError("view of freed memory")
        dtype = np.dtype(dtype)
        raw = allocation.buffer[offset : offset + count * dtype.itemsize]
        if raw.size != count * dtype.itemsize:
            raise ValueError(f"slot [{offset}, +{count * dtype.itemsize}) beyond the allocation")
        return raw.view(dtype).view(DeviceArray)

    def new_event(self, interprocess: bool = True) -> FakeEvent:
        return FakeEvent(interprocess)

    def record(self, event: FakeEvent) -> None:
        with self._lock:
            event.op = self.current_stream().last

    def wait(self, event: FakeEvent) -> None:
        with self._lock:
            if event.destroyed:
                raise RuntimeError("wait on a destroyed event")
            self._enqueue(None, "wait", after=event.op)

    def record_new_event(self) -> FakeEvent:
        event = FakeEvent()
        self.record(event)
        return event

    def wait_host(self, event: FakeEvent) -> None:
        self._run_until(event.op)

    def host_buffer(self, count: int, dtype: Any) -> np.ndarray:
        return np.full(count * np.dtype(dtype).itemsize, POISON, np.uint8).view(dtype)

    def to_host(self, dst: np.ndarray, src: Any) -> None:
        self.copy(dst, src)

    def to_device(self, dst: Any, src: np.ndarray) -> None:
        self.copy(dst, src)

    # -- in-process worlds map memory with CUDA IPC's rules

    def peer_access_for(self, shared: dict, rank: int) -> FakeIpcAccess:
        registry = shared.setdefault(("fake ipc registry", self.name), {})
        lock = shared.setdefault(("fake ipc lock", self.name), threading.Lock())
        return FakeIpcAccess(registry, rank, lock)


class FileIpcAccess:
    """CUDA IPC's rules between processes of one machine, for :class:`SharedFileDevice`:
    an inbox's handle names its file, which a peer maps; a process cannot open its own."""

    interprocess = True

    def __init__(self) -> None:
        self.opens = 0  # mappings of peers' inboxes this process holds

    def export(self, allocation: FakeAllocation) -> bytes:
        return allocation.path.encode().ljust(64, b"\0")

    def open(self, handle: bytes, capacity: int) -> FakeAllocation:
        path = handle.rstrip(b"\0").decode()
        if path.startswith(f"{_SHARED_PREFIX}{os.getpid()}-"):
            raise RuntimeError("invalid device context: a process cannot open its own handle")
        if os.path.getsize(path) != capacity:
            raise ValueError(f"capacity {capacity} != {os.path.getsize(path)} ({path})")
        self.opens += 1
        return FakeAllocation(capacity, None, np.memmap(path, np.uint8, "r+", shape=(capacity,)))

    def close(self, opened: FakeAllocation) -> None:
        if opened.freed:
            raise RuntimeError("closed a peer's inbox twice")
        opened.freed = True
        self.opens -= 1

    def export_event(self, event: FakeEvent) -> bytes:
        if not event.interprocess:  # cudaIpcGetEventHandle: cudaErrorInvalidResourceHandle
            raise RuntimeError("an event not made for IPC cannot be exported")
        return b"event-" + uuid.uuid4().bytes.ljust(58, b"\0")

    def open_event(self, handle: bytes) -> OpenedEvent:
        return OpenedEvent(FakeEvent())  # work runs at once: nothing to wait for

    def close_event(self, opened: OpenedEvent) -> None:
        if opened.destroyed:
            raise RuntimeError("closed an opened event twice")
        opened.destroyed = True


_SHARED_PREFIX = "/dev/shm/pycoll-fake-"


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class SharedFileDevice(FakeDevice):
    """A stand-in device for MPI processes of one machine: its exchange memory is a file in
    /dev/shm that peers map, as CUDA IPC maps device memory, so the peer-memory transport
    runs between processes (handles, credits and notices over MPI, Send/Recv pairs, freeing).

    Its work runs at once: another process's queued work is not something a host wait here
    could run, so stream order is checked by :class:`FakeDevice`, in one process, instead.
    """

    def __init__(self, seed: int = 0, name: str = "fake-shared"):
        super().__init__(seed, name)
        self.access = FileIpcAccess()

    @property
    def ipc_access(self):  # what pycoll calls to get this process's access
        return lambda: self.access

    def _enqueue(self, fn, label: str, after: _Op | None = None) -> None:
        if fn is not None:
            fn()
            self.operations += 1

    def record(self, event: FakeEvent) -> None:
        event.op = None

    def allocate(self, nbytes: int) -> FakeAllocation:
        size = -(-max(nbytes, 1) // 4096) * 4096
        path = f"{_SHARED_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        with open(path, "wb") as f:
            f.truncate(size)
        atexit.register(_unlink, path)  # an inbox never freed still goes with its process
        buffer = np.memmap(path, np.uint8, "r+", shape=(size,))
        buffer[:] = POISON
        allocation = FakeAllocation(size, None, buffer)
        allocation.path = path
        self.allocations.append(allocation)
        return allocation

    def free(self, allocation: FakeAllocation) -> None:
        if allocation.freed:
            raise RuntimeError("freed an inbox twice")
        allocation.freed = True
        _unlink(allocation.path)  # peers that still map it keep their mapping, as with IPC


def cupy_look_alike(device: FakeDevice) -> types.ModuleType:
    """What pycoll's own GPU-facing code (the bench's ``--device cuda``) asks of ``cupy``,
    with arrays on ``device``: put it in ``sys.modules["cupy"]`` and register ``device``."""
    look_alike = types.ModuleType("cupy")
    look_alike.ndarray = type("NotACupyArray", (), {})  # the CUDA space claims nothing
    look_alike.asarray = device_array
    look_alike.zeros = lambda n, dtype: device_array(np.zeros(n, dtype))
    look_alike.cuda = types.SimpleNamespace(
        Stream=lambda non_blocking: device.new_stream("bench"),
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1),
        Device=lambda index: types.SimpleNamespace(use=lambda: None),
    )
    return look_alike
