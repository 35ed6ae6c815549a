"""Prove a schedule meets its collective's contract without running it.

Every chunk carries the set of contributions it holds: ``(origin rank, origin INPUT chunk)``.
The checker plays the schedule symbolically, as MSCCLang does: a receive that copies replaces
the set, one that reduces joins the sets, and joining a contribution that is already there is
an error even though a sum of numbers would hide it. It also pairs every send with its receive,
refuses transfers of one step that race on a chunk, and finds waits that can never end.

Progress follows rendezvous rules, the strictest a transport may use: a transfer completes only
once both ranks have reached the steps that hold it, and a rank leaves a step only when all of
the step's transfers completed. A schedule that passes cannot hang on any transport.
"""

from __future__ import annotations

from dataclasses import dataclass

from pycoll.schedule import (
    SHARDED,
    Buffer,
    Collective,
    Recv,
    Schedule,
    Send,
    result_chunks,
    seeded_chunks,
    step_hazard,
)

Contribution = tuple[int, int]  # (origin rank, origin INPUT chunk)
Contents = frozenset[Contribution] | None  # None: the chunk holds no defined data


class ScheduleError(ValueError):
    """A schedule breaks its contract; the message names rank, step and chunk."""


@dataclass(frozen=True)
class Delivery:
    """One completed transfer: ``src`` sent ``src_chunk``; ``dst`` got it into ``dst_chunk``."""

    src: int
    src_step: int
    src_chunk: int
    src_buffer: Buffer
    dst: int
    dst_step: int
    dst_chunk: int
    reduce: bool
    contents: frozenset[Contribution]


@dataclass(frozen=True)
class Report:
    """What the symbolic run saw: deliveries grouped by the round they completed in."""

    rounds: tuple[tuple[Delivery, ...], ...]
    final: tuple[dict[int, Contents], ...]  # every rank's WORK chunks at the end


def input_chunks(schedule: Schedule) -> int:
    if schedule.collective is Collective.ALLGATHER:
        return schedule.nsegments  # INPUT is the rank's own shard
    return schedule.nchunks


def landing_chunk(schedule: Schedule, src: int, dst: int, input_chunk: int) -> int | None:
    """The WORK chunk that INPUT chunk of ``src`` fills at ``dst`` (equal size by contract)."""
    if schedule.collective is Collective.ALLTOALL:
        if schedule.block_of(input_chunk) != dst:
            return None
        return schedule.chunk(src, schedule.segment_of(input_chunk))
    if schedule.collective is Collective.ALLGATHER:
        return schedule.chunk(src, input_chunk)
    return input_chunk


def required(schedule: Schedule, rank: int) -> dict[int, frozenset[Contribution]]:
    """What each result chunk of ``rank`` must hold: every contribution, exactly once."""
    everyone = range(schedule.nranks)
    need: dict[int, frozenset[Contribution]] = {}
    for c in result_chunks(schedule, rank):
        collective = schedule.collective
        if collective is Collective.ALLGATHER:
            origin = {(schedule.block_of(c), schedule.segment_of(c))}
        elif collective is Collective.ALLTOALL:
            src = schedule.block_of(c)
            origin = {(src, schedule.chunk(rank, schedule.segment_of(c)))}
        elif collective is Collective.BROADCAST or collective is Collective.SENDRECV:
            origin = {(schedule.root, c)}
        else:
            origin = {(q, c) for q in everyone}
        need[c] = frozenset(origin)
    return need


def check(schedule: Schedule) -> Report:
    """Raise :class:`ScheduleError` unless ``schedule`` meets its contract; else the report."""
    _check_shape(schedule)
    pairs = _pair_transfers(schedule)
    report = _play(schedule, pairs)
    for rank in range(schedule.nranks):
        have = report.final[rank]
        for chunk, need in required(schedule, rank).items():
            got = have[chunk]
            if got is None:
                raise ScheduleError(
                    f"{_name(schedule)}: rank {rank} ends with chunk {chunk} never filled"
                )
            if got != need:
                missing = sorted(need - got)
                extra = sorted(got - need)
                raise ScheduleError(
                    f"{_name(schedule)}: rank {rank} ends with chunk {chunk} wrong: "
                    f"missing contributions {missing}, unexpected {extra} "
                    "(as (origin rank, origin chunk))"
                )
    return report


