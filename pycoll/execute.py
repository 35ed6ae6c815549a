"""Run one rank's steps of a schedule over a transport, with a reducer.

The executor is algorithm-blind: it sees element ranges, peers and "copy or reduce", never
which family emitted them. :func:`compile_program` resolves a rank's chunks to element ranges
once per (schedule, sizes), so a repeated call does no chunk arithmetic; :func:`run` then, for
each step over a transport that does not deliver (MPI messages, in-process threads), posts the
receives (into WORK for a copy, into scratch for a reduction), posts the sends, waits for all,
and reduces in the listed order (:func:`player`, which a repeated host call keeps). A transport
that delivers (shared memory, the device transports) copies or reduces each message into place
as it lands, and where some rank forwards, every rank posts its receives a step ahead.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pycoll.bindings.transport import CollectiveTimeout, Transport, WaitTimeout
from pycoll.kernels.table import MAX_SOURCES
from pycoll.schedule import Buffer, Layout, Recv, Schedule, Send, result_chunks, seeded_chunks
from pycoll.spaces import HOST

# reduce(dst, src): dst = dst (op) src; reduce(dst, src, first): dst = first (op) src
Reducer = Callable[..., None]



@dataclass(frozen=True)
class Receive:
    peer: int
    start: int  # element range of WORK
    stop: int
    scratch: int  # offset in scratch when reducing, -1 when copying in place
    # When reducing into a chunk whose seed copy was deferred: the INPUT range to combine
    # with instead of WORK, so seeding and the first reduction are one pass over memory.
    fused: tuple[int, int] | None = None
    # Rank order (see _in_rank_order): ``first`` - WORK holds nothing yet, so the incoming data
    # starts it (``fused`` is then combined after it, not before); ``own_last`` - ``fused``
    # is combined after the incoming data.
    first: bool = False
    own_last: bool = False


@dataclass(frozen=True)
class Transmit:
    peer: int
    from_input: bool
    start: int
    stop: int


@dataclass
class Program:
    """One rank's part of a schedule for given sizes, with every range resolved."""

    seeds: tuple[tuple[int, int, int, int], ...]  # INPUT start, stop -> WORK start, stop
    steps: tuple[tuple[tuple[Receive, ...], tuple[Transmit, ...]], ...]
    scratch_elements: int  # the most any step reduces at once
    # Per step: the positions of receives that reduce into one range (two or more, as the
    # direct schedules' every-rank-to-one), which an n-ary reduce can do in one pass.
    reduce_groups: tuple[tuple[tuple[int, ...], ...], ...] = ()
    # Per step: (receive position, position of a transmit in the next step) where the next
    # step sends exactly the range this receive copies or reduces into, to the only message
    # to that peer there: a transport can write it into the peer's buffer as it lands.
    forwards: tuple[tuple[tuple[int, int], ...], ...] = ()
    # The schedule receives then sends somewhere (on some rank): every rank then posts its
    # receives a step ahead when forwarding, so that a forward never waits on a rank that is
    # itself waiting to forward.
    posts_ahead: bool = False
    _inbox_bytes: dict[tuple[int, bool], int] = dataclasses.field(
        default_factory=dict, repr=False, compare=False)

    @property
    def has_reduce_groups(self) -> bool:
        return any(self.reduce_groups)

    def inbox_bytes(self, itemsize: int, ahead: bool) -> int:
        """What a delivering transport holds at once for this program: the largest step's
        receives, or, posting ahead, two consecutive steps' (with 16-byte alignment)."""
        key = (itemsize, ahead)
        if key not in self._inbox_bytes:
            per_step = [sum(r.stop - r.start for r in receives) * itemsize + 16 * len(receives)
                        for receives, _ in self.steps]
            if ahead:
                per_step = [a + b for a, b in zip(per_step, [*per_step[1:], 0])]
            self._inbox_bytes[key] = max(per_step, default=0)
        return self._inbox_bytes[key]


