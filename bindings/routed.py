"""One endpoint over several transports, each serving some peers (IPC within the node, MPI
to other nodes): the communicator picks, per peer, the first transport that reaches it."""

from __future__ import annotations

from typing import Any

import numpy as np


class _Routed:
    __slots__ = ("transport", "request", "reduction")

    def __init__(self, transport: Any, request: Any, reduction: _Reduction | None = None):
        self.transport, self.request, self.reduction = transport, request, reduction

    def done(self) -> bool:
        return self.request.done()


class _Reduction:
    """A reducing receive's ``combine``, which the router may hold back so that a step's
    reductions run in the order the step lists them (rank order, where the schedule asks for
    it: the same bits on every rank), whichever transport brought each."""

    __slots__ = ("combine", "keep", "now", "pieces")

    def __init__(self, combine: Any, keep: Any):
        self.combine = combine
        # a transport that lends its data only during the call (a ring, a peer's slot) says
        # how to keep a copy of it; None: the data is the receive's own
        self.keep = keep
        self.now = True  # set by waitall: reduce at once, or keep the pieces for later
        self.pieces: list[tuple[Any, int]] = []

    @property
    def lent(self) -> bool:
        return self.keep is not None

    def __call__(self, incoming: Any, offset: int = 0) -> None:
        if self.now:
            self.combine(incoming, offset)
        else:
            self.pieces.append((incoming if self.keep is None else self.keep(incoming), offset))

    def apply(self) -> None:
        for incoming, offset in self.pieces:
            self.combine(incoming, offset)
        self.pieces = []


class RoutedTransport:
    delivers = True

    def __init__(self, routes: list[Any]):
        """``routes[peer]``: the transport that reaches ``peer`` (all of one group)."""
        self.routes = routes
        self.rank, self.size = routes[0].rank, len(routes)
        # Endpoints that order a call on a new stream after the previous call's work (peer
        # memory): asked at every message, whichever route it takes, since a staged
        # delivery into an array is a write the previous call's peer reads may not follow.
        self._ordering = [t for t in {id(t): t for t in routes}.values()
                          if hasattr(t, "on_current_stream")]

    def isend(self, buf: Any, peer: int, tag: int) -> _Routed:
        for endpoint in self._ordering:
            endpoint.on_current_stream()
        transport = self.routes[peer]
        return _Routed(transport, transport.isend(buf, peer, tag))

    def irecv(self, buf: Any, peer: int, tag: int, combine: Any = None) -> _Routed:
        for endpoint in self._ordering:
            endpoint.on_current_stream()
        transport = self.routes[peer]
        if combine is None:
            return _Routed(transport, transport.irecv(buf, peer, tag))
        reduction = _Reduction(combine, getattr(transport, "keep", None))
        return _Routed(transport, transport.irecv(buf, peer, tag, reduction), reduction)

    def waitall(self, requests: list[_Routed]) -> None:
        # Each transport's waits depend only on messages its peers posted before waiting,
        # so finishing one transport's requests before another's cannot deadlock.
        groups: dict[int, tuple[Any, list]] = {}
        for r in requests:
            groups.setdefault(id(r.transport), (r.transport, []))[1].append(r.request)
        reducing = [r for r in requests if r.reduction is not None]
        if len({id(r.transport) for r in reducing}) <= 1:  # one transport keeps the order
            for r in reducing:
                r.reduction.now = True
            for transport, pending in groups.values():
                transport.waitall(pending)
            return
        # Several transports reduce: the data of all but one is kept, then reduced in the
        # listed order; one lending transport (shared memory, a peer's slot) whose
        # reductions are listed in one run reduces in place at its turn; other lent data is
        # copied first.
        lent = [i for i, r in enumerate(reducing) if r.reduction.lent]
        lenders = {id(reducing[i].transport) for i in lent}
        in_place = len(lenders) == 1 and lent[-1] - lent[0] + 1 == len(lent)
        turn = groups[lenders.pop()] if in_place else None
        for r in reducing:
            r.reduction.now = in_place and r.reduction.lent
        for transport, pending in groups.values():
            if turn is None or transport is not turn[0]:
                transport.waitall(pending)
        for r in reducing:
            if not r.reduction.now:
                r.reduction.apply()
            elif turn is not None:  # the lender's run of reductions, in its own order
                turn[0].waitall(turn[1])
                turn = None

    def sendrecv(self, send: Any, dst: int, recv: Any, src: int, tag: int) -> None:
        self.waitall([self.irecv(recv, src, tag), self.isend(send, dst, tag)])


class _Arrival:
    __slots__ = ("request", "into", "combine")

    def __init__(self, request: Any, into: Any, combine: Any):
        self.request, self.into, self.combine = request, into, combine

    def done(self) -> bool:
        return self.request.done()


class Delivered:
    """A host transport (MPI) behind a router whose other routes deliver: a receive that
    reduces lands in a temporary array and is combined once it has arrived."""

    delivers = True

    def __init__(self, host: Any):
        self.host = host
        self.rank, self.size = host.rank, host.size

    def isend(self, buf: Any, peer: int, tag: int) -> Any:
        return self.host.isend(buf, peer, tag)

    def irecv(self, buf: Any, peer: int, tag: int, combine: Any = None) -> Any:
        if combine is None:
            return self.host.irecv(buf, peer, tag)
        into = np.empty_like(buf)
        return _Arrival(self.host.irecv(into, peer, tag), into, combine)

    def waitall(self, requests: list) -> None:
        self.host.waitall([r.request if isinstance(r, _Arrival) else r for r in requests])
        for r in requests:
            if isinstance(r, _Arrival):
                r.combine(r.into)

    def sendrecv(self, send: Any, dst: int, recv: Any, src: int, tag: int) -> None:
        self.host.sendrecv(send, dst, recv, src, tag)
