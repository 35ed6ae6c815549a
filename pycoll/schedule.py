"""Schedules: what every rank sends, receives and reduces, step by step, as plain data.

A schedule knows nothing of arrays, transports or devices. Each rank owns two buffers:

* ``INPUT``: the caller's array, read only;
* ``WORK``: the result being built. Before the first step the executor seeds it from
  ``INPUT`` as the collective's contract says (:func:`seeded_chunks`); afterwards only the
  schedule's transfers change it.

Both buffers are cut into ``nblocks * nsegments`` chunks: chunk ``block * nsegments + segment``.
A block is a rank's shard for the sharded collectives (ReduceScatter, AllGather, AllToAll, with
the caller's per-rank counts), otherwise an even share of the array; segments split each block
again so that pipelining is more chunks, not new code. :class:`Layout` maps chunks to element
ranges for any count, including uneven splits and empty chunks.

A rank's steps run in order. The transfers of one step may run together: sends read the chunk as
it was when the step began, receives land when the step ends. The k-th send from rank a to rank b
pairs with the k-th receive at b from a, as MPI's ordered matching does.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property


class Collective(str, enum.Enum):
    ALLREDUCE = "allreduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALLGATHER = "allgather"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    ALLTOALL = "alltoall"  # AllToAllv runs the same schedules with per-peer counts
    SENDRECV = "sendrecv"


# Collectives whose blocks are rank shards sized by the caller's counts (whole rows each).
SHARDED = frozenset({Collective.REDUCE_SCATTER, Collective.ALLGATHER, Collective.ALLTOALL})
ROOTED = frozenset({Collective.BROADCAST, Collective.REDUCE})
REDUCING = frozenset({Collective.ALLREDUCE, Collective.REDUCE_SCATTER, Collective.REDUCE})


class Buffer(str, enum.Enum):
    WORK = "work"
    INPUT = "input"


@dataclass(frozen=True)
class Send:
    """Send my ``chunk`` of ``buffer`` to ``peer``."""

    peer: int
    chunk: int
    buffer: Buffer = Buffer.WORK


@dataclass(frozen=True)
class Recv:
    """Receive from ``peer`` into my WORK ``chunk``: combine with it, or overwrite it."""

    peer: int
    chunk: int
    reduce: bool


Transfer = Send | Recv
Step = tuple[Transfer, ...]


@dataclass(frozen=True)
class Schedule:
    collective: Collective
    algorithm: str
    nranks: int
    nblocks: int
    nsegments: int
    steps: tuple[tuple[Step, ...], ...]  # steps[rank]: that rank's steps, in order
    root: int | None = None  # Broadcast/Reduce root; the sender of Send/Recv
    peer: int | None = None  # the receiver of Send/Recv
    only: frozenset[int] | None = None  # built for these ranks alone (``building_only``)

    @property
    def nchunks(self) -> int:
        return self.nblocks * self.nsegments

    def chunk(self, block: int, segment: int = 0) -> int:
        return block * self.nsegments + segment

    def block_of(self, chunk: int) -> int:
        return chunk // self.nsegments

    def segment_of(self, chunk: int) -> int:
        return chunk % self.nsegments

    @cached_property
    def input_read_late(self) -> frozenset[int]:
        """Ranks that send from INPUT and also receive into WORK: there the two must not alias."""
        return frozenset(
            rank
            for rank, steps in enumerate(self.steps)
            if any(isinstance(t, Send) and t.buffer is Buffer.INPUT for s in steps for t in s)
            and any(isinstance(t, Recv) for s in steps for t in s)
        )

    @cached_property
    def joined(self) -> frozenset[tuple[int, int, int]]:
        """(rank, step, position) of every transfer that travels in the previous transfer's
        message: the pair's next transfer in the same steps on both ends, with the chunk after
        the previous one's on both ends, from the same buffer, copied or reduced alike. Both
        ends read this from the schedule, so they always agree on the messages."""
        sends: dict[tuple[int, int], list[tuple[int, int, Send]]] = {}
        recvs: dict[tuple[int, int], list[tuple[int, int, Recv]]] = {}
        for rank, steps in enumerate(self.steps):
            for index, step in enumerate(steps):
                for position, t in enumerate(step):
                    if isinstance(t, Send):
                        sends.setdefault((rank, t.peer), []).append((index, position, t))
                    else:
                        recvs.setdefault((t.peer, rank), []).append((index, position, t))
        joined = set()
        if self.only is not None:  # the partners' steps are not here: read one side alone
            for table, kind in ((sends, "send"), (recvs, "recv")):
                for (src, dst), mine in table.items():
                    rank = src if kind == "send" else dst
                    for (s0, _, a), (s1, p1, b) in zip(mine, mine[1:]):
                        same = (a.buffer is b.buffer) if kind == "send" else (a.reduce == b.reduce)
                        if s0 == s1 and b.chunk == a.chunk + 1 and same:
                            joined.add((rank, s1, p1))
            return frozenset(joined)
        for (src, dst), out in sends.items():
            into = recvs.get((src, dst), [])
            for k in range(1, min(len(out), len(into))):
                (s0, _, a), (s1, p1, b) = out[k - 1], out[k]
                (r0, _, x), (r1, q1, y) = into[k - 1], into[k]
                if (s0 == s1 and r0 == r1 and b.chunk == a.chunk + 1 and b.buffer is a.buffer
                        and y.chunk == x.chunk + 1 and y.reduce == x.reduce):
                    joined.add((src, s1, p1))
                    joined.add((dst, r1, q1))
        return frozenset(joined)

    @cached_property
    def receives_then_sends(self) -> bool:
        """Whether some rank receives a chunk in one step (reducing or copying) and sends that
        chunk from WORK in the next (the ring's receive-reduce-send and receive-copy-send),
        so that a transport may write it into the next rank's buffer as it lands. Read from
        every rank's steps, so every rank gets the same answer (they must all post their
        receives a step ahead, or none). A chunk that several receives of the step reduce
        into is folded after them all (the direct schedules), not forwarded."""
        for steps in self.steps:
            for now, after in zip(steps, steps[1:]):
                receives = Counter(t.chunk for t in now if isinstance(t, Recv))
                received = {chunk for chunk, times in receives.items() if times == 1}
                if any(isinstance(t, Send) and t.buffer is Buffer.WORK and t.chunk in received
                       for t in after):
                    return True
        return False

    def count(self, kind: type) -> int:
        """How many transfers of ``kind`` (Send or Recv) the schedule holds, over all ranks."""
        return sum(isinstance(t, kind) for rank in self.steps for step in rank for t in step)


def split(count: int, parts: int) -> list[int]:
    """``count`` elements in ``parts`` shares that differ by at most one, larger shares first."""
    base, extra = divmod(count, parts)
    return [base + (i < extra) for i in range(parts)]


class Layout:
    """Element ranges of every chunk, for blocks of the given sizes split into segments."""

    def __init__(self, block_counts: list[int], nsegments: int):
        self.block_counts = list(block_counts)
        self.nsegments = nsegments
        self.offsets = [0]
        for block_count in self.block_counts:
            for segment_count in split(block_count, nsegments):
                self.offsets.append(self.offsets[-1] + segment_count)

    @classmethod
    def even(cls, count: int, nblocks: int, nsegments: int) -> Layout:
        return cls(split(count, nblocks), nsegments)

    @property
    def total(self) -> int:
        return self.offsets[-1]

    def chunk_range(self, chunk: int) -> tuple[int, int]:
        return self.offsets[chunk], self.offsets[chunk + 1]

    def block_range(self, block: int) -> tuple[int, int]:
        return self.offsets[block * self.nsegments], self.offsets[(block + 1) * self.nsegments]


def seeded_chunks(schedule: Schedule, rank: int) -> Iterator[tuple[int, int]]:
    """The (input chunk, work chunk) pairs the executor copies before the first step.

    This is the contract's starting placement, the same for every algorithm of a collective.
    """
    collective, nseg = schedule.collective, schedule.nsegments
    if collective in REDUCING:
        yield from ((c, c) for c in range(schedule.nchunks))
    elif collective is Collective.BROADCAST:
        if rank == schedule.root:
            yield from ((c, c) for c in range(schedule.nchunks))
    elif collective is Collective.ALLGATHER:
        # INPUT is this rank's shard alone: its chunks are the segments of block 0.
        yield from ((s, schedule.chunk(rank, s)) for s in range(nseg))
    elif collective is Collective.ALLTOALL:
        # The piece addressed to myself stays local.
        yield from ((schedule.chunk(rank, s), schedule.chunk(rank, s)) for s in range(nseg))
    # Send/Recv seeds nothing: the sender sends straight from INPUT.


def result_chunks(schedule: Schedule, rank: int) -> range:
    """The WORK chunks that hold this rank's result when the schedule ends."""
    collective = schedule.collective
    if collective is Collective.REDUCE_SCATTER:
        return range(schedule.chunk(rank), schedule.chunk(rank + 1))
    if collective is Collective.REDUCE:
        return range(schedule.nchunks if rank == schedule.root else 0)
    if collective is Collective.SENDRECV:
        return range(schedule.nchunks if rank == schedule.peer else 0)
    return range(schedule.nchunks)


