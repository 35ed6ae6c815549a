"""One endpoint over several transports, each serving some peers (IPC within the node, MPI
to other nodes): the communicator picks, per peer, the first transport that reaches it."""

from __future__ import annotations

from typing import Any


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
