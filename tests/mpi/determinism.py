"""Determinism between processes (docs/reliability.md): every AllReduce family gives every
process the same bits, and direct, two_shot and the shared-memory one-shot (auto at the
small size) give the rank-order sum x0 + x1 + ... exactly. Prints one summary line."""

from __future__ import annotations

import zlib

import numpy as np

import pycoll
from pycoll.algorithms import families_for
from pycoll.schedule import Collective

RANK_ORDER = {"direct", "two_shot"}

comm = pycoll.world()
checked = failed = 0
for size in (1001, 700_001):  # the longer one goes in pieces (and cross-memory reads) over shm
    rng = np.random.default_rng(size + comm.size)
    xs = [(rng.standard_normal(size) * 10.0 ** rng.integers(-3, 4, size)).astype(np.float32)
          for _ in range(comm.size)]
    rank_order = xs[0].copy()
    for x in xs[1:]:
        rank_order += x
    for algorithm in [*families_for(Collective.ALLREDUCE), "auto"]:
        result = pycoll.allreduce(xs[comm.rank], algorithm=algorithm)
        digests = pycoll.allgather(np.array([zlib.crc32(result.tobytes())], np.int64))
        same = len(set(digests.tolist())) == 1
        if algorithm in RANK_ORDER or (algorithm == "auto" and comm.one_shot() is not None
                                       and size == 1001):
            same = same and result.tobytes() == rank_order.tobytes()
        checked += 1
        failed += not same
        if not same and comm.rank == 0:
            print(f"size {size} {algorithm}: bits differ", flush=True)
if comm.rank == 0:
    print(f"determinism on {comm.size} ranks: {checked} checked, {failed} failed", flush=True)