# Build only these ranks' steps (None: every rank's): for costing a rank-symmetric schedule
# at a scale where every rank's steps would not fit (see ``building_only``).
_ONLY_RANKS: contextvars.ContextVar[frozenset[int] | None] = contextvars.ContextVar(
    "only_ranks", default=None
)


@contextlib.contextmanager
def building_only(ranks: frozenset[int]) -> Iterator[None]:
    """Within this block, schedules hold the steps of ``ranks`` only; the others' are empty.
    Such a schedule is for costing one rank, never for running or checking."""
    token = _ONLY_RANKS.set(frozenset(ranks))
    try:
        yield
    finally:
        _ONLY_RANKS.reset(token)


@dataclass
class ScheduleBuilder:
    """Collects each rank's transfers in program order and packs them into steps.

    An algorithm adds transfers as the textbook loop reads (``transfer(src, dst, chunk)``);
    consecutive transfers of a rank share a step until one would touch a chunk the open step
    already receives into, or receive into a chunk it sends. Packing only posts work earlier,
    so it never adds a wait that the program order did not have. ``end_step`` forces a boundary.
    """

    collective: Collective
    algorithm: str
    nranks: int
    nblocks: int
    nsegments: int = 1
    root: int | None = None
    peer: int | None = None
    _done: list[list[Step]] = field(init=False)
    _open: list[list[Transfer]] = field(init=False)
    _busy: set[int] = field(init=False)  # ranks with an open step
    _only: frozenset[int] | None = field(init=False)
    # per rank, the open step's chunks received into (-> reduce flag) and sent from WORK,
    # so that checking a transfer against the open step costs O(1), not O(step)
    _received: list[dict[int, bool]] = field(init=False)
    _sent: list[set[int]] = field(init=False)

    def __post_init__(self) -> None:
        self._done = [[] for _ in range(self.nranks)]
        self._open = [[] for _ in range(self.nranks)]
        self._received = [{} for _ in range(self.nranks)]
        self._sent = [set() for _ in range(self.nranks)]
        self._busy = set()
        self._only = _ONLY_RANKS.get()

    def chunk(self, block: int, segment: int = 0) -> int:
        return block * self.nsegments + segment

    def chunks_of_block(self, block: int) -> range:
        return range(self.chunk(block), self.chunk(block + 1))

    def wants(self, rank: int) -> bool:
        """Whether ``rank``'s steps are being built (see ``building_only``): an algorithm may
        skip the loops of groups that hold no such rank."""
        return self._only is None or rank in self._only

    def add(self, rank: int, transfer: Transfer) -> None:
        if self._only is not None and rank not in self._only:
            return
        received, sent = self._received[rank], self._sent[rank]
        if isinstance(transfer, Send):
            conflict = transfer.buffer is Buffer.WORK and transfer.chunk in received
        else:  # the rules of step_hazard, on the open step's sets
            known = received.get(transfer.chunk)
            conflict = transfer.chunk in sent or (
                known is not None and not (transfer.reduce and known)
            )
        if conflict:
            self.end_step(rank)
            received, sent = self._received[rank], self._sent[rank]
        if isinstance(transfer, Send):
            if transfer.buffer is Buffer.WORK:
                sent.add(transfer.chunk)
        else:
            received[transfer.chunk] = transfer.reduce and received.get(transfer.chunk, True)
        self._open[rank].append(transfer)
        self._busy.add(rank)

    def transfer(
        self,
        src: int,
        dst: int,
        chunk: int,
        *,
        reduce: bool = False,
        dst_chunk: int | None = None,
        buffer: Buffer = Buffer.WORK,
    ) -> None:
        """``src`` sends ``chunk`` to ``dst``, which copies or reduces it into ``dst_chunk``."""
        self.add(src, Send(dst, chunk, buffer))
        self.add(dst, Recv(src, chunk if dst_chunk is None else dst_chunk, reduce))

    def end_step(self, rank: int | None = None) -> None:
        for r in list(self._busy) if rank is None else (rank,):
            if self._open[r]:
                self._done[r].append(tuple(self._open[r]))
                self._open[r] = []
                self._received[r] = {}
                self._sent[r] = set()
            self._busy.discard(r)

    def build(self) -> Schedule:
        self.end_step()
        return Schedule(
            collective=self.collective,
            algorithm=self.algorithm,
            nranks=self.nranks,
            nblocks=self.nblocks,
            nsegments=self.nsegments,
            steps=tuple(tuple(rank_steps) for rank_steps in self._done),
            root=self.root,
            peer=self.peer,
            only=self._only,
        )


def step_hazard(step: Step | list[Transfer], transfer: Transfer) -> str | None:
    """Why ``transfer`` cannot run in the same step as ``step``'s transfers, or None."""
    received = {t.chunk: t.reduce for t in step if isinstance(t, Recv)}
    sent = {t.chunk for t in step if isinstance(t, Send) and t.buffer is Buffer.WORK}
    if isinstance(transfer, Send):
        if transfer.buffer is Buffer.WORK and transfer.chunk in received:
            return f"sends chunk {transfer.chunk} while the same step receives into it"
        return None
    if transfer.chunk in sent:
        return f"receives into chunk {transfer.chunk} while the same step sends it"
    if transfer.chunk in received and not (transfer.reduce and received[transfer.chunk]):
        return f"receives into chunk {transfer.chunk} twice in one step, not both reducing"
    return None
