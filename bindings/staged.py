"""Device messages over a host transport (MPI between nodes): CUDA-aware, or staged.

MPI reads and writes memory outside any stream's order, so the stream is synchronised before
a send hands its buffer to MPI, and a receive's data is copied to the device (and reduced
there) on the stream after MPI delivered it.

* ``cuda_aware``: MPI is given device buffers directly (when the MPI library reports it, or
  ``PYCOLL_CUDA_AWARE_MPI=1``).
* otherwise each message is staged through page-locked host buffers, in pieces of
  ``piece_bytes``, so that copying one piece between device and host overlaps moving
  another over the wire.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pycoll.settings import switch

PIECE_BYTES = 4 << 20


def forced_cuda_awareness() -> bool | None:
    """``PYCOLL_CUDA_AWARE_MPI`` (0 or 1), or None where unset: the library is asked."""
    return switch("PYCOLL_CUDA_AWARE_MPI", None)


def cuda_aware_mpi(mpi_comm: Any) -> bool:
    """Whether the MPI library takes CUDA device buffers on ``mpi_comm`` (an mpi4py
    communicator; ``PYCOLL_CUDA_AWARE_MPI`` overrides)."""
    forced = forced_cuda_awareness()
    if forced is not None:
        return forced
    # MPI 4.1's memory kinds: those the library supports are the communicator's info; the
    # same key of MPI_INFO_ENV holds those the user asked for (MPICH 5 leaves it unset)
    try:
        info = mpi_comm.Get_info()
        try:
            kinds = info.Get("mpi_memory_alloc_kinds") or ""
        finally:
            info.Free()
    except Exception:  # noqa: BLE001 - older libraries lack the key or the call
        return False
    for kind in kinds.split(","):  # "cuda" is every CUDA kind; "cuda:host" not device memory
        name, *restrictors = kind.strip().split(":")
        if name == "cuda" and (not restrictors or "device" in restrictors):
            return True
    return False


class _Send:
    __slots__ = ("requests", "keep")

    def __init__(self, requests: list, keep: list):
        self.requests, self.keep = requests, keep


class _Receive:
    __slots__ = ("requests", "pieces", "buf", "combine")

    def __init__(self, requests: list, pieces: list, buf: Any, combine):
        self.requests, self.pieces, self.buf, self.combine = requests, pieces, buf, combine


class StagedTransport:
    """One rank's device endpoint over a host transport (``host``: e.g. an MPITransport)."""

    delivers = True

    def __init__(self, space: Any, host: Any, cuda_aware: bool = False,
                 piece_bytes: int | None = None):
        self.space, self.host, self.cuda_aware = space, host, cuda_aware
        self.rank, self.size = host.rank, host.size
        self.piece_bytes = PIECE_BYTES if piece_bytes is None else piece_bytes

    def _pieces(self, n: int, itemsize: int) -> list[tuple[int, int]]:
        step = max(1, self.piece_bytes // itemsize)
        return [(start, min(n, start + step)) for start in range(0, n, step)] or [(0, 0)]

    def isend(self, buf: Any, peer: int, tag: int) -> _Send:
        flat = buf.reshape(-1)
        if self.cuda_aware:
            self.space.synchronize()  # MPI reads outside stream order
            return _Send([self.host.isend(flat, peer, tag)], [flat])
        pieces = self._pieces(flat.size, flat.dtype.itemsize)
        staged = self.space.host_buffer(flat.size, flat.dtype)
        requests = []
        # Copy every piece down, then send each as soon as its copy is done: the copies of
        # later pieces run while earlier ones are on the wire.
        events = []
        for start, stop in pieces:
            self.space.to_host(staged[start:stop], flat[start:stop])
            events.append(self.space.record_new_event())
        for (start, stop), event in zip(pieces, events):
            self.space.wait_host(event)
            requests.append(self.host.isend(staged[start:stop], peer, tag))
        return _Send(requests, [staged])

    def irecv(
        self, buf: Any, peer: int, tag: int, combine: Callable[[Any], None] | None = None
    ) -> _Receive:
        flat = buf.reshape(-1)
        if self.cuda_aware:
            self.space.synchronize()  # MPI writes outside stream order
            into = flat if combine is None else self.space.empty(flat.size, flat.dtype)
            return _Receive([self.host.irecv(into, peer, tag)], [into], flat, combine)
        staged = self.space.host_buffer(flat.size, flat.dtype)
        pieces = self._pieces(flat.size, flat.dtype.itemsize)
        requests = [self.host.irecv(staged[a:b], peer, tag) for a, b in pieces]
        return _Receive(requests, [staged], flat, combine)

    def waitall(self, requests: list) -> None:
        self.host.waitall([m for r in requests for m in r.requests])
        for r in requests:
            if not isinstance(r, _Receive):
                continue
            arrived = r.pieces[0]
            if not self.cuda_aware:
                target = r.buf if r.combine is None else self.space.empty(r.buf.size, r.buf.dtype)
                self.space.to_device(target, arrived)
                arrived = target
            if r.combine is not None:
                r.combine(arrived)
        # The staging buffers are reused by the next call only after their copies finished.
        self.space.synchronize()

    def sendrecv(self, send: Any, dst: int, recv: Any, src: int, tag: int) -> None:
        self.waitall([self.irecv(recv, src, tag), self.isend(send, dst, tag)])
