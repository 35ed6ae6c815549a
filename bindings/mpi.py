"""The MPI transport: two-sided messages over mpi4py's buffer methods.

Data always travels as raw bytes (never pickled): pycoll reduces on its own, so MPI needs no
datatype for float16, bfloat16 or complex, and one code path serves them all. mpi4py is
imported lazily (here, and where the shared-memory window and ``--against mpi`` need it), so
that a program that never runs under MPI never loads it.
"""

from __future__ import annotations

import os
import stat
import time
from typing import Any

import numpy as np

from pycoll.bindings.transport import PeerFailed, WaitTimeout, counts_disagree
from pycoll.settings import switch

# Launchers set these in every rank's environment; a plain `python` sets none of them.
_LAUNCHER_VARIABLES = (
    "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALRANKID",
)


def launched_by_mpi() -> bool:
    """Whether this process is a rank of an MPI job (``PYCOLL_MPI=0|1`` overrides)."""
    forced = switch("PYCOLL_MPI", None)
    if forced is not None:
        return forced
    return any(name in os.environ for name in _LAUNCHER_VARIABLES) and not _launcher_gone()


def _launcher_gone() -> bool:
    """Whether this process inherited a launcher's variables but not its connection: MPICH's
    launcher hands each rank a socket, named by PMI_FD, which a child the rank starts does not
    get (subprocess closes it); MPI_Init would fail there on a bad file descriptor, and such
    a child is no rank (a program's helper), so it runs as a world of one."""
    fd = os.environ.get("PMI_FD", "")
    if not fd.isdigit():
        return False
    try:  # closed, or its number reused by a file the child opened: the socket is gone
        return not stat.S_ISSOCK(os.fstat(int(fd)).st_mode)
    except OSError:
        return True


def launch_size() -> int | None:
    """The rank count the launcher's variables give, read without starting MPI; None where
    they give none (or this is no MPI launch)."""
    if not launched_by_mpi():
        return None
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"):  # srun: PMIx
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def mpi():
    """The mpi4py ``MPI`` module, imported on first use."""
    from mpi4py import MPI

    return MPI


