"""A symbolic model of forwarding over peer memory: no schedule deadlocks, no message crosses.

docs/gpu.md's claim that forwarding (a receive's copy or reduction writing the next step's
send into the peer's inbox, ``Program.forwards``) cannot deadlock, every rank posting its receives a
step ahead, rests on this check rather than on counting steps: per-rank step numbers do not
line up across ranks outside the ring (tree levels, hierarchical phases, roots, zero-length
chunks dropping whole steps). Every rank's real compiled program
(``compile_program``) is played through a model of ``execute._run_delivered`` and
``bindings/peer_memory.PeerMemoryTransport``, over every family that forwards.

What is modelled is only the control traffic, which is all that can block:

* ``irecv`` sends the sender a *credit* and posts a receive for the *notice*;
* ``isend`` posts a receive for the credit;
* ``waitall`` first, for each send not forwarded, waits for its credit and sends its notice;
  then, for each receive not yet delivered, waits for its notice and delivers it; a receive
  with a forwarded send (``isend(..., produced_by=receive)``) waits for that send's credit
  as it delivers and sends that send's notice; last, it waits for its own credits and
  notices to be received.

Credits and notices are matched in posting order per (channel, sender, receiver), as MPI
matches one tag on one communicator. Sends are rendezvous (complete only once matched), which
is stricter than MPI's eager small messages: what cannot deadlock here cannot deadlock there.
Each credit and notice is labelled with the data message it stands for, and every match must
pair equal labels: a credit matched to the wrong send would have that send write into a slot
meant for another message.

Two controls show that the model does catch failures: without posting ahead the ring
deadlocks, and forwarded sends made before the step's own sends take their credits out of order.
"""

from __future__ import annotations

import dataclasses

import pytest

from pycoll import algorithms, model
from pycoll.execute import compile_program
from pycoll.schedule import Collective, Layout

# Every collective whose schedules receive a chunk and send it on (reducing or copying).
FORWARDING = (Collective.ALLREDUCE, Collective.REDUCE_SCATTER, Collective.REDUCE,
              Collective.ALLGATHER, Collective.BROADCAST)
ROOTED = (Collective.REDUCE, Collective.BROADCAST)


class Deadlock(Exception):
    pass


class Mismatch(Exception):
    pass


class Channel:
    """The credits (or notices) from one rank to another: the i-th sent matches the i-th
    receive posted. Each entry is the label of the data message it stands for."""

    def __init__(self, name):
        self.name = name
        self.sent = []
        self.posted = []

    def send(self, label):
        self.sent.append(label)
        return self._check(len(self.sent) - 1)

    def post(self, label):
        self.posted.append(label)
        return self._check(len(self.posted) - 1)

    def matched(self, index):
        return index < len(self.sent) and index < len(self.posted)

    def _check(self, index):
        if self.matched(index) and self.sent[index] != self.posted[index]:
            raise Mismatch(f"{self.name} #{index}: sent for message {self.sent[index]}, "
                           f"received for message {self.posted[index]}")
        return index


class Network:
    def __init__(self):
        self.channels = {}

    def channel(self, kind, src, dst):
        key = (kind, src, dst)
        if key not in self.channels:
            self.channels[key] = Channel(f"{kind} {src}->{dst}")
        return self.channels[key]

    def leftovers(self):
        return [c.name for c in self.channels.values() if len(c.sent) != len(c.posted)]


def wait(channel, index, why):
    """Block (yield to the scheduler) until message ``index`` on ``channel`` is matched."""
    if not channel.matched(index):
        yield why, lambda: channel.matched(index)


class Incoming:
    def __init__(self, label, credit, notice):
        self.label, self.credit, self.notice = label, credit, notice
        self.forward = None  # the Outgoing this receive's copy or reduction writes
        self.delivered = False


class Outgoing:
    def __init__(self, label, credit, forwarded):
        self.label, self.credit, self.forwarded = label, credit, forwarded
        self.notice = None  # (channel, index) once sent