def compile_program(
    schedule: Schedule, rank: int, input_layout: Layout, work_layout: Layout
) -> Program:
    """Resolve ``rank``'s chunks to element ranges, once per (schedule, sizes).

    Zero-length transfers drop out (both ends know every size from the same counts, so both
    drop the same ones), and consecutive chunks between the same two ranks in one step travel
    as one message (``Schedule.joined``: both ends read the grouping from the schedule).

    A seed copy is deferred until its chunk is first used: a chunk first reduced into combines
    INPUT with the incoming data directly (``Receive.fused``), a chunk first overwritten is
    never copied at all, and a chunk sent while still unseeded is sent from INPUT (a whole
    message of such chunks, ``_sent_from_seeds``); only chunks sent in a message that cannot,
    or never touched and part of the rank's result (``result_chunks``), are copied before the
    first step. A reducing collective's programs copy nothing of INPUT.
    """
    pending = {w: input_layout.chunk_range(i) for i, w in seeded_chunks(schedule, rank)}
    seeds: list[tuple[int, int, int, int]] = []

    def materialize(chunk: int) -> None:
        if chunk in pending:
            seeds.append((*pending.pop(chunk), *work_layout.chunk_range(chunk)))

    steps = []
    groups = []
    numbers = []  # each kept step's index in the schedule (empty steps drop out)
    most = 0
    joined = schedule.joined
    for index, step in enumerate(schedule.steps[rank]):
        receives: list[Receive] = []
        transmits: list[Transmit] = []
        # peer -> position in receives/transmits of the message that a joining transfer
        # extends (None: the message's earlier transfers were all empty)
        open_receive: dict[int, int | None] = {}
        open_transmit: dict[int, int | None] = {}
        from_seed = _sent_from_seeds(step, rank, index, joined, pending)
        for position, transfer in enumerate(step):  # sends read the step's starting state
            if (isinstance(transfer, Send) and transfer.buffer is Buffer.WORK
                    and position not in from_seed):
                materialize(transfer.chunk)
        for position, transfer in enumerate(step):
            joins = (rank, index, position) in joined
            peer = transfer.peer
            if isinstance(transfer, Recv):
                start, stop = work_layout.chunk_range(transfer.chunk)
                fused = pending.pop(transfer.chunk, None) if transfer.reduce else None
                if not transfer.reduce:
                    pending.pop(transfer.chunk, None)  # overwritten: never copied
                if not joins:
                    open_receive[peer] = None
                if stop == start:
                    continue
                scratch = 0 if transfer.reduce else -1  # offsets are given below
                at = open_receive.get(peer)
                if at is None:
                    open_receive[peer] = len(receives)
                    receives.append(Receive(peer, start, stop, scratch, fused))
                    continue
                before = receives[at]
                if (before.fused is None) != (fused is None):  # seed the fused one instead
                    for part, (w0, w1) in ((before.fused, (before.start, before.stop)),
                                           (fused, (start, stop))):
                        if part is not None:
                            seeds.append((*part, w0, w1))
                    joined_fused = None
                else:
                    joined_fused = None if fused is None else (before.fused[0], fused[1])
                receives[at] = Receive(peer, before.start, stop, scratch, joined_fused)
            else:
                if position in from_seed:  # WORK's chunk is still INPUT's: send that
                    # INPUT's range, as long as WORK's: the messages are WORK's whatever
                    # INPUT's layout (some_rank_forwards compiles every rank with WORK's)
                    from_input = True
                    w0, w1 = work_layout.chunk_range(transfer.chunk)
                    start = pending[transfer.chunk][0]
                    stop = start + w1 - w0
                else:
                    from_input = transfer.buffer is Buffer.INPUT
                    layout = input_layout if from_input else work_layout
                    start, stop = layout.chunk_range(transfer.chunk)
                if not joins:
                    open_transmit[peer] = None
                if stop == start:
                    continue
                at = open_transmit.get(peer)
                if at is None:
                    open_transmit[peer] = len(transmits)
                    transmits.append(Transmit(peer, from_input, start, stop))
                else:
                    transmits[at] = Transmit(peer, from_input, transmits[at].start, stop)
        if rank in schedule.input_read_late:  # INPUT never aliases WORK here
            _in_rank_order(receives, rank)
        used = 0
        for i, r in enumerate(receives):  # scratch for the reductions, message by message
            if r.scratch >= 0:
                receives[i] = dataclasses.replace(r, scratch=used)
                used += r.stop - r.start
        most = max(most, used)
        if receives or transmits:
            steps.append((tuple(receives), tuple(transmits)))
            groups.append(_reduce_groups(receives))
            numbers.append(index)
    result = result_chunks(schedule, rank)
    for chunk in list(pending):  # never touched by a step: part of the result as seeded
        if chunk in result:  # (a chunk outside the result needs no copy: ReduceScatter's)
            materialize(chunk)
    forwards = tuple(
        _forwards(steps[k], groups[k], steps[k + 1])
        if k + 1 < len(steps) and numbers[k + 1] == numbers[k] + 1 else ()
        for k in range(len(steps))
    )
    return Program(tuple(seeds), tuple(steps), most, tuple(groups), forwards,
                   schedule.receives_then_sends)


