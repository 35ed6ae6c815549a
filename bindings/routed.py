"""One endpoint over several transports, each serving some peers (IPC within the node, MPI
to other nodes): the communicator picks, per peer, the first transport that reaches it."""

from __future__ import annotations

from typing import Any

import numpy as np


class _Routed:
    __slots__ = ("transport", "request")

    def __init__(self, transport: Any, request: Any):
        self.transport, self.request = transport, request

    def done(self) -> bool:
        return self.request.done()


class RoutedTransport:
    delivers = True

    def __init__(self, routes: list[Any]):
        """``routes[peer]``: the transport that reaches ``peer`` (all of one group)."""
        self.routes = routes
        self.rank, self.size = routes[0].rank, len(routes)

    def isend(self, buf: Any, peer: int, tag: int) -> _Routed:
        transport = self.routes[peer]
        return _Routed(transport, transport.isend(buf, peer, tag))

    def irecv(self, buf: Any, peer: int, tag: int, combine: Any = None) -> _Routed:
        transport = self.routes[peer]
        return _Routed(transport, transport.irecv(buf, peer, tag, combine))

    def waitall(self, requests: list[_Routed]) -> None:
        # Each transport's waits depend only on messages its peers posted before waiting,
        # so finishing one transport's requests before another's cannot deadlock.
        by_transport: dict[int, tuple[Any, list]] = {}
        for r in requests:
            by_transport.setdefault(id(r.transport), (r.transport, []))[1].append(r.request)
        for transport, pending in by_transport.values():
            transport.waitall(pending)

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
