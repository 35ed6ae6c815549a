"""Run under mpiexec with PYCOLL_RANKS_PER_NODE=k: the hierarchical AllReduce's counted
bytes per link class on every process equal the model's (pycoll.model.traffic), and the
inter-node bytes equal 2(N-1)/N n/k. Rank 0 prints one summary line."""

from __future__ import annotations

import numpy as np

import pycoll
from pycoll import algorithms, model
from pycoll.schedule import Collective

comm = pycoll.world()
per_node, nodes = comm.ranks_per_node, comm.size // comm.ranks_per_node
count = 3000 * comm.size
x = np.ones(count, np.float64)
comm.traffic.reset()
total = pycoll.allreduce(x, algorithm="hierarchical")
counted = dict(comm.traffic.bytes)
schedule = algorithms.build("hierarchical", Collective.ALLREDUCE, comm.size,
                            ranks_per_node=per_node)
predicted = model.traffic(schedule, count, per_node, itemsize=8)[comm.rank]
closed_form = 2 * (nodes - 1) / nodes * x.nbytes / per_node
right = (counted == predicted and counted["inter"] == closed_form
         and np.array_equal(total, np.full(count, comm.size, np.float64)))
agreed = int(pycoll.allreduce(np.array([int(right)]))[0])
if comm.rank == 0:
    print(f"traffic on {comm.size} ranks in {nodes} nodes: {agreed} of {comm.size} equal the "
          f"model (rank 0: {counted})", flush=True)