def _name(schedule: Schedule) -> str:
    return f"{schedule.algorithm} {schedule.collective.value} on {schedule.nranks} ranks"


def _check_shape(schedule: Schedule) -> None:
    name = _name(schedule)
    if len(schedule.steps) != schedule.nranks:
        raise ScheduleError(f"{name}: steps for {len(schedule.steps)} ranks")
    for who in (schedule.root, schedule.peer):
        if who is not None and not 0 <= who < schedule.nranks:
            raise ScheduleError(f"{name}: root or peer {who} outside 0..{schedule.nranks - 1}")
    if (
        schedule.collective in SHARDED
        and schedule.nblocks != schedule.nranks
    ):
        raise ScheduleError(
            f"{name}: {schedule.nblocks} blocks; sharded collectives need one block per rank"
        )
    for rank, steps in enumerate(schedule.steps):
        for index, step in enumerate(steps):
            for position, transfer in enumerate(step):
                where = f"{name}: rank {rank} step {index}"
                if not 0 <= transfer.peer < schedule.nranks or transfer.peer == rank:
                    raise ScheduleError(f"{where}: peer {transfer.peer} is not another rank")
                limit = (
                    input_chunks(schedule)
                    if isinstance(transfer, Send) and transfer.buffer is Buffer.INPUT
                    else schedule.nchunks
                )
                if not 0 <= transfer.chunk < limit:
                    raise ScheduleError(f"{where}: chunk {transfer.chunk} outside 0..{limit - 1}")
                hazard = step_hazard(step[:position], transfer)
                if hazard:
                    raise ScheduleError(f"{where} {hazard}")


@dataclass
class _Pair:
    src: int
    src_step: int
    send: Send
    dst: int
    dst_step: int
    recv: Recv


def _pair_transfers(schedule: Schedule) -> list[list[list[_Pair]]]:
    """pairs[rank][step]: the pairs each step takes part in, matched in posting order."""
    name = _name(schedule)
    sends: dict[tuple[int, int], list[tuple[int, Send]]] = {}
    recvs: dict[tuple[int, int], list[tuple[int, Recv]]] = {}
    for rank, steps in enumerate(schedule.steps):
        for index, step in enumerate(steps):
            for t in step:
                if isinstance(t, Send):
                    sends.setdefault((rank, t.peer), []).append((index, t))
                else:
                    recvs.setdefault((t.peer, rank), []).append((index, t))
    pairs: list[list[list[_Pair]]] = [[[] for _ in steps] for steps in schedule.steps]
    for src, dst in sorted(set(sends) | set(recvs)):
        out, into = sends.get((src, dst), []), recvs.get((src, dst), [])
        if len(out) > len(into):
            index, send = out[len(into)]
            raise ScheduleError(
                f"{name}: rank {src} step {index} sends chunk {send.chunk} to rank {dst}, "
                f"which has no receive left for it ({len(out)} sends, {len(into)} receives)"
            )
        if len(into) > len(out):
            index, recv = into[len(out)]
            raise ScheduleError(
                f"{name}: rank {dst} step {index} receives chunk {recv.chunk} from rank {src}, "
                f"which never sends it ({len(out)} sends, {len(into)} receives)"
            )
        for (src_step, send), (dst_step, recv) in zip(out, into):
            lands = (
                landing_chunk(schedule, src, dst, send.chunk)
                if send.buffer is Buffer.INPUT
                else send.chunk
            )
            if recv.chunk != lands:
                raise ScheduleError(
                    f"{name}: rank {src} step {src_step} sends {send.buffer.value} chunk "
                    f"{send.chunk} but rank {dst} step {dst_step} receives it as chunk "
                    f"{recv.chunk}; it must land in chunk {lands}"
                )
            pair = _Pair(src, src_step, send, dst, dst_step, recv)
            pairs[src][src_step].append(pair)
            pairs[dst][dst_step].append(pair)
    return pairs


