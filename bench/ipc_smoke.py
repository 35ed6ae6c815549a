"""CUDA IPC between two MPI processes on this machine, with CuPy alone (no pycoll): the facts
pycoll's peer-memory transport stands on, checked one step at a time, so that a failed IPC
collective in bench/gpu_check.sh can be told from a machine that refuses CUDA IPC.

    mpiexec -n 2 python bench/ipc_smoke.py

Rank 0 exports a buffer outside CuPy's pool (``cupy.cuda.Memory``) and an interprocess event
recorded after filling it; rank 1 opens both, waits on the event on its own stream, reads
the buffer, then writes it; rank 0 reads what rank 1 wrote. Each rank prints the step it
reached and, on failure, the error (and aborts the job: its peer may wait in MPI); rank 0
prints ``cuda ipc smoke: ok`` at the end.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI

COUNT = 1 << 19  # float32: 2 MiB, one IPC granule


def main() -> int:
    comm = MPI.COMM_WORLD
    if comm.size != 2:
        print("run with mpiexec -n 2", file=sys.stderr)
        return 2
    rank, step = comm.rank, "importing CuPy"
    try:
        import cupy

        runtime = cupy.cuda.runtime
        step = "choosing the device"
        device = rank % runtime.getDeviceCount()
        cupy.cuda.Device(device).use()
        properties = runtime.getDeviceProperties(device)
        step = "allocating"
        stream = cupy.cuda.Stream(non_blocking=True)
        want = np.arange(COUNT, dtype=np.float32)
        if rank == 0:
            memory = cupy.cuda.Memory(COUNT * 4)
            mine = cupy.ndarray((COUNT,), np.float32, cupy.cuda.MemoryPointer(memory, 0))
            event = cupy.cuda.Event(disable_timing=True, interprocess=True)
            with stream:
                mine.set(want, stream=stream)
            event.record(stream)
            step = "exporting (ipcGetMemHandle, ipcGetEventHandle)"
            handles = (bytes(runtime.ipcGetMemHandle(memory.ptr)),
                       bytes(runtime.ipcGetEventHandle(event.ptr)))
        else:
            handles = None
        print(f"rank {rank}: device {device} ({properties['name'].decode()}), compute mode "
              f"{properties['computeMode']} (0: default; 3: exclusive-process refuses a second "
              "rank)", flush=True)
        step = "sending the handles over MPI"
        handles = comm.bcast(handles, root=0)
        if rank == 1:
            step = "opening the buffer (ipcOpenMemHandle)"
            pointer = runtime.ipcOpenMemHandle(handles[0])
            step = "opening the event (ipcOpenEventHandle)"
            opened_event = runtime.ipcOpenEventHandle(handles[1])
            step = "waiting on the event (streamWaitEvent)"
            runtime.streamWaitEvent(stream.ptr, opened_event, 0)
            step = "reading the peer's buffer"
            peer = cupy.ndarray((COUNT,), np.float32, cupy.cuda.MemoryPointer(
                cupy.cuda.UnownedMemory(pointer, COUNT * 4, None, device), 0))
            with stream:
                got = cupy.asnumpy(peer, stream=stream)
            stream.synchronize()
            if not np.array_equal(got, want):
                raise ValueError(f"read {got[:4]}... where rank 0 wrote {want[:4]}...")
            step = "writing the peer's buffer"
            with stream:
                peer[:] = -1
            stream.synchronize()
            print("rank 1: read and wrote rank 0's buffer", flush=True)
        step = "the barrier after rank 1's write"
        comm.Barrier()
        if rank == 0:
            step = "reading what rank 1 wrote"
            if not bool((mine == -1).all()):
                raise ValueError("rank 1's write is not in rank 0's buffer")
        step = "closing"
        if rank == 1:
            runtime.ipcCloseMemHandle(pointer)
            runtime.eventDestroy(opened_event)
        comm.Barrier()  # rank 0 frees only after rank 1 closed
        if rank == 0:
            print("cuda ipc smoke: ok", flush=True)
        return 0
    except Exception as error:  # the step and the error; the peer may wait in MPI: abort
        print(f"rank {rank}: cuda ipc smoke failed while {step}: {type(error).__name__}: "
              f"{error}", flush=True)
        time.sleep(0.5)  # time for the launcher to forward the line before the job ends
        comm.Abort(1)
        return 1


if __name__ == "__main__":
    sys.exit(main())