def _sent_from_seeds(step, rank: int, index: int, joined, pending: dict) -> set[int]:
    """Positions of the step's sends from WORK that can read INPUT instead: whole messages
    whose every chunk is still unseeded (WORK's chunk would be a copy of INPUT's), their INPUT
    ranges consecutive. The seed then waits for the chunk's first use, and goes when that use
    overwrites it or it is not part of the result."""
    messages: dict[int, list[int]] = {}  # peer -> positions of its open message's sends
    runs: list[list[int]] = []
    for position, transfer in enumerate(step):
        if not isinstance(transfer, Send):
            continue
        if (rank, index, position) in joined and transfer.peer in messages:
            messages[transfer.peer].append(position)
        else:
            messages[transfer.peer] = [position]
            runs.append(messages[transfer.peer])
    from_seed: set[int] = set()
    for run in runs:
        chunks = [step[p].chunk for p in run]
        if step[run[0]].buffer is not Buffer.WORK or any(c not in pending for c in chunks):
            continue
        ranges = [pending[c] for c in chunks]
        if all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])):
            from_seed.update(run)
    return from_seed


def some_rank_forwards(schedule: Schedule, work_layout: Layout) -> bool:
    """Whether any rank's program forwards (``Program.forwards``) at these sizes. Every
    rank knows every rank's WORK layout, so all read the same answer: whether all post their
    receives ahead (``Program.posts_ahead`` is the sizeless superset; joined messages and
    empty chunks make the difference, halving-doubling's AllGather say). Forwards depend on
    WORK's layout alone: INPUT's decides which seeds are deferred, not what a step receives
    and sends on."""
    if not schedule.receives_then_sends:
        return False
    return any(any(compile_program(schedule, rank, work_layout, work_layout).forwards)
               for rank in range(schedule.nranks))


def _forwards(step, groups, following) -> tuple[tuple[int, int], ...]:
    """The (receive, next step's transmit) pairs of ``Program.forwards`` for one step.

    Only a receive that copies, or reduces in one pass (not two reductions), alone on its
    range in this step, and a transmit that is the only message to its peer in the next
    step (the peer's credits are matched in order: a forwarded message must not overtake
    another to the same peer). Only between consecutive steps of this rank: its peers post
    their receives one step ahead, no further (that this never makes a rank wait on itself
    is checked for every family in tests/test_forwarding_model.py)."""
    receives, _ = step
    grouped = {i for members in groups for i in members}
    candidates = [
        (i, r) for i, r in enumerate(receives)
        if (r.scratch < 0 or (r.fused is not None or not r.first))  # a copy, or one pass:
        and (r.first or not r.own_last) and i not in grouped  # not two reductions
    ]
    if not candidates:
        return ()
    transmits = following[1]
    to_peer: dict[int, list[int]] = {}
    for j, t in enumerate(transmits):
        to_peer.setdefault(t.peer, []).append(j)
    forwardable: dict[tuple[int, int], int] = {}  # a range's first transmit that may go on
    for j, t in enumerate(transmits):
        if not t.from_input and len(to_peer[t.peer]) == 1:
            forwardable.setdefault((t.start, t.stop), j)
    pairs = []
    shares_range = _overlap_test(receives)
    for i, r in candidates:
        j = forwardable.get((r.start, r.stop))
        if j is not None and not shares_range(i):
            pairs.append((i, j))
    return tuple(pairs)