def _play(schedule: Schedule, pairs: list[list[list[_Pair]]]) -> Report:
    name = _name(schedule)
    nranks = schedule.nranks
    inputs = [
        {c: frozenset({(rank, c)}) for c in range(input_chunks(schedule))} for rank in range(nranks)
    ]
    work: list[dict[int, Contents]] = [
        dict.fromkeys(range(schedule.nchunks)) for _ in range(nranks)
    ]
    for rank in range(nranks):
        for input_chunk, work_chunk in seeded_chunks(schedule, rank):
            work[rank][work_chunk] = inputs[rank][input_chunk]

    position = [0] * nranks  # the step each rank is in
    payload: dict[int, frozenset[Contribution]] = {}  # id(pair) -> what it carried
    rounds: list[tuple[Delivery, ...]] = []
    while True:
        # A pair completes once both ranks are at its steps; it carries the sender's chunk
        # as it was when the sender's step began (nothing in that step may change it).
        for rank in range(nranks):
            if position[rank] >= len(schedule.steps[rank]):
                continue
            for pair in pairs[rank][position[rank]]:
                if id(pair) in payload or pair.src != rank:
                    continue
                if position[pair.dst] != pair.dst_step:
                    continue
                source = inputs if pair.send.buffer is Buffer.INPUT else work
                contents = source[rank][pair.send.chunk]
                if contents is None:
                    raise ScheduleError(
                        f"{name}: rank {rank} step {pair.src_step} sends chunk "
                        f"{pair.send.chunk} to rank {pair.dst} before it holds any data"
                    )
                payload[id(pair)] = contents
        finished = [
            rank
            for rank in range(nranks)
            if position[rank] < len(schedule.steps[rank])
            and all(id(p) in payload for p in pairs[rank][position[rank]])
        ]
        if not finished:
            break
        deliveries = []
        for rank in finished:
            for pair in pairs[rank][position[rank]]:
                if pair.dst != rank:
                    continue
                incoming = payload[id(pair)]
                chunk = pair.recv.chunk
                if pair.recv.reduce:
                    held = work[rank][chunk]
                    if held is None:
                        raise ScheduleError(
                            f"{name}: rank {rank} step {pair.dst_step} reduces into chunk "
                            f"{chunk}, which holds no data yet"
                        )
                    twice = held & incoming
                    if twice:
                        raise ScheduleError(
                            f"{name}: rank {rank} step {pair.dst_step} reduces chunk {chunk} "
                            f"from rank {pair.src} and would count {sorted(twice)} twice "
                            "(as (origin rank, origin chunk))"
                        )
                    work[rank][chunk] = held | incoming
                else:
                    work[rank][chunk] = incoming
                deliveries.append(
                    Delivery(
                        pair.src,
                        pair.src_step,
                        pair.send.chunk,
                        pair.send.buffer,
                        rank,
                        pair.dst_step,
                        chunk,
                        pair.recv.reduce,
                        incoming,
                    )
                )
        for rank in finished:
            position[rank] += 1
        if deliveries:
            rounds.append(tuple(deliveries))

    stuck = [r for r in range(nranks) if position[r] < len(schedule.steps[r])]
    if stuck:
        waits = []
        for rank in stuck:
            peers = sorted(
                {
                    (p.dst if p.src == rank else p.src)
                    for p in pairs[rank][position[rank]]
                    if id(p) not in payload
                }
            )
            waits.append(f"rank {rank} at step {position[rank]} waits for ranks {peers}")
        raise ScheduleError(f"{name}: deadlock: " + "; ".join(waits))
    return Report(tuple(rounds), tuple(work))
