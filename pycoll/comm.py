"""Communicators: a group of ranks, how to reach each peer, and the calling rank's default.

A communicator owns two transport endpoints: one for collectives, whose tags are a sequence
number so that back-to-back collectives never mix messages, and one for the user's Send/Recv
tags. Under MPI each endpoint is a private duplicate of the caller's communicator, so pycoll's
messages never match the program's own.
"""

from __future__ import annotations

import numbers
import os
import sys
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pycoll import agree, select
from pycoll import verify as verification
from pycoll.bindings.local import LocalTransport, LocalWorld, run_threads
from pycoll.bindings.mpi import (
    MPITransport,
    launched_by_mpi,
    mpi,
    node_of_each_rank,
)
from pycoll.bindings.peer_memory import PeerMemoryTransport, SameProcessAccess
from pycoll.bindings.transport import INTERRUPTS, CollectiveTimeout, Transport, WaitTimeout
from pycoll.settings import whole_number
from pycoll.traffic import Traffic

_TAG_LIMIT = 32767  # the smallest MPI_TAG_UB the MPI standard allows
# What all_arrive guards, by number: each rank says which it came to. On a tag of their own,
# so that one rank's handshake never matches another's collective data, nor one setup another
_ARRIVALS = ("split", "empty", "the first collective (connecting shared memory)",
             "the first collective (sharing the tuning file's costs)")
_ARRIVAL_TAG = _TAG_LIMIT  # above every collective's (next_tag), on the collective transport
# The agreement's and the verification's exchanges, likewise: a rank whose comm.check or
# comm.verify was set and a rank whose was not must never read each other's checksums as a
# collective's data (16 bytes of sums were taken for a 2-element float64 AllReduce's).
AGREEMENT_TAG = _TAG_LIMIT - 1
VERIFICATION_TAG = _TAG_LIMIT - 2
_COLLECTIVE_TAGS = _TAG_LIMIT - 2  # next_tag's: 0 up to below the reserved ones