def _overlap_test(ranges: list) -> Callable[[int], bool]:
    """``shares_range(i)``: whether some other of ``ranges`` (each with start and stop)
    overlaps the i-th (``o.start < r.stop and r.start < o.stop``), in O(log n) a query: a
    tree's root receives a block from every rank in one step, and testing each against all
    took seconds to compile a 64-rank AllGather."""
    order = sorted(range(len(ranges)), key=lambda k: ranges[k].start)
    starts = [ranges[k].start for k in order]
    # per prefix of ``order``: its largest stop, whose that is, and the largest of the rest
    top, who, second = -1, -1, -1
    prefix = [(top, who, second)]
    for k in order:
        stop = ranges[k].stop
        if stop > top:
            top, who, second = stop, k, top
        elif stop > second:
            second = stop
        prefix.append((top, who, second))

    def shares_range(i: int) -> bool:
        r = ranges[i]
        top, who, second = prefix[bisect.bisect_left(starts, r.stop)]  # those starting before
        return (second if who == i else top) > r.start

    return shares_range


def _reduce_groups(receives: list[Receive], least: int = 2) -> tuple[tuple[int, ...], ...]:
    """Positions of the reductions that share a range, per range of ``least`` or more."""
    ranges: dict[tuple[int, int], list[int]] = {}
    for i, r in enumerate(receives):
        if r.scratch >= 0:
            ranges.setdefault((r.start, r.stop), []).append(i)
    return tuple(tuple(members) for members in ranges.values() if len(members) >= least)


def _in_rank_order(receives: list[Receive], rank: int) -> None:
    """Reorder, in place, a step's reductions of peers into one range whose seed was
    deferred, so that they combine in rank order with this rank's INPUT at its own place:
    ((x0 op x1) op x2) ... on every rank. Every rank then adds the same arrays the same way,
    so the direct AllReduce gives the same bits on every rank (and the same as the
    shared-memory one-shot's and two_shot's). One peer's too (2 ranks): x0 op x1 on rank 1
    as on rank 0, where op's operands do not commute bitwise (numpy's complex multiply)."""
    for positions in _reduce_groups(receives, least=1):
        members = [receives[i] for i in positions]
        own = members[0].fused
        if own is None or any(m.fused is not None for m in members[1:]):
            continue
        ordered = sorted(members, key=lambda m: m.peer)
        lower = sum(m.peer < rank for m in ordered)
        for k, (i, m) in enumerate(zip(positions, ordered)):
            # own first when no peer is below; else after the last lower peer's data
            fused = own if k == max(lower - 1, 0) else None
            receives[i] = dataclasses.replace(m, fused=fused, first=lower > 0 and k == 0,
                                              own_last=lower > 0 and fused is not None)


def run(
    program: Program,
    source: Any,
    work: Any,
    transport: Transport,
    tag: int,
    reduce: Reducer,
    space: Any = HOST,
    scratch: Any = None,
    what: str = "collective",
    count: Callable[[int, int], None] | None = None,
    reduce_n: Callable[[Any, list], None] | None = None,
    reduce_copy: Callable[[Any, Any, Any, Any], None] | None = None,
    copy_pair: Callable[[Any, Any, Any], None] | None = None,
) -> None:
    """Seed WORK from INPUT (flat views), then run the program's steps in order.

    ``space`` does the copies (numpy's by default; a device space enqueues them on the
    current stream). A transport that ``delivers`` takes each reduction with its receive and
    combines the incoming data where it lands (a peer-memory inbox, a staging buffer);
    otherwise data arrives in ``scratch`` (at least ``program.scratch_elements`` long; made
    here when not given) and is reduced here (:func:`player`). ``count(peer, nbytes)``, when
    given, is told of every message handed to the transport (pycoll/traffic.py).
    ``reduce_n(dst, sources)``, when given, and when the transport ``lends_until_next_step``
    (what it lends a combine stays readable until its next call), does a step's reductions
    into one range in one pass after the step's messages are in, folding in the same order
    as one by one. ``copy_pair(dst, peer, src)`` (dst = peer = src) and
    ``reduce_copy(dst, peer, a, b)`` (dst = peer = a op b), when given, and when the
    transport ``forwards`` (its ``isend`` takes ``produced_by``: the message is written as
    that receive is combined), write a chunk the next step sends straight into the
    receiver's buffer as well, as it is copied or reduced into place (``Program.forwards``),
    one pass instead of two; every rank then posts its receives a step ahead (``copy_pair``
    given: the device space's, on every rank alike), each step's as one batch
    (``transport.start_batch()``). A transport that can ``reserve(nbytes)`` is told once
    what the call's receives hold at once.
    """
    if not getattr(transport, "delivers", False):
        if scratch is None and program.scratch_elements:
            scratch = space.empty(program.scratch_elements, work.dtype)
        elif scratch is not None and scratch.size != program.scratch_elements:
            scratch = scratch[: program.scratch_elements]  # player's length
        play = player(program, (source.size, work.size, work.itemsize), transport, reduce,
                      space, what, count)
        play(source, work, scratch, tag)
        return
    _seed(program.seeds, source, work, space)
    if not program.steps:
        return
    at = [0]  # the step being run, for a timeout's message
    try:
        if reduce_n is None or not getattr(transport, "lends_until_next_step", False):
            reduce_n = None
        if not (program.posts_ahead and getattr(transport, "forwards", False)):
            reduce_copy = copy_pair = None
        _run_delivered(program, source, work, transport, tag, reduce, space, at, count,
                       reduce_n, reduce_copy, copy_pair)
    except WaitTimeout as late:
        raise _timed_out(what, transport, at[0], len(program.steps), late) from None


