"""pycoll: collective communication whose algorithms are readable, checked data."""

from pycoll import _source_tree  # noqa: F401 - first: maps kernels/ and bindings/
from pycoll.agree import CollectiveMismatch
from pycoll.api import (
    allgather,
    allreduce,
    alltoall,
    alltoallv,
    barrier,
    broadcast,
    empty,
    plan,
    recv,
    reduce,
    reduce_scatter,
    send,
)
from pycoll.bindings.local import Deadlock
from pycoll.bindings.transport import ChannelsCrossed, CollectiveTimeout, PeerFailed
from pycoll.comm import Communicator, new_group, run_local, world
from pycoll.kernels import ReduceOp
from pycoll.verify import VerificationError

__version__ = "0.1.0"

__all__ = [
    "ChannelsCrossed",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "Communicator",
    "Deadlock",
    "PeerFailed",
    "ReduceOp",
    "VerificationError",
    "allgather",
    "allreduce",
    "alltoall",
    "alltoallv",
    "barrier",
    "broadcast",
    "empty",
    "new_group",
    "plan",
    "recv",
    "reduce",
    "reduce_scatter",
    "run_local",
    "send",
    "world",
]
