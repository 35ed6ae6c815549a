"""Run under mpiexec: async collectives on two communicators overlap; both results right;
async Send/Recv post like MPI's Irecv/Isend (no send waits behind a receive, nor a receive
behind one of another tag)."""

from __future__ import annotations

import gc

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
total = int(pycoll.allreduce(np.array([ok]))[0])
if RANK == 0:
    print(f"async on {P} ranks: {total} of {6 * P} right", flush=True)
