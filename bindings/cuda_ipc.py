"""CUDA IPC: ranks of one node (one GPU each, or several sharing a GPU) map each other's
registered inboxes and events; :class:`~pycoll.bindings.peer_memory.PeerMemoryTransport`
runs the protocol over it.

Facts that decide whether this works (see the project's GPU notes): a handle names a whole
cudaMalloc allocation, so only pycoll's own inboxes (``cupy.cuda.Memory``, outside CuPy's pool)
are exported, never user arrays; a process cannot open its own handle, and the protocol never
asks it to; an opened pointer is wrapped for the *current* device, so CuPy launches kernels on
it without a peer-access check; events are created with the interprocess flag, and a stream
waits on an opened event only after the host handshake that follows its record.
"""

from __future__ import annotations

from typing import Any


def _runtime() -> Any:
    import cupy

    return cupy.cuda.runtime


class CudaIpcAccess:
    """Export and open inboxes and events between processes with CUDA IPC."""

    interprocess = True

    def export(self, allocation: Any) -> bytes:
        return bytes(_runtime().ipcGetMemHandle(allocation.ptr))

    def open(self, handle: bytes, capacity: int) -> Any:
        import cupy

        runtime = _runtime()
        pointer = runtime.ipcOpenMemHandle(handle)  # lazily enables peer access
        device = runtime.getDevice()
        return cupy.cuda.UnownedMemory(pointer, capacity, None, device)

    def close(self, opened: Any) -> None:
        _runtime().ipcCloseMemHandle(opened.ptr)

    def export_event(self, event: Any) -> bytes:
        return bytes(_runtime().ipcGetEventHandle(event.ptr))

    def open_event(self, handle: bytes) -> Any:
        return _runtime().ipcOpenEventHandle(handle)  # a raw cudaEvent_t

    def close_event(self, opened: Any) -> None:
        _runtime().eventDestroy(opened)