def _seed(seeds, source, work, space: Any) -> None:
    for in_start, in_stop, work_start, work_stop in seeds:
        target = work[work_start:work_stop]
        incoming = source[in_start:in_stop]
        # the caller forbids partial overlap; an empty range: a read-only x's, too
        if incoming.size and not space.may_share_memory(incoming, target):
            space.copy(target, incoming)


def _timed_out(what: str, transport: Transport, index: int, steps: int,
               late: WaitTimeout) -> CollectiveTimeout:
    return CollectiveTimeout(
        f"{what}: rank {transport.rank} waited {late.seconds:g} s at step {index + 1} of "
        f"{steps} for rank(s) {', '.join(map(str, late.peers))}")


def player(program: Program, sizes: tuple[int, int, int], transport: Transport,
           reduce: Reducer, space: Any = HOST, what: str = "collective",
           count: Callable[[int, int], None] | None = None
           ) -> Callable[[Any, Any, Any, int], None]:
    """``run`` over a transport that does not deliver, made once for arrays of ``sizes``
    (INPUT's and WORK's elements, the itemsize), so that a repeated call pays only for its
    messages and reductions: ``play(source, work, scratch, tag)``, ``scratch`` exactly
    ``program.scratch_elements`` long.

    A step of one receive and one transmit (ring, halving-doubling and two-rank steps) is
    one ``sendrecv``, its ranges made slices here (none where a range is the whole array:
    no view to make per call); other steps post their receives, then their sends, wait for
    all, and reduce in the listed order.
    """
    played = _played(program, *sizes)
    seeds, steps = program.seeds, len(played)
    sendrecv = transport.sendrecv

    def play(source: Any, work: Any, scratch: Any, tag: int) -> None:
        if seeds:
            _seed(seeds, source, work, space)
        index = 0
        try:
            for index, step in enumerate(played):  # noqa: B007 (the timeout names it)
                receive, from_input, sent, peer_to, nbytes, target, peer_from, inbox, own = step
                if receive is None:  # several messages (from_input, sent: the step's)
                    _exchange(from_input, sent, source, work, scratch, transport, tag, reduce,
                              space, count)
                    continue
                out = source if from_input else work
                if sent is not None:
                    out = out[sent]
                if count is not None:
                    count(peer_to, nbytes)
                into = work if target is None else work[target]
                if inbox is False:  # a copy, into place
                    sendrecv(out, peer_to, into, peer_from, tag)
                    continue
                incoming = scratch if inbox is None else scratch[inbox]
                sendrecv(out, peer_to, incoming, peer_from, tag)
                if own is not False:  # the pair's usual case: own INPUT op incoming
                    reduce(into, incoming, source if own is None else source[own])
                else:
                    _reduce(reduce, space, work, source, receive, incoming)
        except WaitTimeout as late:
            raise _timed_out(what, transport, index, steps, late) from None

    return play


