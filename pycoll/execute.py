"""Run one rank's steps of a schedule over a transport, with a reducer.

The executor is algorithm-blind: it sees chunks, peers and "copy or reduce", never which
family emitted them. For each step it posts the receives (into the work chunk for a copy, into
scratch for a reduction), posts the sends, waits for all, then reduces in the listed order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pycoll.bindings.transport import Transport
from pycoll.schedule import Buffer, Layout, Recv, Schedule, seeded_chunks

Reducer = Callable[[np.ndarray, np.ndarray], None]  # reduce_into(dst, src) in place


@dataclass(frozen=True)
class Buffers:
    """One rank's flat views of INPUT and WORK, and how each is cut into chunks."""

    input: np.ndarray
    work: np.ndarray
    input_layout: Layout
    work_layout: Layout

    def chunk(self, buffer: Buffer, chunk: int) -> np.ndarray:
        if buffer is Buffer.INPUT:
            start, stop = self.input_layout.chunk_range(chunk)
            return self.input[start:stop]
        start, stop = self.work_layout.chunk_range(chunk)
        return self.work[start:stop]


def execute(
    schedule: Schedule,
    rank: int,
    buffers: Buffers,
    transport: Transport,
    tag: int,
    reduce_into: Reducer,
) -> None:
    """Seed WORK from INPUT as the contract says, then run ``rank``'s steps in order."""
    for input_chunk, work_chunk in seeded_chunks(schedule, rank):
        source = buffers.chunk(Buffer.INPUT, input_chunk)
        target = buffers.chunk(Buffer.WORK, work_chunk)
        if not np.shares_memory(source, target):
            target[...] = source
    steps = schedule.steps[rank]
    if not steps:
        return
    scratch = np.empty(_scratch_elements(steps, buffers.work_layout), buffers.work.dtype)
    for step in steps:
        requests = []
        reductions = []
        used = 0
        for transfer in step:  # receives first, so that sends find them posted
            if not isinstance(transfer, Recv):
                continue
            target = buffers.chunk(Buffer.WORK, transfer.chunk)
            if target.size == 0:  # both sides know the size from the same counts
                continue
            if transfer.reduce:
                incoming = scratch[used : used + target.size]
                used += target.size
                reductions.append((target, incoming))
                requests.append(transport.irecv(incoming, transfer.peer, tag))
            else:
                requests.append(transport.irecv(target, transfer.peer, tag))
        for transfer in step:
            if isinstance(transfer, Recv):
                continue
            source = buffers.chunk(transfer.buffer, transfer.chunk)
            if source.size:
                requests.append(transport.isend(source, transfer.peer, tag))
        transport.waitall(requests)
        for target, incoming in reductions:
            reduce_into(target, incoming)


def _scratch_elements(steps, layout: Layout) -> int:
    """The most elements any one step receives for reduction."""
    most = 0
    for step in steps:
        size = 0
        for transfer in step:
            if isinstance(transfer, Recv) and transfer.reduce:
                start, stop = layout.chunk_range(transfer.chunk)
                size += stop - start
        most = max(most, size)
    return most
