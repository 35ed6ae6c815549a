"""Run under mpiexec: async collectives on two communicators overlap; both results right;
async Send/Recv post like MPI's Irecv/Isend (no send waits behind a receive, nor a receive
behind one of another tag)."""

from __future__ import annotations

import gc
import time

import numpy as np

import pycoll

comm = pycoll.world()
other = comm.split(0)
P, RANK = comm.size, comm.rank
big = np.arange(300_000, dtype=np.int64) + RANK
small = np.full(7, RANK, np.int32)
first = pycoll.allreduce(big, algorithm="ring", async_op=True)
second = pycoll.allreduce(small, "max", comm=other, async_op=True)
third = pycoll.allgather(small, comm=other, async_op=True)
ok = int(np.array_equal(second.wait(), np.full(7, P - 1)))
ok += int(np.array_equal(first.wait(), P * np.arange(300_000) + P * (P - 1) // 2))
ok += int(np.array_equal(third.wait(), np.repeat(np.arange(P, dtype=np.int32), 7)))
# Send/Recv as MPI's Irecv/Isend: a posted receive holds back no send, and a blocking
# receive does not wait for this rank's own queued send (torch.distributed's ring pattern).
right, left = (RANK + 1) % P, (RANK - 1) % P
got, got_big = np.empty(4), np.empty(1 << 20)
receiving = pycoll.recv(got, left, tag=7, async_op=True)
sending = pycoll.send(np.full(4, float(RANK)), right, tag=7, async_op=True)
sending.wait()
receiving.wait()
sending = pycoll.send(np.full(1 << 20, float(RANK)), right, tag=8, async_op=True)
pycoll.recv(got_big, left, tag=8)
sending.wait()
ok += int(got[0] == left and got_big[-1] == left)
# Tags as MPI matches them: receives posted for tags 2 then 1 take the sends of tags 1 then 2
# (messages large enough to wait for their receive), async or a blocking send after an async one.
first_tag, second_tag = np.empty(1 << 20), np.empty(1 << 20)
second = pycoll.recv(second_tag, left, tag=2, async_op=True)
first = pycoll.recv(first_tag, left, tag=1, async_op=True)
sending = pycoll.send(np.full(1 << 20, 1.0 + RANK), right, tag=1, async_op=True)
pycoll.send(np.full(1 << 20, 2.0 + RANK), right, tag=2)
sending.wait()
second.wait()
first.wait()
ok += int(first_tag[-1] == 1.0 + left and second_tag[-1] == 2.0 + left)
# A send whose Work is dropped unwaited, its array with it (torch.distributed's isend keeps
# the tensor): the message still carries what was sent, not memory numpy handed on.
for tag in (3, 4):
    pycoll.send(np.full(12_000, tag + RANK, np.float64), right, tag=tag, async_op=True)
gc.collect()
reuse = [np.full(12_000, -1.0) for _ in range(8)]
pycoll.barrier()
arrived = [np.empty(12_000) for _ in (3, 4)]
for tag, into in zip((3, 4), arrived):
    pycoll.recv(into, left, tag=tag)
ok += int(all((into == tag + left).all() for tag, into in zip((3, 4), arrived)))
# A receive posted before a collective, waited after it, as MPI programs do: the sender's
# blocking send of a large message completes meanwhile (MPICH moves it only while this rank
# calls MPI; a wait in shared memory must let it, as MPI's own barrier does).
arriving = np.empty(1 << 20)
receiving = pycoll.recv(arriving, left, tag=9, async_op=True)
pycoll.send(np.full(1 << 20, 9.0 + RANK), right, tag=9)
pycoll.barrier()
receiving.wait()
ok += int(arriving[-1] == 9.0 + left)
# Receives dropped unwaited, after their messages arrived: the transport keeps nothing for
# a wait that will never come (each held its 64 KiB until the communicator was freed).
for tag in range(20, 40):
    pycoll.recv(np.empty(8192), left, tag=tag, async_op=True)
for tag in range(20, 40):
    pycoll.send(np.full(8192, float(tag)), right, tag=tag)
pycoll.barrier()
held = getattr(comm.p2p, "_expected", {})
ok += int(len(held) == 0)
# The first collective of a new communicator, on the async worker, while the program calls
# collectives on its own MPI communicator in a different order on one rank: pycoll's setup
# (the shared-memory split) keeps to pycoll's duplicates, so neither sees the other's data.
from mpi4py import MPI  # noqa: E402

fresh = pycoll.Communicator(MPI.COMM_WORLD)
pending = pycoll.allreduce(np.ones(5, np.int64), comm=fresh, async_op=True)
if RANK == 1:
    time.sleep(0.3)  # the worker's split first here, the program's call first elsewhere
theirs = MPI.COMM_WORLD.allgather((RANK, "own"))
parts = MPI.COMM_WORLD.Split(0, P - RANK)
ok += int(theirs == [(r, "own") for r in range(P)] and parts.Get_rank() == P - 1 - RANK
          and np.array_equal(pending.wait(), np.full(5, P)))
parts.Free()
fresh.free()
total = int(pycoll.allreduce(np.array([ok]))[0])
if RANK == 0:
    print(f"async on {P} ranks: {total} of {9 * P} right", flush=True)