def _played(program: Program, source_size: int, work_size: int, itemsize: int) -> tuple:
    """``player``'s steps for arrays of these sizes. A pair step: (receive, from_input, sent,
    peer_to, nbytes, target, peer_from, inbox, own) with ``sent``, ``target`` (WORK),
    ``inbox`` (scratch) and ``own`` (INPUT) slices, None for a whole array; ``inbox`` False
    for a copy into place, ``own`` False unless the reduction is ``own op incoming``. Other
    steps: (None, receives, transmits, ...)."""

    def part(start: int, stop: int, size: int) -> slice | None:
        return None if start == 0 and stop == size else slice(start, stop)

    played = []
    for receives, transmits in program.steps:
        if len(receives) != 1 or len(transmits) != 1:
            played.append((None, receives, transmits, None, 0, None, 0, None, None))
            continue
        (r,), (t,) = receives, transmits
        sent = part(t.start, t.stop, source_size if t.from_input else work_size)
        inbox: slice | None | bool = False
        own: slice | None | bool = False
        if r.scratch >= 0:
            inbox = part(r.scratch, r.scratch + r.stop - r.start, program.scratch_elements)
            if r.fused is not None and not r.own_last:
                own = part(*r.fused, source_size)
        played.append((r, t.from_input, sent, t.peer, (t.stop - t.start) * itemsize,
                       part(r.start, r.stop, work_size), r.peer, inbox, own))
    return tuple(played)


def _exchange(receives, transmits, source, work, scratch, transport, tag: int,
              reduce: Reducer, space: Any, count) -> None:
    """A step of several messages: receives first, so that sends find them posted."""
    requests = []
    reductions = []
    for r in receives:
        if r.scratch < 0:
            requests.append(transport.irecv(work[r.start : r.stop], r.peer, tag))
        else:
            into = scratch[r.scratch : r.scratch + r.stop - r.start]
            requests.append(transport.irecv(into, r.peer, tag))
            reductions.append((r, into))
    for t in transmits:
        out = (source if t.from_input else work)[t.start : t.stop]
        if count is not None:
            count(t.peer, out.nbytes)
        requests.append(transport.isend(out, t.peer, tag))
    transport.waitall(requests)
    for r, incoming in reductions:
        _reduce(reduce, space, work, source, r, incoming)


def _run_delivered(program: Program, source, work, transport, tag: int, reduce: Reducer,
                   space: Any, at: list[int], count, reduce_n, reduce_copy,
                   copy_pair) -> None:
    ahead = copy_pair is not None  # receives posted a step ahead, to forward (see run)

    def forwards_at(index: int) -> list[tuple[int, int]]:
        """``Program.forwards[index]`` that this call's kernels can make."""
        if not ahead:
            return []
        receives = program.steps[index][0]
        return [(i, j) for i, j in program.forwards[index]
                if receives[i].scratch < 0 or reduce_copy is not None]

    def post_receives(index: int) -> tuple[list, dict[int, Any], tuple, list]:
        receives = program.steps[index][0]
        if ahead:  # this step's slots at the other end of the inbox from the last step's
            transport.start_batch()
        groups = program.reduce_groups[index] if reduce_n is not None else ()
        grouped = {i for members in groups for i in members}
        forwards = forwards_at(index)
        forwarded = {i for i, _ in forwards}
        lent: dict[int, Any] = {}  # position in receives -> what the transport lent
        requests = []
        for i, r in enumerate(receives):
            if i in forwarded and r.scratch < 0:
                combine = functools.partial(_copy_forward, space, copy_pair, work, r)
            elif i in forwarded:
                combine = functools.partial(_reduce_forward, reduce, reduce_copy, space, work,
                                            source, r)
            elif r.scratch < 0:
                combine = None
            elif i in grouped:
                combine = functools.partial(lent.__setitem__, i)
            else:
                combine = functools.partial(_reduce, reduce, space, work, source, r)
            requests.append(transport.irecv(work[r.start : r.stop], r.peer, tag, combine))
        return requests, lent, groups, forwards

    reserve = getattr(transport, "reserve", None)
    if reserve is not None:  # one inbox for the whole call, not one per growing claim
        reserve(program.inbox_bytes(work.itemsize, ahead))
    posted = post_receives(0)
    forwarded_sends: dict[int, Any] = {}  # this step's transmits, already made last step
    for index, (receives, transmits) in enumerate(program.steps):
        at[0] = index
        if posted is None:
            posted = post_receives(index)
        requests, lent, groups, forwards = posted
        posted = post_receives(index + 1) if ahead and index + 1 < len(program.steps) else None
        sends = []
        for j, t in enumerate(transmits):  # after the receives, so that sends find them posted
            made = forwarded_sends.get(j)
            if made is None:
                out = (source if t.from_input else work)[t.start : t.stop]
                if count is not None:
                    count(t.peer, out.nbytes)
                made = transport.isend(out, t.peer, tag)
            sends.append(made)
        forwarded_sends = {}
        for i, j in forwards:  # after this step's sends: a peer's credits come in order
            t = program.steps[index + 1][1][j]
            out = work[t.start : t.stop]
            if count is not None:
                count(t.peer, out.nbytes)
            forwarded_sends[j] = transport.isend(out, t.peer, tag, produced_by=requests[i])
        transport.waitall(requests + sends)
        for members in groups:
            _reduce_group(reduce, reduce_n, space, work, source,
                          [(receives[i], lent[i]) for i in members])


