"""Run under mpiexec (2 or more ranks): what a program's threads and async work do to a
communicator's collective setup, and an async receive that fails beside others.

1. Two threads' first pycoll calls make one world, once (each made one, and the two sets of
   collective MPI calls interleaved differently on each rank: "Message truncated").
2. `split` waits for the async collectives queued before it (the worker's first collective
   set up shared memory collectively while the main thread split).
3. An async receive whose message is too long fails its own `wait()` only: `done()` says it
   is done, and the receives posted after it are unaffected (they raised, and were dropped
   unheld while MPI went on writing into them).
"""

from __future__ import annotations

import threading
import time

import numpy as np
from mpi4py import MPI

import pycoll

RANK, P = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
right, left = (RANK + 1) % P, (RANK - 1) % P
ok, checks = 0, 0

# 1. No pycoll call before these two threads'.
got = np.zeros(4, np.int64)
threads = [threading.Thread(target=pycoll.send, args=(np.arange(4) + 10 * RANK, right, 1)),
           threading.Thread(target=pycoll.recv, args=(got, left, 1))]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
ok, checks = ok + int(np.array_equal(got, np.arange(4) + 10 * left)), checks + 1

# 2. A fresh communicator, whose first collective is the async one.
fresh = pycoll.Communicator(MPI.COMM_WORLD)
work = pycoll.allreduce(np.arange(8, dtype=np.int64) + RANK, comm=fresh, async_op=True)
if RANK == 1:
    time.sleep(0.5)
half = fresh.split(color=RANK % 2, key=-RANK)
total = work.wait()
members = pycoll.allgather(np.array([RANK]), comm=half)
ok += int(np.array_equal(total, P * np.arange(8) + P * (P - 1) // 2))
ok += int(members.tolist() == sorted(range(RANK % 2, P, 2), reverse=True))
checks += 2

# 3. Rank 0 sends 8 elements where rank 1 receives into 2, then 70 small messages.
if RANK == 0:
    pycoll.send(np.arange(8), 1, tag=5)
    for i in range(70):
        pycoll.send(np.array([i]), 1, tag=6)
elif RANK == 1:
    short = pycoll.recv(np.zeros(2, np.int64), 0, tag=5, async_op=True)
    deadline = time.monotonic() + 30
    while not short.done():  # raised MPI's own "Message truncated"
        assert time.monotonic() < deadline, "the truncated receive never completed"
        time.sleep(0.01)
    buffers = [np.full(1, -1, np.int64) for _ in range(70)]
    works = [pycoll.recv(b, 0, tag=6, async_op=True) for b in buffers]
    for w in works:
        w.wait()
    ok += int([int(b[0]) for b in buffers] == list(range(70)))
    try:
        short.wait()
    except ValueError as error:
        ok += int("disagree on counts" in str(error))
    checks += 2

right_everywhere = pycoll.allreduce(np.array([ok, checks]))
if RANK == 0:
    print(f"threads on {P} ranks: {right_everywhere[0]} of {right_everywhere[1]} right",
          flush=True)