class Transport:
    """One rank's PeerMemoryTransport, control messages only."""

    def __init__(self, network, rank):
        self.network, self.rank = network, rank

    def irecv(self, peer, label):
        credits = self.network.channel("credit", self.rank, peer)
        notices = self.network.channel("notice", peer, self.rank)
        return Incoming(label, (credits, credits.send(label)), (notices, notices.post(label)))

    def isend(self, peer, label, produced_by=None):
        credits = self.network.channel("credit", peer, self.rank)
        request = Outgoing(label, (credits, credits.post(label)), produced_by is not None)
        if produced_by is not None:
            assert produced_by.forward is None and not produced_by.delivered
            produced_by.forward = request
        return request

    def _notify(self, request):
        notices = self.network.channel("notice", self.rank, request.label[1])
        request.notice = (notices, notices.send(request.label))

    def waitall(self, requests):
        outgoing = [r for r in requests if isinstance(r, Outgoing)]
        incoming = [r for r in requests if isinstance(r, Incoming)]
        for r in outgoing:
            if not r.forwarded:
                yield from wait(*r.credit, f"credit for {r.label}")
                self._notify(r)
        for r in incoming:
            yield from wait(*r.notice, f"notice for {r.label}")
            if r.forward is not None:
                yield from wait(*r.forward.credit, f"credit for forward {r.forward.label}")
                self._notify(r.forward)
            r.delivered = True
        if any(r.notice is None for r in outgoing):
            raise Mismatch("waited for a forwarded send before the receive producing it")
        for r in incoming:  # rendezvous: a send completes once the peer has matched it
            yield from wait(*r.credit, f"credit sent for {r.label} to be taken")
        for r in outgoing:
            yield from wait(*r.notice, f"notice sent for {r.label} to be taken")


def message_labels(program, rank):
    """Per step, the labels (src, dst, n: the n-th message src sends dst) of the receives and
    of the transmits: both ends number their messages alike (compile_program drops the same
    empty ones and joins the same chunks on both sides)."""
    numbered = {}

    def label(src, dst):
        n = numbered.get((src, dst), 0)
        numbered[(src, dst)] = n + 1
        return src, dst, n

    return [([label(r.peer, rank) for r in receives], [label(rank, t.peer) for t in transmits])
            for receives, transmits in program.steps]


def run_delivered(program, rank, transport, post_ahead=True, forwards_first=False):
    """``execute._run_delivered`` with forwarding on (``copy_pair`` given, which the API
    does on one node where some rank forwards; here whenever ``program.posts_ahead``, the
    sizeless superset of that). The two flags break it on purpose, as
    controls: ``post_ahead=False`` forwards without posting receives a step ahead;
    ``forwards_first`` makes the forwarded sends before the step's own sends."""
    forwarding = program.posts_ahead
    ahead = forwarding and post_ahead
    labels = message_labels(program, rank)

    def post_receives(index):
        return [transport.irecv(label[0], label) for label in labels[index][0]]

    def forward(index, receiving):  # the next step's sends that this step's receives write
        if not forwarding:
            return {}
        following = labels[index + 1][1] if program.forwards[index] else ()
        return {j: transport.isend(following[j][1], following[j], produced_by=receiving[i])
                for i, j in program.forwards[index]}

    steps = len(program.steps)
    posted = post_receives(0) if steps else None
    made_last_step = {}  # this step's transmits, forwarded during the last step
    for index in range(steps):
        if posted is None:
            posted = post_receives(index)
        receiving = posted
        posted = post_receives(index + 1) if ahead and index + 1 < steps else None
        made_now = forward(index, receiving) if forwards_first else {}
        sends = []
        for j, label in enumerate(labels[index][1]):
            made = made_last_step.get(j)
            sends.append(made if made is not None else transport.isend(label[1], label))
        if not forwards_first:
            made_now = forward(index, receiving)
        made_last_step = made_now
        yield from transport.waitall(receiving + sends)


def play(programs, **options):
    """Run every rank's program to the end; raise Deadlock when no rank can move."""
    network = Network()
    ranks = {rank: run_delivered(program, rank, Transport(network, rank), **options)
             for rank, program in enumerate(programs)}
    waiting = {rank: ("start", lambda: True) for rank in ranks}
    while waiting:
        ready = [rank for rank, (_, can_go) in waiting.items() if can_go()]
        if not ready:
            raise Deadlock("; ".join(f"rank {rank} waits for {why}"
                                     for rank, (why, _) in waiting.items()))
        for rank in ready:  # waits only ever become satisfied: a ready rank stays ready
            try:
                waiting[rank] = next(ranks[rank])
            except StopIteration:
                del waiting[rank]
    assert not network.leftovers(), network.leftovers()