def _copy_forward(space: Any, copy_pair, work, receive: Receive, incoming, peer) -> None:
    """A copy receive whose range the next step sends: into WORK and into ``peer`` (the
    receiver's buffer) in one pass over ``incoming`` (``peer`` None: into WORK only)."""
    target = work[receive.start : receive.stop]
    if peer is None:
        space.copy(target, incoming)
    else:
        copy_pair(target, peer, incoming)


def _reduce_forward(reduce: Reducer, reduce_copy, space: Any, work, source, receive: Receive,
                    incoming, peer) -> None:
    """``_reduce`` of a receive whose range the next step sends: the result is written into
    WORK and into ``peer`` (the receiver's buffer) in one pass (``peer`` None: into WORK
    only). Only one-pass reductions forward (``_forwards``): combine with WORK, or with the
    rank's own INPUT on either side."""
    if peer is None:
        _reduce(reduce, space, work, source, receive, incoming)
        return
    target = work[receive.start : receive.stop]
    if receive.fused is None:
        reduce_copy(target, peer, target, incoming)
        return
    own = source[receive.fused[0] : receive.fused[1]]
    if receive.own_last:  # and first: target = incoming op own
        reduce_copy(target, peer, incoming, own)
    else:
        reduce_copy(target, peer, own, incoming)


def _reduce_group(reduce: Reducer, reduce_n, space: Any, work, source,
                  members: list[tuple[Receive, Any]]) -> None:
    """The reductions of ``members`` (one range, listed order) as one n-ary fold: the
    sources in exactly the order that ``_reduce`` one by one would combine them."""
    first = members[0][0]
    target = work[first.start : first.stop]
    sources: list[Any] = []
    for r, incoming in members:
        own = None if r.fused is None else source[r.fused[0] : r.fused[1]]
        if r.fused is None and r.first:  # target = incoming
            sources = [incoming]
        elif r.fused is not None and not r.own_last:  # target = own op incoming
            sources = [own, incoming]
        elif r.fused is not None and r.first:  # target = incoming op own
            sources = [incoming, own]
        else:  # target op= incoming (then op= own)
            sources = sources or [target]
            sources += [incoming] if own is None else [incoming, own]
    if len(sources) > MAX_SOURCES:  # one launch's worth; chained launches would need dst
        for r, incoming in members:  # to be none of the later sources: one by one instead
            _reduce(reduce, space, work, source, r, incoming)
        return
    reduce_n(target, sources)


def _reduce(reduce: Reducer, space: Any, work, source, receive: Receive, incoming,
            offset: int = 0) -> None:
    """Reduce ``incoming`` into the receive's range of WORK, ``offset`` elements in (a
    delivering transport may hand a long message over in pieces)."""
    start = receive.start + offset
    target = work[start : start + incoming.size]
    if receive.fused is None:
        if receive.first:
            space.copy(target, incoming)
        else:
            reduce(target, incoming)
        return
    first = receive.fused[0] + offset
    own = source[first : first + incoming.size]
    if not receive.own_last:
        reduce(target, incoming, own)
    elif receive.first:
        reduce(target, own, incoming)
    else:
        reduce(target, incoming)
        reduce(target, own)