class Communicator:
    """One rank's view of a group of ranks.

    ``Communicator(mpi_comm)`` wraps an mpi4py communicator (default ``MPI.COMM_WORLD``);
    in-process ranks get theirs from :func:`run_local`.
    """

    def __init__(self, mpi_comm: Any = None):
        _require_mpi_running()
        # first: a rank whose settings are bad raises below, alone, while its peers go on to
        # make the world together; uncaught, its error must end the job, not leave them
        _abort_job_on_uncaught_exception()
        try:
            check_environment()
        except ValueError as error:  # raised below, after the peers hear of it
            bad_setting: ValueError | None = error
        else:
            bad_setting = None
        MPI = mpi()
        parent = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        if not isinstance(parent, MPI.Intracomm) or parent == MPI.COMM_NULL:
            # an intercommunicator's allgather joins the other group: making one would hang
            raise TypeError(f"mpi_comm={mpi_comm!r} is invalid; allowed: an mpi4py "
                            "intracommunicator (MPI.Intracomm, not COMM_NULL)")
        if parent.Get_size() > 1:
            _everyone_comes(parent, None if bad_setting else _timeout_from_env())
        # one rank on shared memory and one not would wait forever; a rank's bad setting goes
        # round as its text: caught there, its peers would wait here for a rank never coming
        tables = (parent.allgather(str(bad_setting) if bad_setting else shared_settings())
                  if parent.Get_size() > 1 else [])
        if bad_setting is not None:
            raise bad_setting
        bad = [(r, said) for r, said in enumerate(tables) if isinstance(said, str)]
        if bad:
            raise ValueError("; ".join(f"rank {r}: {said}" for r, said in bad))
        differ = settings_disagreement(tables) if tables else None
        if differ is not None:
            raise ValueError(differ)
        self.mpi_comm = parent
        self._owns_mpi_comm = False
        self._attach(MPITransport(parent.Dup()), MPITransport(parent.Dup()))
        self.nodes()  # collective (a shared-memory split): here, where every rank is

    @classmethod
    def _over(cls, transport: Transport, p2p: Transport) -> Communicator:
        """A communicator over ready transports (the in-process world)."""
        check_environment()
        comm = cls.__new__(cls)
        comm.mpi_comm = None
        comm._owns_mpi_comm = False
        comm._attach(transport, p2p)
        return comm

    def _attach(self, transport: Transport, p2p: Transport) -> None:
        self.transport = transport
        self.p2p = p2p
        # any thread may call MPI (MPI_THREAD_MULTIPLE), or this is no MPI communicator
        self.threads_may_call_mpi = self.mpi_comm is None or mpi_thread_level() == "multiple"
        self.rank = transport.rank
        self.size = transport.size
        self._sequence = 0
        self._splits = 0
        self.freed = False
        self.queue: Any = None  # async collectives' worker (pycoll/work.py), made on first use
        self.lanes: dict[tuple[str, int], Any] = {}  # async device Send/Recv's (see submit)
        self._posted: list[Any] = []  # posted host Send/Recv requests (see keep_until_done)
        self._prune_at = 64
        self.broken: str | None = None  # why later calls must fail at once (broken_by)
        self._timeout = _timeout_from_env()
        self._apply_timeout()
        # PYCOLL_CHECK: each collective first agrees on its arguments (pycoll/agree.py)
        self._check = agree.enabled_by_default()
        self.agreeing = False  # inside the agreement's own exchange
        self.agreements = 0  # collectives checked so far: the sequence number
        # PYCOLL_VERIFY: each collective's result checked against the oracle (pycoll/verify.py)
        self._verify = verification.enabled_by_default()
        self.verifying = False  # inside a verified call or its check
        self.prepared: dict[tuple, Any] = {}  # per call shape: a PreparedCall, or a known call
        self._device_transports: dict[tuple, Any] = {}
        self._pair_locks: dict[int, threading.Lock] = {}  # peer -> making its Send/Recv routes
        self.topologies: dict[str, Any] = {}  # per kind of transport: the costs selection uses
        self._buffers: dict[tuple, Any] = {}
        self._host: Any = None  # the host arrays' endpoint, made by the first collective
        self._host_kind: str | None = None  # what it is (host_kind), fixed at first use
        self._shared: Any = None  # its shared-memory part, when ranks share a node
        self._node_comm: Any = None
        self._one_shot_by: dict[Any, tuple] = {}
        self._nodes: list[int] | None = None
        self._traffic: Traffic | None = None

    def submit(self, fn: Callable[..., Any], what: str, *args: Any,
               lane: tuple[str, int] | None = None, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` (a collective on this communicator) on its worker;
        returns a :class:`pycoll.work.Work`. ``lane``: ``("send", peer)`` or ``("recv",
        peer)``: async Send/Recv of device arrays run on a worker per direction and peer, in
        call order there, so that a receive waiting for its message holds back no send."""
        from pycoll.work import AsyncQueue

        queue = self.queue if lane is None else self.lanes.get(lane)
        if queue is None:
            if not self.threads_may_call_mpi:
                raise RuntimeError(f"async_op=True needs MPI initialised with {needs_threads()}")
            world = getattr(self.transport, "world", None)  # in-process only
            queue = AsyncQueue(world, getattr(self.transport, "world_rank", 0))
            if lane is None:
                self.queue = queue
            else:
                self.lanes[lane] = queue
        rank_default = _default.comm  # in-process, the rank's: world() in the job is too

        def job(*args: Any, **kwargs: Any) -> Any:
            _default.comm = rank_default
            try:
                return fn(*args, **kwargs)
            except Exception as error:
                if self.broken is None and not _in_step_after(error):
                    # this rank left a collective its peers may still be in: a later call
                    # would pair with theirs (its arguments were checked at the call)
                    self.broken = f"its async {what} failed: {type(error).__name__}: {error}"
                raise
            finally:
                _default.comm = None

        return queue.submit(job, what, *args, **kwargs)

    def drain(self, lane: tuple[str, int] | None = None) -> None:
        """Let the async work queued on ``lane`` (None: the collectives') finish first."""
        queue = self.queue if lane is None else self.lanes.get(lane)
        if queue is not None and queue.busy:
            queue.drain()
            if self.broken is not None:  # by one of those: this call must not run either
                self.ensure_usable()

    @property
    def verify(self) -> bool:
        """Whether each collective's result is checked against the numpy oracle, raising
        :class:`pycoll.VerificationError` on every rank if any rank's differs (see
        pycoll/verify.py; debugging only: it costs far more than the collective). Default
        from ``PYCOLL_VERIFY``. Set it alike on every rank."""
        return self._verify

    @verify.setter
    def verify(self, on: bool) -> None:
        self._before_switching("verify", on)
        if on:
            verification.turn_on()
        self._verify = bool(on)

    @property
    def check(self) -> bool:
        """Whether each collective first checks that every rank agrees on its arguments,
        raising :class:`pycoll.CollectiveMismatch` on every rank if not (pycoll/agree.py).
        Default from ``PYCOLL_CHECK``. Set it alike on every rank."""
        return self._check

    @check.setter
    def check(self, on: bool) -> None:
        self._before_switching("check", on)
        self._check = bool(on)

    def _before_switching(self, name: str, on: bool) -> None:
        """Refuse a switch that is not a bool; then let the async calls queued before run
        as they were asked, alike on every rank."""
        if not isinstance(on, bool | np.bool_):
            raise TypeError(f"{name}={on!r} is invalid; allowed: True or False")
        self.drain()

    @property
    def timeout(self) -> float | None:
        """Seconds any wait of a collective may take before it raises CollectiveTimeout
        (naming the collective, algorithm, step and peers) and breaks this communicator;
        None (or inf, or more than any wait can take): no deadline. Default from
        ``PYCOLL_TIMEOUT``. Set it alike on every rank."""
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float | None) -> None:
        seconds = _valid_timeout(seconds, "timeout")
        self.drain()  # async collectives queued before keep the deadline they were asked with
        self._timeout = seconds
        self._apply_timeout()

    def _apply_timeout(self) -> None:
        """Give every host endpoint (and those behind routes) this communicator's deadline."""
        tops = [self.transport, self.p2p, getattr(self, "_host", None),
                getattr(self, "_shared", None), *getattr(self, "_device_transports", {}).values()]
        for endpoint in _reachable(*tops):
            if hasattr(endpoint, "timeout"):
                endpoint.timeout = self._timeout

    def nodes(self) -> list[int]:
        """Each rank's node number (0 upward in order of the nodes' lowest ranks): ranks that
        share memory under MPI (found when the communicator is made), else
        ``PYCOLL_RANKS_PER_NODE`` consecutive ranks per node (in-process: one node unless
        set; under MPI it overrides the discovery, to simulate nodes on one machine)."""
        if self._nodes is None:
            if self.mpi_comm is not None and not os.environ.get("PYCOLL_RANKS_PER_NODE",
                                                                "").strip():
                self._nodes = node_of_each_rank(self.mpi_comm)
            else:
                per_node = _ranks_per_node(self.size)
                self._nodes = [r // per_node for r in range(self.size)]
        return self._nodes

    @property
    def traffic(self) -> Traffic:
        """Messages and bytes this rank has handed its transports, per link class (intra-
        and inter-node): ``comm.traffic.bytes["inter"]``; ``comm.traffic.reset()``."""
        if self._traffic is None:
            self._traffic = Traffic(self.nodes(), self.rank)
        return self._traffic

    @property
    def ranks_per_node(self) -> int:
        """k when the ranks form nodes of k consecutive ranks each and there is more than one
        node (what the hierarchical schedules and the cost model's two link classes need);
        0 otherwise (one node, or nodes of unequal or scattered ranks)."""
        nodes = self.nodes()
        k = nodes.count(0)
        regular = self.size % k == 0 and nodes == [r // k for r in range(self.size)]
        return k if regular and k < self.size else 0

    def host_transport(self) -> Any:
        """The endpoint that moves host (numpy) arrays for collectives, made on first use.

        Ranks of one node reach each other through shared memory (bindings/shm.py) and the
        others over MPI; ``PYCOLL_HOST_TRANSPORT=auto|shm|mpi`` chooses (``auto``: shared
        memory between MPI processes, the rendezvous transport between in-process threads;
        ``mpi``: messages only). Every rank makes it in the same call, its first collective.
        """
        if self._host is None:
            try:
                host = self._make_host_transport()
            except WaitTimeout as late:  # in-process: a rank of the node did not come
                raise self.timed_out("the first collective (connecting shared memory)",
                                      late) from None
            except INTERRUPTS as stop:  # the peers go on making it
                self.interrupted("the first collective (connecting shared memory)", stop)
                raise
            self._host = host  # kept if the sharing below fails (an unreadable tuning file):
            self._apply_timeout()  # the scheduled calls' topology_for shares again, and raises
            if self.mpi_comm is not None and self.host_kind() not in self.topologies:
                self.share_costs()  # here, where every rank is, whatever its path
        return self._host

    def share_costs(self) -> None:
        """Under MPI, rank 0's tuned costs (host arrays' and device arrays') on every rank,
        so that all choose alike (``select.share_tuning``). Collective: made by the first
        collective of each rank, whatever its path (the host transport's making, or a first
        device call), within the timeout."""
        from pycoll import select

        self.all_arrive("the first collective (sharing the tuning file's costs)")
        select.share_tuning(self)

    def host_transport_made(self) -> bool:
        """Whether ``host_transport`` has been made (by a first collective)."""
        return self._host is not None

    def host_kind(self) -> str:
        """The kind of transport host arrays take, as tuning files name it: "shm" (some ranks
        share a node), "mpi", or "local" (in-process threads); the same on every rank, so
        that every rank chooses alike. Read off the layout: making no transport, it may be
        asked on one rank alone."""
        if self._host_kind is None:
            mode = _host_transport_mode()
            kind = "mpi" if self.mpi_comm is not None else "local"
            if not (self.size == 1 or mode == "mpi" or (mode == "auto" and self.mpi_comm is None)
                    ) and len(set(self.nodes())) < self.size:
                kind = "shm"
            self._host_kind = kind
        return self._host_kind

    def node_transport(self) -> Any:
        """The shared-memory endpoint when it reaches every rank of this communicator."""
        self.host_transport()
        shared = self._shared
        return shared if shared is not None and len(shared.local) == self.size else None

    def one_shot(self) -> Any:
        """The shared-memory endpoint that serves small AllReduces in one shot, when it
        reaches every rank and ``PYCOLL_ALGO`` forces no AllReduce family; else None."""
        from pycoll.schedule import Collective

        return self.one_shot_for(Collective.ALLREDUCE)

    def one_shot_for(self, collective: Any) -> Any:
        """The shared-memory endpoint when it reaches every rank, for small calls of
        ``collective`` in one shot through its slots, unless ``PYCOLL_ALGO`` forces that
        collective's family; else None."""
        # keyed by the name: an Enum member hashes in Python code, on every small call
        found = self._one_shot_by.get(collective._value_)
        if found is None:
            from pycoll.select import forced_algorithm

            shared = self.node_transport()
            found = self._one_shot_by[collective._value_] = (
                (shared,) if forced_algorithm(collective) is None else (None,))
        return found[0]

    def keep_until_done(self, request: Any) -> None:
        """Hold a posted Send's or Recv's request, and with it its buffer, until it completes:
        a caller may drop the Work without waiting (as with torch.distributed's isend), and
        MPI would go on reading or writing memory numpy freed."""
        if len(self._posted) >= self._prune_at:  # now and then: those done need no holding
            self._posted = [r for r in self._posted if not self.p2p.test(r)]
            self._prune_at = max(64, 2 * len(self._posted))  # many pending: not every post
        self._posted.append(request)

    def ensure_usable(self) -> None:
        """Raise unless this communicator may be called: neither freed nor broken."""
        if self.freed:
            raise RuntimeError(f"{self!r} was freed (Communicator.free); allowed: a live one")
        if self.broken is not None:
            raise RuntimeError(f"{self!r} is broken ({self.broken}); make a new communicator")

    def all_arrive(self, what: str) -> None:
        """Under MPI with a timeout: wait, within it, until every rank has come to ``what``,
        a blocking MPI call that has no deadline of its own (the others would wait in it
        forever for a rank that never comes). Two rounds of empty messages with every peer:
        "here", then "going in"; a rank enters only with every peer's "going in", so a rank
        that comes after the others gave up times out too instead of entering alone. Past the
        deadline: CollectiveTimeout naming the ranks waited for; this communicator is broken.
        Each message says which call ``what`` is (one of ``_ARRIVALS``): ranks that came to
        different ones (a rank whose split raised, now in its first collective) would enter
        different blocking calls; every rank raises CollectiveMismatch instead, naming them."""
        if self.mpi_comm is None or self._timeout is None or self.size == 1:
            return
        transport = self.transport
        peers = [r for r in range(self.size) if r != self.rank]
        mine = np.array([_ARRIVALS.index(what)], np.int32)
        theirs = np.empty((len(peers), 1), np.int32)
        for round_ in ("here", "going in"):
            requests = [transport.irecv(theirs[i], peer, _ARRIVAL_TAG)
                        for i, peer in enumerate(peers)]
            requests += [transport.isend(mine, peer, _ARRIVAL_TAG) for peer in peers]
            try:
                transport.waitall(requests)
            except WaitTimeout as late:
                raise self.timed_out(what, late) from None
            except INTERRUPTS as stop:
                self.interrupted(what, stop)
                raise
            if round_ == "here" and (theirs != mine).any():  # seen by every rank: all raise
                ranks_at: dict[int, list[int]] = {}
                for rank, code in sorted([*zip(peers, theirs[:, 0].tolist()),
                                          (self.rank, int(mine[0]))]):
                    ranks_at.setdefault(code, []).append(rank)
                raise agree.CollectiveMismatch(
                    f"{what}: the ranks came to different calls that set up communicators, "
                    "and none entered its own: " + "; ".join(
                        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: "
                        f"{_ARRIVALS[code]}" for code, ranks in ranks_at.items()))

    def timed_out(self, what: str, late: WaitTimeout) -> CollectiveTimeout:
        """The error for a wait of ``what`` past its deadline; this communicator is broken."""
        return self.broken_by(CollectiveTimeout(
            f"{what}: rank {self.rank} waited {late.seconds:g} s for rank(s) "
            f"{', '.join(map(str, late.peers))}"))

    def interrupted(self, what: str, stop: BaseException) -> None:
        """Mark this communicator broken: ``stop`` (KeyboardInterrupt, SystemExit) ended this
        rank's part in ``what`` midway, while its peers may still be in it; a later call would
        pair with theirs (and the one-shot's slot be written twice), as after a timeout.
        A communicator of one rank has no peers in it: it goes on (Ctrl-C in a notebook must
        not break the default world for good)."""
        if self.size == 1:
            return
        self.broken = (f"{what} was interrupted by {type(stop).__name__} midway, and the other "
                       "ranks may still be in it")

    def broken_by(self, error: Exception) -> Exception:
        """Mark this communicator broken by ``error`` (later calls fail at once, saying why);
        returns ``error``."""
        self.broken = str(error)
        return error

    def _make_host_transport(self) -> Any:
        from pycoll.bindings import shm
        from pycoll.bindings.routed import Delivered, RoutedTransport

        if self.host_kind() in ("mpi", "local"):  # messages only
            return self.transport
        ring, small = shm.ring_bytes_from_env(), shm.small_bytes_from_env()
        nodes = self.nodes()
        local = [r for r in range(self.size) if nodes[r] == nodes[self.rank]]
        if self.mpi_comm is not None:
            self.all_arrive("the first collective (connecting shared memory)")
            # on pycoll's duplicate: this runs in the first collective, maybe on the async
            # worker, beside the program's own calls on its communicator
            self._node_comm = self.transport.comm.Split(nodes[self.rank], self.rank)
            short = self._short_of_shared_memory(
                nodes, shm.node_bytes_touched(len(local), ring, small))
            if short:  # seen alike by every rank: all take messages, or all raise
                said = (f"shared memory for host arrays needs {short}: give the node more "
                        "(docker run --shm-size), or lower PYCOLL_SHM_RING_BYTES (now "
                        f"{ring} bytes per peer)")
                if _host_transport_mode() == "shm":
                    raise MemoryError(f"PYCOLL_HOST_TRANSPORT='shm': {said}; allowed: "
                                      "PYCOLL_HOST_TRANSPORT=auto or mpi, which take messages")
                if self.rank == 0:
                    print(f"pycoll: {said}; host arrays take MPI messages instead",
                          file=sys.stderr, flush=True)
                self._host_kind = "mpi"  # the costs that choose algorithms: messages'
                return self.transport
            if len(local) == 1:
                return self.transport
            segments = shm.MpiSegments(self._node_comm, shm.segment_bytes(len(local), ring, small))
            # A rank that dies takes the MPI job down; what a wait in shared memory owes MPI
            # is progress: MPICH moves a large message only while its receiver calls MPI, and
            # a Send into this rank's posted Recv would wait for as long as this rank polls.
            check = _progress_of(self.p2p.comm)
        else:
            host = self.transport
            if len(local) == 1:
                return self.transport
            world, world_rank = host.world, host.world_rank

            def check(awaited: list[int], moved: bool) -> None:
                world.check_waiting(world_rank, [host.members[r] for r in awaited], moved)

            segments = shm.ThreadSegments(
                world.shared, (host.channel, "shm", nodes[self.rank]), local.index(self.rank),
                local, shm.segment_bytes(len(local), ring, small), check, self._timeout,
            )
        self._shared = shm.SharedMemoryTransport(
            segments, self.rank, self.size, local, ring, small, check=check
        )
        self._shared.connect()  # every segment exists (and is zeroed) before anyone writes
        if len(local) == self.size:
            return self._shared
        remote = Delivered(self.transport)
        return RoutedTransport([self._shared if p in local else remote for p in range(self.size)])

    def _short_of_shared_memory(self, nodes: list[int], need: int) -> str:
        """Under MPI, collective: where some node has less shared memory free than its ranks'
        windows ``need`` (bytes, this rank's node's total), what it needs and has, alike on
        every rank; else "" (nothing known counts as enough)."""
        from pycoll.bindings import shm

        free = shm.shared_memory_free() if need else None
        short = {}
        for node, needed, has in self.transport.comm.allgather((nodes[self.rank], need, free)):
            if has is not None and needed > has:
                short[node] = (needed, min(has, short.get(node, (0, has))[1]))
        return "; ".join(
            f"{_mib(needed)} on node {node}, where {shm.SHARED_MEMORY_FOLDER} has {_mib(has)} "
            "free" for node, (needed, has) in sorted(short.items()))

    def shared_empty(self, shape: Any, dtype: Any) -> np.ndarray:
        """An array in a new shared window (collective: every rank calls it); a plain numpy
        array when this rank shares no memory with a peer."""
        from pycoll.bindings import shm

        self.host_transport()
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        if self.mpi_comm is not None:
            self.all_arrive("empty")  # a rank alone on its node too: every rank comes here
            # every rank alike (the most any holds), those alone on their node too: one
            # raising alone would leave its node waiting in the window's allocation
            held = self.transport.comm.allreduce(shm.MpiSegments.held, op=mpi().MAX)
            if held >= shm.MAX_WINDOWS:
                raise ValueError(
                    f"empty: a rank holds {held} shared windows (each array of pycoll.empty "
                    f"lives as long as its communicator); allowed: at most {shm.MAX_WINDOWS} "
                    "(MPI runs out of context ids and crashes): reuse the arrays, or make "
                    "them on a sub-communicator and free() it")
            local = len(self._shared.local) if self._shared is not None else 0
            pages = -(-max(1, count * dtype.itemsize) // shm.PAGE) * shm.PAGE
            short = self._short_of_shared_memory(self.nodes(), pages * local)
            if short:  # touching it would kill the ranks with SIGBUS
                raise MemoryError(
                    f"empty(shape={shape!r}, dtype={dtype}): the array's window needs {short};"
                    " allowed: an array that fits, or a node with more shared memory (docker "
                    "run --shm-size)")
        if self._shared is None:
            return np.empty(shape, dtype)
        nbytes = max(1, count * dtype.itemsize)
        if self.mpi_comm is not None:
            segments = shm.MpiSegments(self._node_comm, nbytes)
        else:
            host = self.transport
            key = (host.channel, "window", len(self._shared._windows), self._shared.local[0])
            try:
                segments = shm.ThreadSegments(host.world.shared, key,
                                              self._shared.local.index(self.rank),
                                              self._shared.local, nbytes, self._shared._check,
                                              self._timeout)
            except WaitTimeout as late:
                raise self.timed_out("empty", late) from None
        mine = self._shared.add_window(segments)
        return mine[: count * dtype.itemsize].view(dtype).reshape(shape)

    def buffer(self, purpose: str, count: int, dtype: Any, space: Any) -> Any:
        """A flat array of ``count`` elements kept for ``purpose`` (scratch, a temporary
        result) between calls: fresh memory would be paid for again in page faults on every
        large call. It grows to the largest call's size; calls on one communicator never
        overlap, so one buffer per purpose serves them all. Device arrays get fresh memory:
        calls on different streams could overlap there, and CuPy's pool reuses memory in
        stream order anyway."""
        if space.is_device:
            return space.empty(count, dtype)
        key = (purpose, dtype, space.name)
        kept = self._buffers.get(key)
        if kept is None or kept.size < count:
            kept = self._buffers[key] = space.empty(max(count, 2 * kept.size if kept is not None
                                                        else count), dtype)
        return kept[:count]

    def device_transport(self, space: Any, route: tuple[int, int] | None = None) -> Any:
        """The endpoint that moves ``space``'s (device) arrays, made on first use.

        For collectives (``route`` None), every rank makes it at the same call (its first
        device collective), since making it takes collective steps (duplicating MPI
        communicators). Send/Recv's endpoints carry the messages of one ``route`` (source,
        destination) each: made by the two ranks alone, both routes of the pair at their
        first message (as torch.distributed makes a NCCL communicator per pair), while the
        other ranks are not in that call. One endpoint per route, so that the sending and
        the receiving worker of a pair never share one (its event and stream order calls
        made one after another). In-process ranks map each other's memory directly; MPI
        ranks use CUDA IPC within a node and MPI between nodes
        (``PYCOLL_DEVICE_TRANSPORT=auto|ipc|staged`` forces one; ``staged`` runs MPI even
        within a node).
        """
        key = (space.name, route)
        transport = self._device_transports.get(key)
        if transport is not None:
            return transport
        if route is None:
            transport = self._device_transports[key] = self._group_device_transport(space)
        else:
            peer = route[1] if route[0] == self.rank else route[0]
            # Both routes of a pair at once, in one order on both ranks; a lock per peer, as
            # a rank's send and receive workers may both come first (one lock for all peers
            # could wait in a cycle of ranks).
            with self._pair_locks.setdefault(peer, threading.Lock()):
                transport = self._device_transports.get(key)
                if transport is None:
                    low, high = sorted((self.rank, peer))
                    for way in ((low, high), (high, low)):
                        self._device_transports[(space.name, way)] = (
                            self._pair_device_transport(space, peer, way))
                    transport = self._device_transports[key]
        self._apply_timeout()
        return transport

    def _group_device_transport(self, space: Any) -> Any:
        if self.mpi_comm is None:
            return _in_process_device_transport(space, self.transport, self.nodes())
        # pycoll's duplicate (the user may free theirs); the user's for its info (whether MPI
        # takes device memory) while it is not freed
        user = self.mpi_comm
        return _mpi_device_transport(self.transport.comm, space, self.nodes(),
                                     info_from=self.transport.comm if user == mpi().COMM_NULL
                                     else user)

    def _pair_device_transport(self, space: Any, peer: int, route: tuple[int, int]) -> Any:
        pair = sorted((self.rank, peer))
        nodes = [self.nodes()[r] for r in pair]
        if self.mpi_comm is None:
            host = self.p2p.subgroup(pair, f"{self.p2p.channel}/route{route[0]}->{route[1]}")
            inner = _in_process_device_transport(space, host, nodes)
        else:
            # Only the pair calls this: MPI_Comm_create_group is collective over its group
            # alone. A distinct tag per pair keeps a rank's concurrent creations apart. No
            # deadline can interrupt it, so first a word each way under the deadline (on
            # the tag user Send/Recv may not take): the peer is there, or WaitTimeout.
            words = np.zeros(2, np.int64)
            self.p2p.waitall([self.p2p.irecv(words[:1], peer, _TAG_LIMIT),
                              self.p2p.isend(words[1:], peer, _TAG_LIMIT)])
            parent = self.p2p.comm
            tag = (pair[0] * self.size + pair[1]) % _TAG_LIMIT
            everyone = parent.Get_group()
            group = everyone.Incl(pair)
            pair_comm = parent.Create_group(group, tag)
            group.Free()
            everyone.Free()
            try:
                inner = _mpi_device_transport(pair_comm, space, nodes)
            finally:
                pair_comm.Free()  # the endpoint keeps its own duplicates
        return Renumbered(inner, pair)

    def free(self) -> None:
        """Release what this communicator holds: its shared memory (rings and ``pycoll.empty``
        windows; arrays from ``pycoll.empty`` must not be used afterwards), its device
        buffers, and its MPI duplicates. Collective: every rank calls it; later calls on this
        communicator raise."""
        if self.freed:
            return
        from pycoll.api import barrier

        try:
            self.free_device_buffers()  # collective even where this rank made no endpoint
            barrier(self)  # nobody still reads a peer's memory
        except (ValueError, TimeoutError) as error:  # named calls the program did not make
            said = type(error)(f"free() (collective: every rank of the communicator calls "
                               f"it): {error}")
            raise said if isinstance(error, agree.AgreedError) else self.broken_by(said) from None
        if self._shared is not None:
            self._shared.free()
        if self._node_comm is not None:
            self._node_comm.Free()
        for transport in {id(t): t for t in (self.transport, self.p2p)}.values():
            getattr(transport, "free", lambda: None)()
        if self._owns_mpi_comm:  # made by split: pycoll's to free (never the user's own)
            self.mpi_comm.Free()
        for queue in [self.queue, *self.lanes.values()]:  # drained by free_device_buffers
            if queue is not None:
                queue.close()
        freed = _Freed(self.rank, self.size)
        self.transport = self.p2p = self._host = freed
        self._shared = self._node_comm = None
        self._one_shot_by.clear()
        self.prepared.clear()
        self._buffers.clear()
        self.freed = True

    def free_device_buffers(self) -> None:
        """Unmap peers' device buffers, wait for every rank to do the same, then free this
        rank's own (memory must outlive every mapping of it) and the device endpoints' MPI
        communicators. Collective: every rank calls it; the next device collective makes new
        buffers."""
        for lane in [None, *self.lanes]:  # async calls queued before may use the endpoints
            self.drain(lane)
        inside = _reachable(*self._device_transports.values())
        self._device_transports = {}
        endpoints = [t for t in inside if isinstance(t, PeerMemoryTransport)]
        for endpoint in endpoints:
            endpoint.close()
        from pycoll.api import barrier

        barrier(self)
        for endpoint in endpoints:
            endpoint.release()
        _free_duplicates(inside)

    def next_tag(self) -> int:
        """The tag of the next collective; every rank calls collectives in the same order."""
        self._sequence = (self._sequence + 1) % _COLLECTIVE_TAGS
        return self._sequence

    def split(self, color: int | None, key: int = 0) -> Communicator | None:
        """Ranks that pass the same ``color`` form a new communicator, ordered by ``key`` then
        rank; ``color=None`` takes no part and gets None. Every rank of this one must call it.
        The new one starts with this one's ``timeout``, ``check`` and ``verify``.
        """
        self.ensure_usable()
        # MPI_Comm_split takes C ints
        if color is not None and (not is_int(color) or not 0 <= color < 2**31):
            raise ValueError(f"split: color={color!r} is invalid; allowed: an int in "
                             f"0..{2**31 - 1}, or None")
        if not is_int(key) or not -2**31 <= key < 2**31:
            raise ValueError(f"split: key={key!r} is invalid; allowed: an int in "
                             f"{-2**31}..{2**31 - 1}")
        color, key = None if color is None else int(color), int(key)  # numpy ints too
        self.drain()  # the async collectives queued before it use this communicator's MPI
        if self.mpi_comm is not None:
            MPI = mpi()
            self.all_arrive("split")
            # on pycoll's duplicate: the user may have freed the communicator it wraps
            child = self.transport.comm.Split(MPI.UNDEFINED if color is None else color, key)
            if child == MPI.COMM_NULL:
                return None
            made = Communicator(child)
            made._owns_mpi_comm = True
            # the parent's nodes, simulated ones too (PYCOLL_RANKS_PER_NODE)
            made._nodes = _first_seen_order(child.allgather(self.nodes()[self.rank]))
            return made._settings_of(self)
        from pycoll.api import allgather

        self._splits += 1
        mine = np.array([-1 if color is None else color, key], np.int64)
        table = allgather(mine, comm=self, algorithm="direct").reshape(self.size, 2)
        if color is None:
            return None
        members = sorted((int(k), r) for r, (c, k) in enumerate(table) if c == color)
        group = [r for _, r in members]
        channel = f"{self.transport.channel}/{self._splits}:{color}"
        made = Communicator._over(
            self.transport.subgroup(group, channel), self.p2p.subgroup(group, channel + "/p2p")
        )
        parent_nodes = self.nodes()
        made._nodes = _first_seen_order([parent_nodes[r] for r in group])
        return made._settings_of(self)

    def _settings_of(self, parent: Communicator) -> Communicator:
        """This new communicator with ``parent``'s timeout, check and verify (as an MPI
        communicator inherits its parent's error handler); returns it."""
        self.timeout = parent.timeout
        self._check, self._verify = parent.check, parent.verify
        return self

    def __repr__(self) -> str:
        kind = "MPI" if self.mpi_comm is not None else "in-process"
        return f"Communicator(rank={self.rank}, size={self.size}, {kind})"


def _in_step_after(error: Exception) -> bool:
    """Whether every rank raises ``error`` together, leaving the communicator in step: the
    agreement check's mismatch, AllToAllv's counts, an unreadable tuning file and the oracle's
    verdict are agreed before they are raised."""
    return isinstance(error, agree.AgreedError | verification.VerificationError)


_INTEGERS, _BOOLS = (int, np.integer), (bool, np.bool_)  # tuples: isinstance is quicker


def is_int(value: Any) -> bool:
    """An int or numpy integer, not a bool (as roots, peers and counts are checked)."""
    return type(value) is int or (isinstance(value, _INTEGERS)
                                  and not isinstance(value, _BOOLS))


def _first_seen_order(nodes: list[int]) -> list[int]:
    """Node numbers 0 upward in order of each node's first (lowest) rank."""
    number: dict[int, int] = {}
    return [number.setdefault(node, len(number)) for node in nodes]


def _valid_timeout(value: Any, name: str) -> float | None:
    """Seconds > 0; None, or more than any wait can take (inf, 10**400), for no deadline."""
    if value is None:
        return None
    if (isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real)
            or not value > 0):  # numpy's numbers too (np.int64(5))
        raise ValueError(f"{name}={value!r} is invalid; allowed: seconds > 0, or None")
    return None if value >= threading.TIMEOUT_MAX else float(value)


def _everyone_comes(parent: Any, timeout: float | None) -> None:
    """Wait until every rank of ``parent`` has come to make a communicator: within
    ``timeout`` (PYCOLL_TIMEOUT) where set, as torch's init_process_group waits. A rank that
    never makes one (it failed before its first pycoll call) left the others waiting forever
    in the first blocking MPI call. Every rank posts the barrier, a bad setting's too."""
    request = parent.Ibarrier()
    if timeout is None:
        request.Wait()
        return
    deadline = time.monotonic() + timeout
    pause = 1e-5
    while not request.Test():
        if time.monotonic() > deadline:  # MPI cannot say which ranks have not come
            raise CollectiveTimeout(
                f"making a communicator: rank {parent.Get_rank()} waited {timeout:g} s for "
                f"the other ranks of {parent.Get_size()} (making one is collective: every "
                "rank calls pycoll.world() or Communicator() alike; has a rank failed or "
                "ended before its first pycoll call?)")
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)


def _timeout_from_env() -> float | None:
    text = os.environ.get("PYCOLL_TIMEOUT", "").strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"PYCOLL_TIMEOUT={text!r} is invalid; allowed: seconds > 0")
    return _valid_timeout(seconds, "PYCOLL_TIMEOUT")


def check_environment() -> None:
    """Raise what this rank's PYCOLL_* settings would, later and one at a time, or only on
    the path that reads them: when a communicator is made, and by the command line before
    any (every rank together)."""
    from pycoll.bindings import shm
    from pycoll.kernels import device
    from pycoll.schedule import Collective

    select.check_settings()
    device.kernel_backend()  # PYCOLL_KERNELS
    shm.cma_setting()
    shared_settings()  # reads (and checks) every setting the ranks must agree on
    select.forced_algorithm(Collective.ALLREDUCE)  # parses the whole of PYCOLL_ALGO
    _timeout_from_env()


def shared_settings() -> dict[str, Any]:
    """This rank's PYCOLL_* settings that decide which messages a collective sends, as read
    (so that "shm" and " SHM " agree): every rank of a communicator must have the same. Not
    PYCOLL_TIMEOUT, PYCOLL_DEBUG, PYCOLL_KERNELS, PYCOLL_TUNING (rank 0's costs are shared)
    or PYCOLL_SHM_CMA (negotiated pair by pair), which may differ."""
    from pycoll.bindings import shm, staged
    from pycoll.settings import switch

    return {
        # PYCOLL_FORWARD as api._forwarding reads it (which tests replace)
        "PYCOLL_FORWARD": bool(switch("PYCOLL_FORWARD", True)),
        "PYCOLL_CUDA_AWARE_MPI": staged.forced_cuda_awareness(),
        "PYCOLL_ALGO": _forced_families(),
        "PYCOLL_SEGMENTS": select.FORCED_SEGMENTS or "unset",
        "PYCOLL_HOST_TRANSPORT": _host_transport_mode(),
        "PYCOLL_DEVICE_TRANSPORT": _device_transport_mode(),
        "PYCOLL_RANKS_PER_NODE": _ranks_per_node(0) or "unset",
        "PYCOLL_CHECK": agree.enabled_by_default(),
        "PYCOLL_VERIFY": verification.enabled_by_default(),
        "PYCOLL_SHM_RING_BYTES": shm.ring_bytes_from_env(),
        "PYCOLL_SHM_ONE_SHOT_BYTES": shm.small_bytes_from_env(),
    }


def _forced_families() -> str:
    """What ``PYCOLL_ALGO`` forces, per collective with a choice, in one order:
    "tree,allreduce:ring" and "allreduce:ring, tree" mean the same and must agree."""
    from pycoll.algorithms import families_for
    from pycoll.schedule import Collective

    forced = {c.value: select.forced_algorithm(c) for c in Collective
              if len(families_for(c)) > 1}
    if len(set(forced.values())) == 1:  # one family for all, or none
        return next(iter(forced.values())) or "unset"
    return ",".join(f"{name}:{family}" for name, family in forced.items() if family)


def settings_disagreement(tables: list[dict[str, Any]]) -> str | None:
    """What differs between ranks' ``shared_settings`` (rank r's at ``tables[r]``), in words;
    None when nothing does."""
    parts = differences(tables)
    if not parts:
        return None
    return ("the ranks' settings differ: " + "; ".join(parts)
            + "; allowed: the same on every rank (they decide which messages each sends)")


def differences(tables: list[dict[str, Any]], label: Callable[[str], str] = str) -> list[str]:
    """Per entry whose value differs between ranks (rank r's at ``tables[r]``): its
    ``label`` and each value with the ranks that have it."""
    parts = []
    for name in tables[0]:
        held = agree.ranks_holding([table.get(name) for table in tables], repr)
        if len(held) > 1:
            parts.append(f"{label(name)} " + ", ".join(held))
    return parts


class _Freed:
    """The transport of a freed communicator: every use is an error."""

    delivers = False

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def _error(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"rank {self.rank}: this communicator was freed (Communicator.free)")

    isend = irecv = waitall = sendrecv = _error


DEVICE_TRANSPORTS = ("auto", "ipc", "staged")
HOST_TRANSPORTS = ("auto", "shm", "mpi")


def _transport_mode(name: str, allowed: tuple[str, ...]) -> str:
    mode = os.environ.get(name, "auto").strip().lower() or "auto"
    if mode not in allowed:
        raise ValueError(f"{name}={mode!r} is invalid; allowed: {', '.join(allowed)}")
    return mode


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def _host_transport_mode() -> str:
    return _transport_mode("PYCOLL_HOST_TRANSPORT", HOST_TRANSPORTS)


def _device_transport_mode() -> str:
    return _transport_mode("PYCOLL_DEVICE_TRANSPORT", DEVICE_TRANSPORTS)


def _ranks_per_node(size: int) -> int:
    value = whole_number("PYCOLL_RANKS_PER_NODE", 1)
    return size if value is None else value


def _route(
    rank: int, nodes: list[int], mode: str, peer_memory: Callable[[], Any],
    staged: Callable[[], Any],
) -> Any:
    """Peer memory to the ranks of this node, staged messages to the others.

    ``nodes[r]`` is rank r's node. Making an endpoint may be collective, so what is made
    depends only on what every rank knows alike (``nodes``, ``mode``), not on this rank's
    routes: ``staged`` alone when ``mode`` says so; peer memory alone on one node; across
    nodes, ``staged``, and peer memory too where some node holds several ranks.
    """
    from pycoll.bindings.routed import RoutedTransport

    local = [peer for peer, node in enumerate(nodes) if node == nodes[rank]]
    if mode == "ipc" and len(local) < len(nodes):
        raise ValueError(
            f"PYCOLL_DEVICE_TRANSPORT=ipc but the ranks span {len(set(nodes))} nodes; peer "
            "memory reaches one node only (allowed here: auto or staged)"
        )
    if mode == "staged":
        return staged()
    if len(local) == len(nodes):
        return peer_memory()
    between = staged()
    if len(set(nodes)) == len(nodes):  # a node each: nobody maps a peer
        return between
    within = peer_memory()
    if len(local) == 1:  # made only because duplicating is collective: its communicators
        _free_duplicates(_reachable(within))  # would leak, one pair per making, until MPI
        return between  # has no context ids left on any rank
    return RoutedTransport([within if node == nodes[rank] else between for node in nodes])


def _free_duplicates(endpoints: list[Any]) -> None:
    """Free the MPI communicators among ``endpoints`` (device endpoints' own duplicates)."""
    for host in endpoints:
        if isinstance(host, MPITransport):
            host.free()


def _reachable(*endpoints: Any) -> list[Any]:
    """``endpoints`` and every endpoint behind them, once each: device endpoints wait
    through host ones (routes, renumbered pairs, MPI behind staging, the credits and
    notices of peer memory)."""
    pending, seen, found = list(endpoints), set(), []
    while pending:
        endpoint = pending.pop()
        if endpoint is None or id(endpoint) in seen:
            continue
        seen.add(id(endpoint))
        found.append(endpoint)
        pending += [getattr(endpoint, name, None) for name in ("host", "credits", "notices",
                                                               "inner")]
        pending += list(getattr(endpoint, "routes", ()))
    return found


class Renumbered:
    """A transport of a subgroup, addressed by this group's ranks (``members[i]`` is the
    subgroup's rank i): Send/Recv's two-rank endpoints, spoken to by communicator rank."""

    def __init__(self, inner: Any, members: list[int]):
        self.inner, self.members = inner, members
        self.delivers = inner.delivers
        self.lends_until_next_step = getattr(inner, "lends_until_next_step", False)
        self.rank = members[inner.rank]
        if hasattr(inner, "names"):  # its errors name ranks as the communicator does
            inner.names = members

    def isend(self, buf: Any, peer: int, tag: int) -> Any:
        return self.inner.isend(buf, self.members.index(peer), tag)

    def irecv(self, buf: Any, peer: int, tag: int, combine: Any = None) -> Any:
        return self.inner.irecv(buf, self.members.index(peer), tag, combine)

    def waitall(self, requests: list) -> None:
        try:
            self.inner.waitall(requests)
        except WaitTimeout as late:
            raise WaitTimeout([self.members[p] for p in late.peers], late.seconds) from None

    def sendrecv(self, send: Any, dst: int, recv: Any, src: int, tag: int) -> None:
        self.waitall([self.irecv(recv, src, tag), self.isend(send, dst, tag)])


def _in_process_device_transport(space: Any, host: Any, nodes: list[int]) -> Any:
    """Device endpoints for in-process ranks of ``host``'s group (``nodes[r]``: rank r's)."""
    from pycoll.bindings.staged import StagedTransport

    everyone = list(range(host.size))
    channel = f"{host.channel}/{space.name}"
    make_access = getattr(space, "peer_access_for", None)  # a stand-in device's own rules
    if make_access is not None:
        access = make_access(host.world.shared, host.world_rank)
    else:
        access = host.world.shared.setdefault(("peer access", space.name), SameProcessAccess())
    # Threads share memory, so every peer is mappable; PYCOLL_RANKS_PER_NODE pretends
    # otherwise (comm.nodes()), to run the between-node path and the routing in one process.
    return _route(
        host.rank, nodes, _device_transport_mode(),
        lambda: PeerMemoryTransport(
            space, access, host.subgroup(everyone, channel + "/credits"),
            host.subgroup(everyone, channel + "/notices"),
        ),
        lambda: StagedTransport(space, host.subgroup(everyone, channel + "/staged")),
    )


def _progress_of(mpi_comm: Any) -> Callable[[list[int], bool], None]:
    """A shared-memory wait's hook, now and then: one MPI call that polls, so that MPI's
    own messages move meanwhile (MPICH progresses every request of the process in it)."""
    from pycoll.bindings.mpi import mpi

    any_source, any_tag = mpi().ANY_SOURCE, mpi().ANY_TAG

    def progress(awaited: list[int], moved: bool) -> None:
        mpi_comm.Iprobe(any_source, any_tag)

    return progress


def _mpi_device_transport(mpi_comm: Any, space: Any, nodes: list[int],
                          info_from: Any = None) -> Any:
    """CUDA IPC to the ranks of this node, MPI (CUDA-aware or staged) to the others
    (``nodes[r]``: rank r's node, as ``Communicator.nodes`` gives it: simulated nodes are
    parts of real ones, so IPC reaches within them too). Whether MPI takes device memory is
    read from ``info_from``'s info (default: ``mpi_comm``'s)."""
    from pycoll.bindings.staged import StagedTransport, cuda_aware_mpi

    mode = _device_transport_mode()
    access = getattr(space, "ipc_access", None)
    if access is None:  # no way to map another process's memory
        if mode == "ipc" and mpi_comm.Get_size() > 1:
            raise ValueError(f"PYCOLL_DEVICE_TRANSPORT=ipc but {space.name} memory cannot be "
                             "mapped by another process (allowed here: auto or staged)")
        mode = "staged"
    if mode == "staged":
        nodes = list(range(mpi_comm.Get_size()))
    return _route(
        mpi_comm.Get_rank(), nodes, mode,
        lambda: PeerMemoryTransport(
            space, access(), MPITransport(mpi_comm.Dup()), MPITransport(mpi_comm.Dup()),
        ),
        lambda: StagedTransport(space, MPITransport(mpi_comm.Dup()), cuda_aware_mpi(
            mpi_comm if info_from is None else info_from)),
    )


def new_group(ranks: Sequence[int], comm: Communicator | None = None) -> Communicator | None:
    """A communicator of ``ranks`` (in that order) of ``comm``; None on the other ranks.

    Every rank of ``comm`` must call it, as with ``torch.distributed.new_group``.
    """
    comm = world() if comm is None else comm
    if not isinstance(comm, Communicator):
        raise TypeError(f"new_group: comm={comm!r} is not a pycoll.Communicator; allowed: one, "
                        "or None")
    try:
        members = list(ranks)
    except TypeError:  # 5, None: not a sequence
        members = [None]
    valid = all(is_int(r) for r in members)
    members = [int(r) for r in members] if valid else members  # numpy ints too
    if not members or not valid or len(set(members)) != len(members) or not all(
        0 <= r < comm.size for r in members
    ):
        raise ValueError(
            f"new_group: ranks={ranks!r} is invalid; allowed: distinct ints in 0..{comm.size - 1}"
        )
    from pycoll.api import allgather

    # every rank must pass the same list (split alone would join differing lists into one)
    mine = np.array([zlib.crc32(repr(members).encode())], np.int64)
    table = allgather(mine, comm=comm, algorithm="direct")
    others = [r for r in range(comm.size) if table[r] != mine[0]]
    if others:
        raise ValueError(f"new_group: ranks={members} here, but rank(s) {others} passed other "
                         "ranks; every rank of the communicator must pass the same ranks")
    inside = comm.rank in members
    return comm.split(0 if inside else None, members.index(comm.rank) if inside else 0)


def _local(world: LocalWorld, rank: int) -> Communicator:
    return Communicator._over(
        LocalTransport(world, rank, "collective"), LocalTransport(world, rank, "p2p")
    )


class _ThreadDefault(threading.local):
    comm: Communicator | None = None  # a class default: a missing thread-local is slow to read


_default = _ThreadDefault()
_process_world: Communicator | None = None
_process_world_lock = threading.Lock()
# per run_local under way: the threads there before it began (Thread objects: a thread
# started later may reuse the ident of one that has ended)
_local_runs: list[set[threading.Thread]] = []
_local_runs_lock = threading.Lock()


def world() -> Communicator:
    """The calling rank's default communicator.

    Inside :func:`run_local`, the thread's own; in a process launched by ``mpiexec``,
    ``MPI.COMM_WORLD``; otherwise a world of one rank.
    """
    comm = _default.comm
    if comm is not None:
        return comm
    if any(threading.current_thread() not in before for before in _local_runs) and (
            not launched_by_mpi()):
        # a thread started while ranks run (by a rank, most likely): a world of one rank here
        # would silently reduce nothing
        raise RuntimeError(
            f"pycoll.world() from thread {threading.current_thread().name!r}, which is not a "
            "rank of the running pycoll.run_local (its ranks are threads, and a rank's own "
            "threads have no default communicator); allowed: pass comm= the rank's "
            "pycoll.world(), taken on the rank's thread")
    global _process_world
    if _process_world is not None:
        return _process_world
    with _process_world_lock:  # two threads' first calls would each make one, collectively
        if _process_world is None:
            if launched_by_mpi():
                _process_world = Communicator()
            else:
                _process_world = _local(LocalWorld(1), 0)
    return _process_world


_abort_installed = False


def _require_mpi_running() -> None:
    """Raise, naming the fix, where MPI is not running: mpi4py started with
    ``rc.initialize = False`` and no ``MPI.Init`` yet, or after ``MPI.Finalize()`` (every MPI
    call there kills the process without a Python error)."""
    MPI = mpi()
    if MPI.Is_finalized():
        raise RuntimeError("MPI is finalized (MPI.Finalize() was called): pycoll cannot make a "
                           "communicator over MPI after it")
    if not MPI.Is_initialized():
        raise RuntimeError("MPI is not initialized (mpi4py.rc.initialize = False): call "
                           "MPI.Init_thread(MPI.THREAD_MULTIPLE) (or MPI.Init(), without async "
                           "calls) before pycoll's first call")


def needs_threads() -> str:
    """What a call that needs MPI_THREAD_MULTIPLE says: how to get it, and what this has."""
    return ("MPI_THREAD_MULTIPLE (mpi4py.rc.thread_level = 'multiple', mpi4py's default, or "
            "MPI.Init_thread(MPI.THREAD_MULTIPLE)); this process has "
            f"MPI_THREAD_{mpi_thread_level().upper()}")


def mpi_thread_level() -> str:
    """MPI's thread support in this process, as mpi4py.rc.thread_level names it."""
    MPI = mpi()
    level = MPI.Query_thread()
    return {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
            MPI.THREAD_SERIALIZED: "serialized"}.get(level, "multiple")


def abort_job(code: int) -> None:
    """End every rank of the MPI job with ``code``, after a pause that gives the launcher
    time to forward what this rank wrote (the job's teardown may drop the rest)."""
    sys.stderr.flush()
    time.sleep(0.5)
    mpi().COMM_WORLD.Abort(code)


def _abort_job_on_uncaught_exception() -> None:
    """A rank that dies of an exception takes the job down instead of leaving peers waiting
    (installed once per process, by the first MPI communicator, whichever way it is made)."""
    global _abort_installed
    MPI = mpi()
    everyone = MPI.COMM_WORLD
    if _abort_installed or everyone.Get_size() == 1:
        return
    _abort_installed = True
    previous, previous_in_thread = sys.excepthook, threading.excepthook
    rank_process = os.getpid()  # a child it forks (a DataLoader's worker) inherits the hooks

    def abort(kind, error, traceback, report=None):
        if os.getpid() != rank_process or MPI.Is_finalized():
            # no rank, and no peer waits for it; or MPI is over, and no job to end: Python's
            return previous(kind, error, traceback) if report is None else (
                previous_in_thread(report))
        # The one-line reason first: when the job is torn down, the launcher may drop the
        # rest of a rank's output; the pause gives it time to forward what was written.
        print(f"pycoll: rank {everyone.Get_rank()} raised {kind.__name__}: {error}; aborting "
              "the job", file=sys.stderr, flush=True)
        if report is None:
            previous(kind, error, traceback)
        else:
            previous_in_thread(report)
        abort_job(1)

    def abort_from_thread(report: Any) -> None:
        # a program's own thread: peers wait for its collectives as for the main thread's
        if report.exc_type is SystemExit:
            return previous_in_thread(report)
        abort(report.exc_type, report.exc_value, report.exc_traceback, report)

    sys.excepthook = abort
    threading.excepthook = abort_from_thread


def run_local(nranks: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``nranks`` threads, each with its own communicator.

    Returns the per-rank results in rank order. If any rank raises, the others are released
    and that exception is raised here; a deadlock raises :class:`Deadlock` instead of hanging.
    """
    if not is_int(nranks) or nranks < 1:
        raise ValueError(f"nranks={nranks!r} is not a rank count; allowed: an int >= 1")
    nranks = int(nranks)

    def body(rank: int, local_world: LocalWorld) -> Any:
        _default.comm = _local(local_world, rank)
        try:
            return fn(*args, **kwargs)
        finally:
            _default.comm = None

    before = set(threading.enumerate())  # not started by a rank
    with _local_runs_lock:
        _local_runs.append(before)
    try:
        return run_threads(nranks, body, before)
    finally:
        with _local_runs_lock:
            _local_runs.remove(before)