class MPITransport:
    """One rank's endpoint on an mpi4py communicator (a private duplicate of the caller's).

    A message longer or shorter than its receive buffer is a ValueError naming both sizes:
    every receive of a collective or Send/Recv expects exactly what its peer sends, and ranks
    that disagree on counts would otherwise get MPI's truncation error on one side and data
    silently short on the other."""

    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._MPI = mpi()
        self._byte = self._MPI.BYTE
        self._status = self._MPI.Status()  # the small-message Sendrecv's
        self.timeout: float | None = None  # seconds each wait may take (None: no deadline)
        self._peer_of: dict[int, int] = {}  # id(request) -> peer, while a deadline applies
        # id(request) -> (request, bytes, peer, tag): the request is held so that its id is not
        # reused while its entry stays (one abandoned by an error)
        self._expected: dict[int, tuple[Any, int, int, int]] = {}

    def isend(self, buf: np.ndarray, peer: int, tag: int):
        request = self.comm.Isend([buf, buf.nbytes, self._byte], peer, tag)
        if self.timeout is not None:
            self._peer_of[id(request)] = peer
        return request

    def irecv(self, buf: np.ndarray, peer: int, tag: int):
        request = self.comm.Irecv([buf, buf.nbytes, self._byte], peer, tag)
        if self.timeout is not None:
            self._peer_of[id(request)] = peer
        self._expected[id(request)] = (request, buf.nbytes, peer, tag)
        return request

    def waitall(self, requests: list) -> None:
        if len(requests) == 1 and self.timeout is None:
            request = requests[0]
            if id(request) not in self._expected:  # a send: no count to check, nothing
                request.Wait()  # truncated (Send's wait, and half of each posted pair)
                return
        statuses = [self._MPI.Status() for _ in requests]
        try:
            if self.timeout is not None:
                self._wait_until(requests, time.monotonic() + self.timeout, statuses)
            elif len(requests) == 1:
                requests[0].Wait(statuses[0])
            elif requests:
                self._MPI.Request.Waitall(requests, statuses)
        except self._MPI.Exception as error:  # a message longer than its buffer: say whose
            peers, why = self._failed_transfer(error, requests, statuses)
            # else a peer gone (its memory unreadable, its connection closed): MPI's own
            # exception said only "see the MPI_ERROR field", naming no rank
            raise PeerFailed(
                f"rank {self.rank}: MPI failed a transfer with rank(s) "
                f"{', '.join(map(str, peers)) or '?'} ({why}): "
                "has that rank ended or failed?") from error
        except WaitTimeout:
            for request in requests:
                self._expected.pop(id(request), None)
            raise
        expected, short = self._expected, None
        for request, status in zip(requests, statuses):
            entry = expected.pop(id(request), None)  # every one: the communicator lives on
            if entry is not None and short is None and status.Get_count(self._byte) != entry[1]:
                short = (*entry[1:], status.Get_count(self._byte))
        if short is not None:
            raise counts_disagree(self.rank, *short)

    def forget(self, request: Any) -> None:
        """Drop what a wait of ``request`` would need: nobody will wait for it."""
        self._expected.pop(id(request), None)
        self._peer_of.pop(id(request), None)

    def test(self, request: Any) -> bool:
        """Whether ``request`` completed; never blocks, and leaves it to waitall (its
        status, whose count waitall checks, and its error: a truncated receive is done)."""
        try:
            return request.Get_status()
        except self._MPI.Exception:
            return True

    def _wait_until(self, requests: list, deadline: float, statuses: list) -> None:
        """Test until done; past ``deadline``, cancel nothing (MPI cannot take a send back)
        and raise WaitTimeout naming the peers of the requests still open."""
        polls = 0
        while not self._MPI.Request.Testall(requests, statuses):
            polls += 1
            if polls > 100:
                if time.monotonic() > deadline:
                    peers = sorted({self._peer_of.get(id(r), -1) for r in requests
                                    if not r.Test()})
                    for r in requests:  # only this wait's: other threads wait on theirs
                        self._peer_of.pop(id(r), None)
                    raise WaitTimeout(peers, self.timeout)
                time.sleep(20e-6)
        for r in requests:
            self._peer_of.pop(id(r), None)

    def _failed_transfer(self, error: Any, requests: list, statuses: list
                         ) -> tuple[list[int], str]:
        """Raise ValueError naming the receive that MPI truncated, if it did; else return
        the peers of the requests that failed (as far as known) and MPI's words for why."""
        MPI = self._MPI
        in_status = error.Get_error_class() == MPI.ERR_IN_STATUS  # Waitall, Testall
        truncated, peers, why = None, [], error.Get_error_string().strip()
        for request, status in zip(requests, statuses):
            code = status.Get_error() if in_status else error.Get_error_code()
            entry = self._expected.pop(id(request), None)  # every one, as waitall does
            peer = self._peer_of.pop(id(request), None) if entry is None else entry[2]
            if code != MPI.SUCCESS and in_status and not peers:
                why = MPI.Get_error_string(code).strip()  # not "see the MPI_ERROR field"
            if code != MPI.SUCCESS and peer is not None and peer not in peers:
                peers.append(peer)
            if entry is not None and truncated is None and (
                    MPI.Get_error_class(code) == MPI.ERR_TRUNCATE):
                truncated = entry
        if truncated is not None:
            raise counts_disagree(self.rank, *truncated[1:], None) from None
        return sorted(peers), why

    def sendrecv(self, send: np.ndarray, dst: int, recv: np.ndarray, src: int, tag: int) -> None:
        if self.timeout is not None:
            self.waitall([self.irecv(recv, src, tag), self.isend(send, dst, tag)])
            return
        # One call instead of two posts and a wait: the small-message path.
        byte, status = self._byte, self._status
        try:
            self.comm.Sendrecv((send, send.nbytes, byte), dst, tag, (recv, recv.nbytes, byte),
                               src, tag, status)
        except self._MPI.Exception as error:
            if error.Get_error_class() != self._MPI.ERR_TRUNCATE:
                raise
            got = None
        else:
            got = status.Get_count(byte)
            if got == recv.nbytes:
                return
        raise counts_disagree(self.rank, recv.nbytes, src, tag, got)

    def free(self) -> None:
        self.comm.Free()


def node_of_each_rank(mpi_comm: Any) -> list[int]:
    """Each rank's node number, 0 upward in order of the nodes' lowest ranks (ranks of one
    node share memory, so CUDA IPC can reach them)."""
    node = mpi_comm.Split_type(mpi().COMM_TYPE_SHARED)
    leader = mpi_comm.allgather(mpi_comm.Get_rank() if node.Get_rank() == 0 else -1)
    node_leader = node.bcast(mpi_comm.Get_rank() if node.Get_rank() == 0 else None, root=0)
    node.Free()
    leaders = sorted(r for r in leader if r >= 0)
    nodes = mpi_comm.allgather(leaders.index(node_leader))
    return nodes