def build_programs(family, collective, nranks, nsegments, root, ranks_per_node, blocks):
    schedule = algorithms.build(family, collective, nranks, nsegments, root, None,
                                ranks_per_node)
    if isinstance(blocks, int):  # a count: even blocks, as the API builds them
        return model.programs(schedule, blocks)
    layout = Layout(list(blocks), schedule.nsegments)  # ReduceScatter's uneven counts
    return [compile_program(schedule, rank, layout, layout) for rank in range(nranks)]


def configurations(nranks):
    """Every (collective, family, ranks_per_node, root, segments, sizes) at nranks."""
    counts = sorted({0, 1, nranks - 1, nranks + 1, 2 * nranks + 1})
    for collective in FORWARDING:
        roots = sorted({0, nranks - 1}) if collective in ROOTED else [None]
        sizes = list(counts)
        if collective is Collective.REDUCE_SCATTER and nranks > 2:
            # uneven counts with an empty block in the middle (reduce_scatter's ``counts``)
            sizes.append(tuple(0 if rank == 1 else rank + 1 for rank in range(nranks)))
        for family in algorithms.families_for(collective):
            nodes = [0]
            if algorithms.node_aware(family):
                nodes += [k for k in (2, 3, 4) if k < nranks and nranks % k == 0]
            for ranks_per_node in nodes:
                for root in roots:
                    for nsegments in (1, 2, 3):
                        for size in sizes:
                            yield (family, collective, nranks, nsegments, root, ranks_per_node,
                                   size)


NRANKS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16]


@pytest.mark.parametrize("nranks", NRANKS)
def test_forwarding_never_deadlocks_nor_crosses_messages(nranks):
    played = forwarding = 0
    for configuration in configurations(nranks):
        programs = build_programs(*configuration)
        try:
            play(programs)
        except (Deadlock, Mismatch) as failure:
            pytest.fail(f"{configuration}: {type(failure).__name__}: {failure}")
        played += 1
        forwarding += any(any(step) for program in programs for step in program.forwards)
    assert played > 100
    # Not vacuous: from 2 ranks on, a good share of the configurations forward somewhere
    # (a sixth at 2 ranks, over half from 4 on; the rest have empty chunks or no
    # receive-then-send, as the direct families).
    if nranks >= 2:
        assert forwarding > played // 8, (forwarding, played)


@pytest.mark.parametrize("nranks", [3, 5, 8])
def test_ranks_that_differ_in_forwarding_still_meet(nranks):
    """PYCOLL_FORWARD=0 on some ranks (docs/gpu.md): those still post ahead, but forward
    nothing (the API empties their ``forwards``)."""
    for configuration in configurations(nranks):
        programs = build_programs(*configuration)
        for rank in range(1, nranks, 2):
            programs[rank] = dataclasses.replace(
                programs[rank], forwards=tuple(() for _ in programs[rank].steps))
        try:
            play(programs)
        except (Deadlock, Mismatch) as failure:
            pytest.fail(f"{configuration}: {type(failure).__name__}: {failure}")


# Controls: the model catches the failures that the executor's order avoids.


@pytest.mark.parametrize("nranks", [2, 3, 4, 7])
def test_forwarding_without_posting_ahead_deadlocks_the_ring(nranks):
    """Each rank's forward waits for the next rank's credit for the coming step, which that
    rank posts only once its own forward, waiting on the rank after it, is done: a cycle."""
    programs = build_programs("ring", Collective.ALLREDUCE, nranks, 1, None, 0, 2 * nranks + 1)
    play(programs)
    with pytest.raises(Deadlock):
        play(programs, post_ahead=False)


@pytest.mark.parametrize("configuration", [
    ("ring", Collective.ALLREDUCE, 4, 1, None, 0, 9),
    ("tree", Collective.REDUCE_SCATTER, 4, 2, None, 0, 5),
], ids=["ring-allreduce", "tree-reduce-scatter"])
def test_forwarding_before_the_steps_own_sends_crosses_credits(configuration):
    """The peer's credits come in the order of its receives, this step's before the next's:
    a forwarded send (next step's) posted first would take this step's credit."""
    programs = build_programs(*configuration)
    play(programs)
    with pytest.raises(Mismatch, match="credit"):
        play(programs, forwards_first=True)
