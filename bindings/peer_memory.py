"""Device messages between ranks that can map each other's memory (CUDA IPC, or threads).

The protocol, NCCL's default in spirit: each rank owns one registered receive buffer (its
*inbox*, pycoll's own allocation, never a user array), and senders write into it directly.

1. ``irecv``: the receiver claims a slot of its inbox for this step, records its event (so
   that everything it already read from the inbox is ordered before the slot is written
   again), and sends the sender a *credit*: the inbox's handle, its event's handle, the
   slot's offset and size.
2. ``waitall``, sends first: for each credit, the sender opens the inbox (once per inbox)
   and the event (once per peer), orders its stream after the receiver's event, copies its
   data into the slot, records its own event and sends a *notice* (with its event's handle).
3. ``waitall``, receives: on each notice, the receiver orders its stream after the sender's
   event and copies the slot into place, or reduces it into place (``combine``), the fused
   read-reduce the executor asks for.

Forwarding (the ring's receive-reduce-send and receive-copy-send): an ``isend``
``produced_by`` a receive is written by that receive's ``combine`` itself, which gets the
peer's slot as a second argument and writes the data there as it writes its own (one pass,
where a reduction or copy and then a copy take two); its notice goes out right then.
Where a kernel on this device cannot reach the slot, ``combine`` gets None and the slot is
then copied. The credit must be there by then, so ranks that forward post their receives a
step ahead (pycoll/execute.py), and a slot is free for reuse once it has been delivered, not at the
end of a step; each step's slots are packed from the other end of the inbox than the
previous step's (``start_batch``), so the two fit in what the executor reserves (``reserve``).

Making an endpoint exchanges nothing (handles travel in the first credit and notice), so
two ranks can start talking without the rest of the group: Send/Recv's endpoints are made
by the pair alone.

Control messages are small host messages on two channels (credits, notices); all GPU work
is ordered by events on each rank's current stream, never by host synchronisation, so the
host returns as soon as everything is *enqueued*: the result is ready when the stream is.
Credits are posted before anyone waits, so without forwarding no rank waits for a message
that waits on it; a forward waits inside a delivery for a credit its peer posts a step
ahead, which tests/test_forwarding_model.py shows never closes a cycle.

One event per rank serves every purpose: a stream waits on the event's latest record at the
time of the wait, which is at or after the record the protocol needs, and every record that a
wait names was issued before that wait, so waits cannot form a cycle. "At or after" needs the
records in one order: when a call comes on another stream than the last, the new stream
first waits for the old one's work (the records the peers may still be waiting on).

Inboxes only grow; an outgrown inbox stays alive until :meth:`close`, because peers may still
have it mapped (freeing memory another process has open is undefined behaviour).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

HANDLE_BYTES = 64  # cudaIpcMemHandle_t and cudaIpcEventHandle_t are 64 bytes
_HANDLE_WORDS = HANDLE_BYTES // 8
# credit: inbox handle, event handle, capacity, offset, bytes; notice: bytes, event handle
_CREDIT_WORDS = 2 * _HANDLE_WORDS + 3
_NOTICE_WORDS = 1 + _HANDLE_WORDS
_COUNTS_DISAGREE = -1  # a notice's byte count when the sender found the counts differ


class PeerAccess(Protocol):
    """How one rank names its memory and events to another, and opens what it is given.
    ``interprocess``: whether the peers are other processes (their events must be made
    for IPC, which CUDA ties to a shared /dev/shm; threads of one process need not)."""

    interprocess: bool

    def export(self, allocation: Any) -> bytes: ...
    def open(self, handle: bytes, capacity: int) -> Any: ...
    def close(self, opened: Any) -> None: ...
    def export_event(self, event: Any) -> bytes: ...
    def open_event(self, handle: bytes) -> Any: ...
    def close_event(self, opened: Any) -> None: ...


class SameProcessAccess:
    """Peers that are threads of this process: a handle names an object in a registry."""

    interprocess = False

    def __init__(self) -> None:
        self._objects: dict[bytes, Any] = {}

    def _name(self, thing: Any) -> bytes:
        key = uuid.uuid4().bytes.ljust(HANDLE_BYTES, b"\0")
        self._objects[key] = thing
        return key

    def export(self, allocation: Any) -> bytes:
        return self._name(allocation)

    def open(self, handle: bytes, capacity: int) -> Any:
        return self._objects[handle]

    def close(self, opened: Any) -> None:
        pass

    export_event = export

    def open_event(self, handle: bytes) -> Any:
        return self._objects[handle]

    def close_event(self, opened: Any) -> None:
        pass


@dataclass
class _Inbox:
    allocation: Any
    handle: bytes
    capacity: int


class _Outgoing:
    __slots__ = ("buf", "peer", "tag", "credit", "credit_request", "notice", "notice_request",
                 "forwarded")

    def __init__(self, buf: Any, peer: int, tag: int, forwarded: bool = False):
        self.buf, self.peer, self.tag = buf, peer, tag
        self.credit = np.zeros(_CREDIT_WORDS, np.int64)
        self.notice = np.zeros(_NOTICE_WORDS, np.int64)  # kept here until it is sent
        self.credit_request = None
        self.notice_request = None
        self.forwarded = forwarded  # written by a receive's combine (``produced_by``)

    def done(self) -> bool:
        return self.notice_request is not None


class _Incoming:
    __slots__ = ("buf", "peer", "tag", "inbox", "offset", "combine", "credit", "credit_request",
                 "notice", "notice_request", "delivered", "forward")

    def __init__(self, buf, peer, tag, inbox, offset, combine):
        self.buf, self.peer, self.tag = buf, peer, tag
        self.inbox, self.offset, self.combine = inbox, offset, combine
        self.forward: _Outgoing | None = None  # the send this receive's combine writes
        self.credit = np.zeros(_CREDIT_WORDS, np.int64)
        self.credit_request = None
        self.notice = np.zeros(_NOTICE_WORDS, np.int64)
        self.notice_request = None
        self.delivered = False

    def done(self) -> bool:
        return self.delivered


def _words(handle: bytes) -> np.ndarray:
    return np.frombuffer(handle.ljust(HANDLE_BYTES, b"\0")[:HANDLE_BYTES], np.int64)


class PeerMemoryTransport:
    """One rank's device endpoint over peer-mapped memory (see the module docstring).

    ``space``: the device space (allocate, view, copy, events on the current stream);
    ``access``: how handles are exported and opened; ``credits`` and ``notices``: two host
    transports of the same group, used for the small control messages only.
    """

    delivers = True  # irecv takes ``combine``: the reduction reads the inbox directly
    # A slot lent to ``combine`` is rewritten only after the next irecv's event record, so
    # work queued on the stream before the next call still reads this step's data.
    lends_until_next_step = True
    forwards = True  # isend takes ``produced_by`` (see the module docstring)

    def __init__(
        self, space: Any, access: PeerAccess, credits: Any, notices: Any,
    ):
        self.space, self.access = space, access
        self.credits, self.notices = credits, notices
        self.rank, self.size = credits.rank, credits.size
        self.names = list(range(self.size))  # how errors name each rank of the group
        self._inboxes: list[_Inbox] = []
        self._claimed: list[tuple[int, int]] = []  # undelivered slots of the newest inbox
        # Where the next slot goes: a step's slots are packed from one end of the inbox, the
        # next step's (posted while these are still held) from the other.
        self._from_top = False
        self._edge = 0
        self._mapped: dict[tuple[int, bytes], Any] = {}  # (peer, handle) -> opened inbox
        self._event = space.new_event(interprocess=access.interprocess)
        self._event_words = _words(access.export_event(self._event))
        self._peer_events: dict[int, Any] = {}  # peer -> its event, opened on first message
        self._stream: Any = None  # the stream of the latest call

    def on_current_stream(self) -> None:
        """Order the current stream after the previous call's, when they differ."""
        stream = self.space.current_stream()
        previous = self._stream
        if previous is not None and getattr(previous, "ptr", previous) != getattr(
            stream, "ptr", stream
        ):
            with self.space.using(previous):
                self.space.record(self._event)  # after all of this endpoint's work there
            self.space.wait(self._event)
        self._stream = stream

    def _peer_event(self, peer: int, words: np.ndarray) -> Any:
        event = self._peer_events.get(peer)
        if event is None:
            event = self._peer_events[peer] = self.access.open_event(words.tobytes())
        return event

    def keep(self, incoming: Any) -> Any:
        """A copy of what a combine was lent (a view of an inbox slot), on the stream."""
        kept = self.space.empty(incoming.size, incoming.dtype)
        self.space.copy(kept, incoming)
        return kept

    # -- the two-sided interface

    def isend(self, buf: Any, peer: int, tag: int,
              produced_by: _Incoming | None = None) -> _Outgoing:
        """Send ``buf`` to ``peer``; with ``produced_by`` (a receive not yet waited for,
        with a ``combine``), the data is what that combine makes, written into the peer's
        slot by the combine itself (its second argument) when the receive is delivered."""
        self.on_current_stream()
        request = _Outgoing(buf, peer, tag, forwarded=produced_by is not None)
        if produced_by is not None:
            if produced_by.combine is None or produced_by.delivered or produced_by.forward:
                raise ValueError("produced_by must be a receive with a combine, not yet "
                                 "delivered, producing no other send")
            produced_by.forward = request
        request.credit_request = self.credits.irecv(request.credit, peer, tag)
        return request

    def irecv(
        self, buf: Any, peer: int, tag: int, combine: Callable[[Any], None] | None = None
    ) -> _Incoming:
        self.on_current_stream()
        inbox, offset = self._claim(buf.nbytes)
        request = _Incoming(buf, peer, tag, inbox, offset, combine)
        self.space.record(self._event)  # the slot's earlier readers, before its next writer
        request.credit[:_HANDLE_WORDS] = _words(inbox.handle)
        request.credit[_HANDLE_WORDS : 2 * _HANDLE_WORDS] = self._event_words
        request.credit[2 * _HANDLE_WORDS :] = (inbox.capacity, offset, buf.nbytes)
        request.credit_request = self.credits.isend(request.credit, peer, tag)
        request.notice_request = self.notices.irecv(request.notice, peer, tag)
        return request

    def waitall(self, requests: list) -> None:
        outgoing = [r for r in requests if isinstance(r, _Outgoing)]
        incoming = [r for r in requests if isinstance(r, _Incoming)]
        for r in outgoing:  # every credit was sent before its sender waited
            if not r.forwarded:
                self.credits.waitall([r.credit_request])
                self._write(r)
        for r in incoming:
            self.notices.waitall([r.notice_request])
            self._deliver(r)
        if any(r.notice_request is None for r in outgoing):
            raise RuntimeError("waited for a forwarded send before the receive producing it")
        self.credits.waitall([r.credit_request for r in incoming])
        self.notices.waitall([r.notice_request for r in outgoing])

    def sendrecv(self, send: Any, dst: int, recv: Any, src: int, tag: int) -> None:
        self.waitall([self.irecv(recv, src, tag), self.isend(send, dst, tag)])

    # -- the protocol's steps

    def reserve(self, nbytes: int) -> None:
        """Make the inbox at least ``nbytes`` now (what a call's steps will claim), rather
        than grow it claim by claim: an outgrown inbox is kept until :meth:`close`."""
        if nbytes and (not self._inboxes or self._inboxes[-1].capacity < nbytes):
            self._grow(nbytes)

    def start_batch(self) -> None:
        """The receives posted next belong to one step, posted while the previous step's
        slots are still held (posting ahead): pack them from the other end of the inbox."""
        self._from_top = bool(self._claimed) and not self._from_top
        self._edge = self._inboxes[-1].capacity if self._from_top else 0

    def _claim(self, nbytes: int) -> tuple[_Inbox, int]:
        """A slot of ``nbytes`` (16-byte aligned, for the vector kernels) in the inbox, clear
        of every slot not yet delivered."""
        if not self._claimed:  # nothing held (or no start_batch: not posting ahead): bottom
            self._from_top, self._edge = False, 0
        if self._from_top:
            offset = (self._edge - nbytes) // 16 * 16
        else:
            offset = -(-self._edge // 16) * 16
        if (not self._inboxes or offset < 0 or offset + nbytes > self._inboxes[-1].capacity
                or any(offset < stop and start < offset + nbytes
                       for start, stop in self._claimed)):
            self._grow(nbytes)
            offset = 0
        self._edge = offset if self._from_top else offset + nbytes
        self._claimed.append((offset, offset + nbytes))
        return self._inboxes[-1], offset

    def _grow(self, nbytes: int) -> None:
        """A new, empty inbox: peers may hold the old one open, so it is kept (not freed)
        until close, with any slots still claimed there."""
        least = max(nbytes, 2 * (self._inboxes[-1].capacity if self._inboxes else 0))
        allocation = self.space.allocate(least)
        self._inboxes.append(
            _Inbox(allocation, self.access.export(allocation), self.space.capacity(allocation))
        )
        self._claimed, self._from_top, self._edge = [], False, 0

    def _peer_slot(self, r: _Outgoing) -> Any:
        """The slot ``r``'s credit names in the peer's inbox, once its readers are done."""
        credit = r.credit
        handle = credit[:_HANDLE_WORDS].tobytes()
        capacity, offset, nbytes = (int(v) for v in credit[2 * _HANDLE_WORDS :])
        if nbytes != r.buf.nbytes:
            raise ValueError(
                f"rank {self.names[self.rank]} sends {r.buf.nbytes} bytes to rank "
                f"{self.names[r.peer]}, which expects {nbytes} (tag {r.tag}); the ranks "
                "disagree on counts"
            )
        key = (r.peer, handle)
        inbox = self._mapped.get(key)
        if inbox is None:
            inbox = self._mapped[key] = self.access.open(handle, capacity)
        target = self.space.view(inbox, offset, r.buf.size, r.buf.dtype)
        # the slot's previous reads are done
        self.space.wait(self._peer_event(r.peer, credit[_HANDLE_WORDS : 2 * _HANDLE_WORDS]))
        return target

    def _kernels_reach(self, slot: Any) -> bool:
        reach = getattr(self.space, "kernels_reach", None)  # only a device of its own knows
        return True if reach is None else reach(slot)

    def _notify(self, r: _Outgoing) -> None:
        """Tell ``r``'s peer its data is written (by what this rank just enqueued)."""
        self.space.record(self._event)
        r.notice[0] = r.buf.nbytes
        r.notice[1:] = self._event_words
        r.notice_request = self.notices.isend(r.notice, r.peer, r.tag)

    def _write(self, r: _Outgoing) -> None:
        try:
            slot = self._peer_slot(r)
        except ValueError:  # counts that disagree: the receiver is told, and raises too
            r.notice[0] = _COUNTS_DISAGREE
            r.notice_request = self.notices.isend(r.notice, r.peer, r.tag)
            raise
        self.space.copy(slot, r.buf.reshape(-1))
        self._notify(r)

    def _deliver(self, r: _Incoming) -> None:
        if r.notice[0] == _COUNTS_DISAGREE:
            raise ValueError(
                f"rank {self.names[self.rank]} expects {r.buf.nbytes} bytes from rank "
                f"{self.names[r.peer]} (tag {r.tag}), which sends another count; the ranks "
                "disagree on counts")
        incoming = self.space.view(r.inbox.allocation, r.offset, r.buf.size, r.buf.dtype)
        forward = r.forward
        if forward is not None:  # the peer's slot first: its credit may still be on the way
            self.credits.waitall([forward.credit_request])
            slot = self._peer_slot(forward)
        # the sender's copy into the slot is done
        self.space.wait(self._peer_event(r.peer, r.notice[1:]))
        if r.combine is None:
            self.space.copy(r.buf, incoming.reshape(r.buf.shape))
        elif forward is None:
            r.combine(incoming)
        elif self._kernels_reach(slot):
            r.combine(incoming, slot)
            self._notify(forward)
        else:  # a kernel here cannot write there: put in place, then copy as a send would
            r.combine(incoming, None)
            self.space.copy(slot, forward.buf.reshape(-1))
            self._notify(forward)
        r.delivered = True
        if r.inbox is self._inboxes[-1]:  # its readers are queued: the next claim's record
            self._claimed.remove((r.offset, r.offset + r.buf.nbytes))  # orders them first

    def close(self) -> None:
        """Wait for this endpoint's queued work (copies into peers' inboxes, reads of its
        own), then unmap peers' inboxes and events; the caller then synchronises the group
        before peers free theirs (an inbox must outlive every mapping of it and every copy
        into it)."""
        if self._stream is not None:  # calls on other streams were ordered before this one
            with self.space.using(self._stream):
                self.space.synchronize()
        for opened in self._mapped.values():
            self.access.close(opened)
        self._mapped.clear()
        for event in self._peer_events.values():
            self.access.close_event(event)
        self._peer_events.clear()

    def release(self) -> None:
        """Free this rank's inboxes: only after every peer has closed its mappings."""
        for inbox in self._inboxes:
            self.space.free(inbox.allocation)
        self._inboxes.clear()
