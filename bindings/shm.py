"""Host messages between the ranks of one node through shared memory (MPI-3 shared windows).

Each rank owns one *segment* of a shared window that every rank of its node maps
(``MPI.Win.Allocate_shared`` on the ``COMM_TYPE_SHARED`` communicator; in-process ranks share
plain arrays). A segment holds:

* control words, one per 64-byte line so that no two writers share a cache line:
  ``head[d]``, the bytes this rank has written into its stream to local rank d, and
  ``tail[s]``, the bytes it has consumed of local rank s's stream to it; each word has one
  writer (single-producer, single-consumer), so plain stores suffice, ordered by fences;
* one ring per local rank (its own stays unused, and untouched): the byte stream of its
  messages to that peer. A message is a run
  of records, each a 64-byte header (kind, tag, bytes, the message's total, where) and, for an
  inline record, its payload padded to 64 bytes. A message longer than a quarter of the ring
  travels in pieces, so the receiver reduces piece k while the sender copies piece k+1;
* two slots for calls made in one round (see :meth:`SharedMemoryTransport.publish_small`:
  the one-shot AllReduce and the small ReduceScatter, AllGather, Broadcast and Reduce).

A send whose buffer already lies in a shared window (:func:`pycoll.empty`) is not copied: its
record names the window and offset, the receiver reads (or reduces) the data where it lies,
and the send completes when the receiver's tail has passed the record. A long send from a
plain array is not copied either where Linux lets ranks read each other's memory (cross-memory
attach, ``process_vm_readv``, as MPICH and Open MPI use): its record names the address, and
the receiver copies it straight into place, or reads it in cache-sized pieces that it reduces
at once; ``PYCOLL_SHM_CMA=0`` turns this off. Messages between two
ranks match in posting order; the tag and total size in each header are checked, so ranks
that disagree on a call get an error naming both, not a wrong result.

Memory ordering: the writer fences (``MPI_Win_sync``, a full barrier) between writing data and
publishing the counter that covers it; the reader fences between reading a counter and reading
the data it covers, and again before publishing its tail. Waits spin briefly, then yield the
core, so more ranks than cores still make progress.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pycoll.bindings.transport import SAME_CALL, ChannelsCrossed, PeerFailed, WaitTimeout
from pycoll.settings import switch, whole_number

LINE = 64  # bytes of a cache line; every header and payload starts on one
_WORDS = LINE // 8
WRAP, INLINE, IN_WINDOW, IN_PROCESS = 1, 2, 3, 4  # record kinds
CMA_MIN_BYTES = 64 << 10  # from here on, a plain array is read from its owner's memory
CMA_PIECE = 256 << 10  # a reduction reads a peer's array in pieces this large (cache-sized)
MIN_PIECE = 4096  # less contiguous room than this before the ring's end: wrap instead
SPINS = 200  # polls before a waiting rank starts yielding its core
PAGE = 4096  # what the OS maps at a time: MPI gives each rank's part of a window whole pages
RING_BYTES = 8 << 20  # per peer: the stream to that peer
SMALL_BYTES = 2 << 20  # one-shot AllReduce slot; larger calls take the schedules
MAX_ENV_BYTES = 1 << 30  # the most either may be set to (each is per rank or per peer)
SMALL_VIEWS_KEPT = 1024  # (dtype, count) shapes of one-shot calls whose slot views are kept
_FROM_PROCESS = -2  # a send's ``window`` when the receiver reads the sender's own memory
_NEVER = float("inf")  # no deadline (float("inf") costs a call, on every small call)


def _env_bytes(name: str, default: int) -> int:
    # past MAX_ENV_BYTES numpy raised a bare MemoryError, or the node ran out of shared memory
    value = whole_number(name, 4 * MIN_PIECE, MAX_ENV_BYTES, "bytes")
    return default if value is None else value // LINE * LINE


# Windows this process may hold at once: each takes one of MPI's context ids, which
# communicators take too (MPICH has 2048, and segfaults in Win_allocate_shared past them)
MAX_WINDOWS = 1024


class MpiSegments:
    """Segments of one ``MPI.Win.Allocate_shared`` window on a node communicator."""

    held = 0  # windows of this process not yet freed

    def __init__(self, node_comm: Any, nbytes: int):
        from mpi4py import MPI

        self.comm = node_comm
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")  # each segment on its owner's pages
        self.win = MPI.Win.Allocate_shared(nbytes, 1, info, comm=node_comm)
        info.Free()
        self.win.Lock_all(MPI.MODE_NOCHECK)  # the passive epoch Win.Sync needs
        self.index = node_comm.Get_rank()
        self.segments = [
            np.frombuffer(self.win.Shared_query(r)[0], np.uint8)
            for r in range(node_comm.Get_size())
        ]
        self.fence = self.win.Sync
        MpiSegments.held += 1

    def barrier(self) -> None:
        self.comm.Barrier()

    def free(self) -> None:
        """Collective over the node: every rank of it frees its window together."""
        self.segments = []
        self.win.Unlock_all()
        self.win.Free()
        MpiSegments.held -= 1


class ThreadSegments:
    """Segments for ranks that are threads of one process (tests, the in-process world):
    every rank of the node constructs one with the same ``key``; each makes its own segment,
    then waits for the others'. ``ranks``: the node's ranks (what ``check`` is told)."""

    def __init__(self, shared: dict, key: Any, index: int, ranks: list[int], nbytes: int,
                 check: Callable[[list[int], bool], None] | None = None,
                 timeout: float | None = None):
        count = len(ranks)
        self.segments = shared.setdefault((key, "segments"), [None] * count)
        self._state = shared.setdefault((key, "barrier"), _ThreadBarrier(count))
        self._shared, self._key = shared, key
        self._check, self._ranks, self._timeout = check, ranks, timeout
        self.index = index
        self.segments[index] = np.zeros(nbytes, np.uint8)
        self.barrier()

    def fence(self) -> None:
        pass  # threads of one process: the GIL orders Python-level stores and loads

    def barrier(self) -> None:
        """Wait for every rank of the node; past the timeout, WaitTimeout naming the others."""
        deadline = None if self._timeout is None else time.monotonic() + self._timeout

        moved = [True]  # this rank's arrival, before its first look

        def check(missing: list[int]) -> None:
            ranks = [self._ranks[i] for i in missing]
            if self._check:
                self._check(ranks, moved[0])
                moved[0] = False
            if deadline is not None and time.monotonic() > deadline:
                raise WaitTimeout(ranks, self._timeout)

        self._state.wait(self.index, check, 0.5 if deadline is None else min(0.5, self._timeout))

    def free(self) -> None:
        self.segments[self.index] = None  # the shared list outlives this rank's hold on it
        if all(segment is None for segment in self.segments):  # the last rank to free
            self._shared.pop((self._key, "segments"), None)  # (a world that lives on kept
            self._shared.pop((self._key, "barrier"), None)  # every freed one's entries)
        self.segments = []


class _ThreadBarrier:
    """A reusable barrier that, while waiting, asks ``check`` about the ranks still missing
    (so a rank that returned early is reported, not waited for)."""

    def __init__(self, count: int):
        self._condition = threading.Condition()
        self._count = count
        self._arrived: set[int] = set()
        self._generation = 0

    def wait(self, index: int, check: Callable[[list[int]], Any], every: float = 0.5) -> None:
        with self._condition:
            generation = self._generation
            self._arrived.add(index)
            if len(self._arrived) == self._count:
                self._arrived = set()
                self._generation += 1
                self._condition.notify_all()
                return
            while self._generation == generation:
                # timed out, but the round may have ended while the lock was retaken: the
                # arrivals are then the next round's (a rank was named as waiting for itself)
                if not self._condition.wait(timeout=every) and self._generation == generation:
                    missing = [i for i in range(self._count) if i not in self._arrived]
                    self._condition.release()
                    try:
                        check(missing)
                    finally:
                        self._condition.acquire()


class _Send:
    __slots__ = ("peer", "bytes", "sent", "tag", "total", "window", "offset", "until", "prev",
                 "done_")

    def __init__(self, peer: int, data: np.ndarray, tag: int):
        self.peer, self.bytes, self.tag = peer, data, tag
        self.total = data.nbytes
        self.sent = 0
        self.window = -1  # >= 0: the data lies in this window, at ``offset``; _FROM_PROCESS:
        # the receiver reads it from this process's memory at ``offset`` (an address)
        self.offset = 0
        self.until = -1  # zero-copy: done once the receiver's tail reaches this
        self.prev: _Send | None = None  # the send before it to the same peer
        self.done_ = self.total == 0

    def done(self) -> bool:
        return self.done_


class _Recv:
    __slots__ = ("peer", "buf", "bytes", "received", "tag", "total", "combine", "after", "prev",
                 "done_")

    def __init__(self, peer: int, buf: np.ndarray, tag: int, combine):
        self.peer, self.buf, self.tag, self.combine = peer, buf, tag, combine
        self.bytes = buf.view(np.uint8)
        self.total = buf.nbytes
        self.received = 0
        self.after: _Recv | None = None  # the combining receive that must finish first
        self.prev: _Recv | None = None  # the receive before it from the same peer
        self.done_ = self.total == 0

    def done(self) -> bool:
        return self.done_


class SharedMemoryTransport:
    """One rank's endpoint to the ranks of its node (see the module docstring).

    ``segments``: the node's shared segments (``MpiSegments`` or ``ThreadSegments``), made
    with at least :func:`segment_bytes` bytes each; ``local``: the ranks (of this transport's
    group) on this node, in segment order; ``check(ranks, moved)``: called now and then while
    waiting for ``ranks`` (``moved``: whether this rank wrote or read anything since its last
    call), raises if the group failed or those ranks can no longer send (in-process).
    """

    delivers = True  # irecv takes ``combine``: reductions read the ring or window in place

    @staticmethod
    def keep(incoming: np.ndarray) -> np.ndarray:
        """A copy of what a combine was lent (a view of the ring, valid during the call)."""
        return incoming.copy()

    def __init__(
        self, segments: Any, rank: int, size: int, local: list[int],
        ring_bytes: int = RING_BYTES, small_bytes: int = SMALL_BYTES,
        check: Callable[[list[int], bool], None] | None = None,
    ):
        self.rank, self.size, self.local = rank, size, list(local)
        self.peers = self.local  # the ranks this endpoint reaches
        self._segments = segments
        self._fence = segments.fence
        self._check = check
        self._moved = True  # what check is told: see waitall
        self._index = {r: i for i, r in enumerate(self.local)}
        self._me = self._index[rank]
        count = len(self.local)
        self._ring = ring_bytes
        # more ranks than cores: a spinning rank holds the core its peer needs, so yield at once
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        self._spins = SPINS if count <= cores else 0
        self._piece = max(MIN_PIECE, ring_bytes // 4 // LINE * LINE)
        self.small_bytes = small_bytes
        self.timeout: float | None = None  # seconds each wait may take (None: no deadline)
        self._deadline = _NEVER
        layout = _Layout(count, ring_bytes, small_bytes)
        self._layout = layout
        seg = segments.segments
        self._control = [s[: layout.control].view(np.int64) for s in seg]
        self._my_control = self._control[self._me]
        self._peer_controls = [(i, c) for i, c in enumerate(self._control) if i != self._me]
        # the same words as memoryviews, for the one-shot's hot path: an index reads or
        # writes one aligned int64 as numpy's does, but gives a Python int (no numpy scalar)
        self._my_words = memoryview(self._my_control)
        self._peer_words = [(i, memoryview(c)) for i, c in self._peer_controls]
        self._head_word = layout.head(self._me)  # in a peer's control: its stream to me
        self._tail_word = layout.tail(self._me)  # in a peer's control: what it read of mine
        self._my_control[:] = 0  # MPI does not zero a window; peers read it after a barrier
        # my stream to peer i, and peer i's stream to me
        self._out = [seg[self._me][layout.ring(i) : layout.ring(i) + ring_bytes]
                     for i in range(count)]
        self._in = [seg[i][layout.ring(self._me) : layout.ring(self._me) + ring_bytes]
                    for i in range(count)]
        self._out_words = [r.view(np.int64) for r in self._out]
        self._in_words = [r.view(np.int64) for r in self._in]
        self._heads = [0] * count  # mirrors of my control words
        self._last_send: list[_Send | None] = [None] * count
        self._tails = [0] * count
        self._small_seq = 0
        self._small_views: dict[tuple, tuple] = {}
        self.ops: dict[tuple, tuple] = {}  # (dtype, op as given) -> (op, reducer, call, ufunc)
        self._readable = [False] * count  # peers whose memory this rank can read (CMA)
        self._read_by = [False] * count  # peers that can read this rank's memory
        self._scratch: np.ndarray | None = None  # a reduction's piece of a peer's array
        self._windows: list[Any] = []  # segments of pycoll.empty's windows, by id
        self._window_spans: list[tuple[int, int, int]] = []  # (start, stop, id) of mine

    def connect(self) -> None:
        """Collective over the node, once the segments exist: publish this process's id and
        a probe word, then find which peers' memory this rank can read (cross-memory
        attach), and tell them."""
        self._segments.barrier()
        count = len(self.local)
        # Fault every page this rank will use in now, not one at a time inside collectives
        # (and so that the resident set does not creep up as the rings first fill).
        page = PAGE
        for i, ring in enumerate(self._out):
            if i != self._me:
                ring[::page] = 0
        for parity in (0, 1):
            start = self._layout.slot(parity)
            self._segments.segments[self._me][start : start + self.small_bytes : page] = 0
        self._probe = np.array([0x5EED + self._me], np.int64)
        at = self._layout.identity
        self._my_control[at] = os.getpid()
        self._my_control[at + 1] = self._probe.ctypes.data
        self._segments.barrier()
        mask = 0
        if _cma_enabled() and count <= 63:
            for i, control in self._peer_controls:
                word = np.zeros(1, np.int64)
                if _read_process(int(control[at]), int(control[at + 1]), word) and \
                        word[0] == 0x5EED + i:
                    self._readable[i] = True
                    mask |= 1 << i
        self._my_control[at + 2] = mask
        self._segments.barrier()
        for i, ring in enumerate(self._in):  # peers' pages this rank reads
            if i != self._me:
                int(ring[::page].sum())
                for parity in (0, 1):
                    start = self._layout.slot(parity)
                    int(self._segments.segments[i][start : start + self.small_bytes : page].sum())
        for i, control in self._peer_controls:
            self._read_by[i] = bool(int(control[at + 2]) >> self._me & 1)
        self._pids = [int(c[at]) for c in self._control]

    # -- the two-sided interface

    def isend(self, buf: np.ndarray, peer: int, tag: int) -> _Send:
        data = buf.reshape(-1).view(np.uint8)
        i = self._index[peer]
        request = _Send(i, data, tag)
        if request.done_:
            return request
        if self._window_spans:
            self._locate(request)
        if request.window == -1 and request.total >= CMA_MIN_BYTES and self._read_by[i]:
            request.window, request.offset = _FROM_PROCESS, data.ctypes.data
        last = self._last_send[i]  # a stream carries one message at a time, in order
        if last is not None and last.sent < last.total:
            request.prev = last
        self._last_send[i] = request
        self._push(request)  # eager: as much as the ring takes now
        return request

    def irecv(
        self, buf: np.ndarray, peer: int, tag: int, combine: Callable[..., None] | None = None
    ) -> _Recv:
        return _Recv(self._index[peer], buf.reshape(-1), tag, combine)

    def waitall(self, requests: list) -> None:
        # Reductions run in the listed order (a fused first one overwrites what it seeds),
        # so a combining receive waits for the one before it; copies go as data comes.
        # Likewise a stream is read one message at a time, in posting order.
        before = None
        latest: dict[int, _Recv] = {}
        for r in requests:
            if type(r) is _Recv and not r.done_:
                r.prev = latest.get(r.peer)
                latest[r.peer] = r
                if r.combine is not None:
                    r.after, before = before, r
        pending = [r for r in requests if not r.done_]
        idle = 0
        self._moved = True  # (for check) this rank may have written since its last look
        self._deadline = _NEVER if self.timeout is None else time.monotonic() + self.timeout
        crossed = None  # made at the first idle poll: most waits never poll idly
        while pending:
            progressed = False
            for r in pending:
                if (self._pull(r) if type(r) is _Recv else self._push(r)):
                    progressed = True
            pending[:] = [r for r in pending if not r.done_]  # in place: crossed reads it
            if progressed:
                idle = 0
                self._moved = True
            elif pending:
                if crossed is None:
                    def crossed(pending: list = pending) -> None:
                        self._not_gone_to_a_one_shot(pending)
                idle = self._idle(idle, {r.peer for r in pending}, crossed)

    def _not_gone_to_a_one_shot(self, pending: list) -> None:
        """Ranks that disagree on a call's size can take different channels (sizes on both
        sides of the one-shot limit): a peer in a later one-shot call (its flag past this
        rank's) has finished the call this rank waits in, so a message still to come from it,
        or still to go to it, will never move."""
        flag = self._layout.small_flag
        for r in pending:
            control = self._control[r.peer]
            if control[flag] <= self._small_seq:
                continue
            self._fence()  # then what the peer wrote before its flag: its head, its tail
            sending = type(r) is _Send
            if sending:
                if self._push(r) or r.done_:  # its reader finished just now
                    continue
            elif int(control[self._head_word]) != self._tails[r.peer]:
                continue  # data to read first
            raise self._give_up(ChannelsCrossed(
                f"rank {self.rank} waits in the rings to {'send' if sending else 'receive'} "
                f"{r.total} bytes {'to' if sending else 'from'} rank "
                f"{self.local[r.peer]}, which has gone on to a small call through the "
                f"one-shot slots; the ranks disagree on the call ({SAME_CALL})"))

    def sendrecv(self, send: np.ndarray, dst: int, recv: np.ndarray, src: int, tag: int) -> None:
        self.waitall([self.irecv(recv, src, tag), self.isend(send, dst, tag)])

    def _idle(self, idle: int, peers: Any = (), crossed: Callable[[], None] | None = None
              ) -> int:
        """One more poll that found nothing; ``peers``: the local ranks (indices) awaited;
        ``crossed``: now and then, raises if those peers are in the other channel."""
        idle += 1
        if idle > self._spins:
            if idle & 1023 == 0:
                for i in peers:
                    if self._control[i][self._layout.gave_up]:
                        raise self._give_up(ChannelsCrossed(
                            f"rank {self.rank} waits for rank {self.local[i]}, which gave up "
                            "the call: the ranks disagree on it (its error names how)"))
                if crossed is not None:
                    crossed()
                if self._check is not None:
                    self._check([self.local[i] for i in peers], self._moved)
                    self._moved = False
                if time.monotonic() > self._deadline:
                    raise WaitTimeout(sorted(self.local[i] for i in peers), self.timeout)
            os.sched_yield() if idle < 20000 else time.sleep(50e-6)
        return idle

    def _give_up(self, error: ChannelsCrossed) -> ChannelsCrossed:
        """Say so in this rank's control line before raising ``error``: a peer waiting for
        this rank in a channel it will never use (a one-shot's flag, a ring no message will
        reach) raises too, instead of waiting forever."""
        self._my_control[self._layout.gave_up] = 1
        return error

    # -- sending

    def _locate(self, request: _Send) -> None:
        """Zero-copy when the data lies in one of this rank's shared windows."""
        start = request.bytes.__array_interface__["data"][0]
        stop = start + request.total
        for lo, hi, window in self._window_spans:
            if lo <= start and stop <= hi:
                request.window, request.offset = window, start - lo
                return

    def _push(self, s: _Send) -> bool:
        """Write what fits of ``s`` into the ring; True if anything moved."""
        if s.prev is not None:
            if s.prev.sent < s.prev.total:
                return False
            s.prev = None
        i = s.peer
        ring, words, size = self._out[i], self._out_words[i], self._ring
        head = self._heads[i]
        tail = int(self._control[i][self._tail_word])
        if s.until >= 0:  # zero-copy, already posted: done once the receiver read it
            if tail >= s.until:
                s.done_ = True
                return True
            return False
        progressed = False
        while s.sent < s.total:
            free = size - (head - tail)
            pos = head % size
            to_end = size - pos
            if s.window != -1:  # one header names where the data lies (a line always fits)
                if free < LINE:
                    break
                w = pos // 8
                words[w + 1 : w + 6] = (s.tag, s.total, s.total, s.offset, s.window)
                words[w] = IN_WINDOW if s.window >= 0 else IN_PROCESS
                head += LINE
                s.sent = s.total
                s.until = head
                progressed = True
                break
            want = min(s.total - s.sent, self._piece)
            room = to_end - LINE
            if room < want and room < MIN_PIECE:
                if free < to_end:
                    break
                words[pos // 8] = WRAP
                head += to_end
                progressed = True
                continue
            n = min(want, room, free - LINE)
            if n < want:
                n -= n % LINE
            if n <= 0:
                break
            ring[pos + LINE : pos + LINE + n] = s.bytes[s.sent : s.sent + n]
            w = pos // 8
            words[w + 1] = s.tag
            words[w + 2] = n
            words[w + 3] = s.total
            words[w] = INLINE
            head += LINE + -(-n // LINE) * LINE
            s.sent += n
            progressed = True
        if progressed:
            self._fence()  # the records before the head that covers them
            self._heads[i] = head
            self._my_control[self._layout.head(i)] = head
            if s.until < 0 and s.sent == s.total:
                s.done_ = True  # inline: the data is in the ring; the buffer is free
        return progressed

    # -- receiving

    def _pull(self, r: _Recv) -> bool:
        """Consume what has arrived of ``r``; True if anything did."""
        if (r.after is not None and not r.after.done_) or (r.prev is not None and
                                                            not r.prev.done_):
            return False
        i = r.peer
        head = int(self._control[i][self._head_word])
        tail = self._tails[i]
        if head == tail:
            return False
        self._fence()  # the records below head, after reading head
        ring, words, size = self._in[i], self._in_words[i], self._ring
        while tail < head and r.received < r.total:
            pos = tail % size
            w = pos // 8
            kind, tag, n, total, offset, window = words[w : w + 6].tolist()
            if kind == WRAP:
                tail += size - pos
                continue
            if tag != r.tag or total != r.total:
                raise self._give_up(ChannelsCrossed(
                    f"rank {self.rank} expects {r.total} bytes from rank {self.local[i]} "
                    f"(tag {r.tag}), which sends {total} (tag {tag}); the ranks disagree on the "
                    "call"
                ))
            if kind == IN_PROCESS:
                self._read_from(i, offset, n, r)
                tail += LINE
                continue
            if kind == INLINE:
                incoming = ring[pos + LINE : pos + LINE + n]
                step = LINE + -(-n // LINE) * LINE
            else:
                incoming = self._windows[window].segments[i][offset : offset + n]
                step = LINE
            if r.combine is None:
                r.bytes[r.received : r.received + n] = incoming
            else:
                itemsize = r.buf.itemsize
                r.combine(incoming.view(r.buf.dtype), r.received // itemsize)
            r.received += n
            tail += step
        self._fence()  # reads of the records before the tail that frees them
        self._tails[i] = tail
        self._my_control[self._layout.tail(i)] = tail
        if r.received == r.total:
            r.done_ = True
        return True

    def _read_from(self, i: int, address: int, n: int, r: _Recv) -> None:
        """Read ``n`` bytes at ``address`` in local peer i's process into ``r``: straight into
        place for a copy; in cache-sized pieces, each reduced at once, for a reduction."""
        def read(at: int, into: np.ndarray) -> None:
            if not _read_process(self._pids[i], at, into):
                raise PeerFailed(f"rank {self.rank}: reading rank {self.local[i]}'s memory "
                                 "failed (process_vm_readv): has that rank ended or failed?")

        if r.combine is None:
            read(address, r.bytes[r.received : r.received + n])
            r.received += n
            return
        itemsize = r.buf.itemsize
        piece = CMA_PIECE - CMA_PIECE % itemsize
        if self._scratch is None:
            self._scratch = np.empty(CMA_PIECE, np.uint8)
        for start in range(0, n, piece):
            size = min(piece, n - start)
            into = self._scratch[:size]
            read(address + start, into)
            r.combine(into.view(r.buf.dtype), (r.received + start) // itemsize)
        r.received += n

    # -- the one-shot AllReduce

    def allgather_small(self, x: np.ndarray) -> np.ndarray:
        """Every rank's ``x`` (flat, at most ``small_bytes``, alike on every rank) as the rows
        of a new array, in rank order, in one round."""
        return np.stack(self.publish_small(x, "allgather"))

    def publish_small(self, x: np.ndarray, collective: str, call: int = 0) -> tuple:
        """Copy ``x`` into this rank's slot, publish a sequence number, wait for every peer's;
        returns every rank's slot (flat views), which may be read until this rank's next call.
        Two slots alternate: a rank writes slot s at call k only after seeing every peer reach
        call k-1, i.e. after they finished reading slot s at call k-2. ``call``: a number for
        the rest of what every rank must pass alike (op, root, counts), compared too."""
        seq = self._small_seq + 1
        key = (x.dtype, x.size)
        entry = self._small_views.get(key)
        if entry is None:
            if len(self._small_views) >= SMALL_VIEWS_KEPT:  # sizes that vary call to call
                self._small_views.clear()
            # what every rank must agree on: count and dtype, in one word
            entry = (self._slot_views(x.dtype, x.size), x.size << 16 | _dtype_number(x.dtype))
            self._small_views[key] = entry
        views, signature = entry
        slots = views[seq & 1]
        self._deadline = _NEVER if self.timeout is None else time.monotonic() + self.timeout
        self._moved = True
        slots[self._me][...] = x
        flag = self._layout.small_flag
        agreed = flag + 1 + (seq & 1)  # per slot: a peer one call ahead writes the other
        mine = self._my_words
        mine[agreed] = signature
        mine[agreed + 2] = call
        self._fence()
        mine[flag] = seq
        for i, control in self._peer_words:
            if control[flag] < seq:
                idle = 0

                def crossed(i: int = i, control: memoryview = control) -> None:
                    # a peer behind this call with a message in the rings for this rank
                    # (which finished every call before): it took the rings for this one;
                    # unless it has just published (then pushed a later call's message)
                    if control[self._head_word] == self._tails[i]:
                        return
                    self._fence()
                    if control[flag] < seq:
                        self._small_seq = seq  # published: spent, as below
                        raise self._give_up(ChannelsCrossed(
                            f"{collective}: rank {self.rank} passed {x.size} elements of "
                            f"{x.dtype} (a small call, through the one-shot slots) but rank "
                            f"{self.local[i]} sends it a message through the rings; {SAME_CALL}"))

                while control[flag] < seq:
                    idle = self._idle(idle, (i,), crossed)
        self._fence()
        self._small_seq = seq  # published, so spent even when the ranks disagree below
        for i, control in self._peer_words:
            if control[agreed] != signature:
                theirs = control[agreed]
                raise ValueError(
                    f"{collective}: rank {self.rank} passed {x.size} elements of {x.dtype} but "
                    f"rank {self.local[i]} passed {theirs >> 16} of "
                    f"{_dtype_name(theirs & 0xFFFF)}; {SAME_CALL}")
            if control[agreed + 2] != call:
                raise ValueError(
                    f"{collective}: rank {self.rank} and rank {self.local[i]} passed a "
                    "different collective, op, root or counts; every rank must pass the same "
                    "(PYCOLL_CHECK=1 names which)")
        return slots

    def _slot_views(self, dtype: np.dtype, count: int) -> tuple:
        layout = self._layout
        return tuple(
            tuple(
                s[layout.slot(parity) : layout.slot(parity) + count * dtype.itemsize].view(dtype)
                for s in self._segments.segments
            )
            for parity in (0, 1)
        )

    # -- windows for user arrays (pycoll.empty)

    def add_window(self, segments: Any) -> np.ndarray:
        """Register a window every local rank made in the same call; returns this rank's
        segment. Sends from it are not copied."""
        window = len(self._windows)
        self._windows.append(segments)
        mine = segments.segments[self._me]
        start = mine.__array_interface__["data"][0]
        self._window_spans.append((start, start + mine.nbytes, window))
        return mine

    def free(self) -> None:
        """Collective over the node: release the rings and every window."""
        for window in self._windows:
            window.free()
        self._windows, self._window_spans = [], []
        self._control, self._out, self._in, self._out_words, self._in_words = [], [], [], [], []
        self._small_views.clear()
        self._segments.free()


class _Layout:
    """Where each part of a segment lies (the same on every rank of the node)."""

    def __init__(self, count: int, ring_bytes: int, small_bytes: int):
        self.count = count
        self.small_flag = 2 * count * _WORDS
        self.identity = (2 * count + 1) * _WORDS  # pid, probe address, peers readable
        self.gave_up = self.identity + 3  # nonzero once this rank raised ChannelsCrossed
        self.control = (2 * count + 2) * LINE
        self._slots = self.control
        self._small = small_bytes
        self._rings = self.control + 2 * small_bytes
        self._ring = ring_bytes
        self.bytes = self._rings + count * ring_bytes

    def head(self, peer: int) -> int:
        return peer * _WORDS

    def tail(self, peer: int) -> int:
        return (self.count + peer) * _WORDS

    def slot(self, parity: int) -> int:
        return self._slots + parity * self._small

    def ring(self, peer: int) -> int:
        return self._rings + peer * self._ring


def segment_bytes(count: int, ring_bytes: int = RING_BYTES, small_bytes: int = SMALL_BYTES) -> int:
    """Bytes of one rank's segment for a node of ``count`` ranks."""
    return _Layout(count, ring_bytes, small_bytes).bytes


def node_bytes_touched(count: int, ring_bytes: int = RING_BYTES,
                       small_bytes: int = SMALL_BYTES) -> int:
    """Bytes of memory the segments of a node of ``count`` ranks take once touched: a rank's
    ring to itself never is (no pages); none where a rank is alone."""
    if count < 2:
        return 0
    return (segment_bytes(count, ring_bytes, small_bytes) - ring_bytes) * count


def available_memory() -> int | None:
    """Bytes of memory this machine can still give (Linux's MemAvailable: free, and caches
    it can drop), else its free pages; None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


SHARED_MEMORY_FOLDER = "/dev/shm"  # where MPICH and Open MPI keep shared windows' files


def shared_memory_free(folder: str = SHARED_MEMORY_FOLDER) -> int | None:
    """Bytes a new shared window may still take on this node: ``folder``'s free space (a
    container's /dev/shm is often 64 MiB, and touching a window past it kills the process with
    SIGBUS), and no more than the memory Linux can still give; None where neither is known."""
    try:
        stat = os.statvfs(folder)
        free: int | None = stat.f_bavail * stat.f_frsize
    except OSError:
        free = None
    memory = available_memory()
    known = [n for n in (free, memory) if n is not None]
    return min(known) if known else None


def ring_bytes_from_env() -> int:
    return _env_bytes("PYCOLL_SHM_RING_BYTES", RING_BYTES)


def _dtype_number(dtype: np.dtype) -> int:
    """``dtype``'s number, the same for equal dtypes (int64 and longlong differ in ``num``)."""
    if dtype.kind in "biufc":
        dtype = np.dtype(dtype.str)
    return dtype.num & 0xFFFF


def _dtype_name(number: int) -> str:
    """The name of the numpy dtype whose ``num`` is ``number`` (as far as numpy knows it)."""
    import ml_dtypes  # bfloat16: a dtype numpy numbers when ml_dtypes registers it

    for dtype in (*map(np.dtype, np.typecodes["All"]), np.dtype(ml_dtypes.bfloat16)):
        if dtype.num & 0xFFFF == number:
            return str(dtype)
    return f"dtype number {number}"


def cma_setting() -> bool:
    """``PYCOLL_SHM_CMA``: whether peers may read each other's memory directly (default 1)."""
    return bool(switch("PYCOLL_SHM_CMA", True))


def _cma_enabled() -> bool:
    return cma_setting() and _libc() is not None


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


_LIBC: list = []


def _libc() -> Any:
    """libc with process_vm_readv declared, after letting any process of this user read this
    one (Yama's ptrace scope 1 otherwise limits it to descendants); None where absent."""
    if not _LIBC:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            read = libc.process_vm_readv
        except (OSError, AttributeError):
            _LIBC.append(None)
            return None
        read.restype = ctypes.c_ssize_t
        read.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                         ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
        set_ptracer, any_process = 0x59616D61, ctypes.c_ulong(-1)
        libc.prctl(set_ptracer, any_process, 0, 0, 0)  # fails harmlessly without Yama
        _LIBC.append(libc)
    return _LIBC[0]


def _read_process(pid: int, address: int, into: np.ndarray) -> bool:
    """Copy ``into.nbytes`` bytes at ``address`` in process ``pid`` into ``into``."""
    libc = _libc()
    if libc is None:
        return False
    done, total, base = 0, into.nbytes, into.ctypes.data
    while done < total:
        local = _IoVec(base + done, total - done)
        remote = _IoVec(address + done, total - done)
        got = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            return False
        done += got
    return True


def small_bytes_from_env() -> int:
    return _env_bytes("PYCOLL_SHM_ONE_SHOT_BYTES", SMALL_BYTES)
