"""Tensor parallelism: a weight matrix split across ranks; **AllReduce** of partial sums, or
**ReduceScatter** when the output stays partitioned.

The layer is a two-matrix MLP, Y = relu(X A) B, as Megatron-LM splits it. Every rank holds
the whole input X (batch x K). A is split by columns: rank r owns A[:, h_r] and computes its
hidden columns H_r = relu(X A[:, h_r]) with no communication (relu acts column by column).
B is split by rows with the same h_r: rank r owns B[h_r, :], and H_r B[h_r, :] is a *partial
sum*: Y = sum over r of H_r B[h_r, :], every rank holding a full-sized (batch x N) addend.

* The next layer needs all of Y on every rank: the partials must be added and the sum given to
  everyone: AllReduce (not AllGather: the pieces are addends, not disjoint parts of Y).
* The output stays partitioned (sequence parallelism: rank r keeps only its rows of Y, and the
  next row-wise operation, e.g. a norm, works on those): ReduceScatter adds the partials and
  gives rank r only its rows, with 1/p of AllReduce's result traffic. An AllGather of those
  rows afterwards gives back exactly the AllReduce result (AllReduce = ReduceScatter +
  AllGather, the seed's second factorization).

Inputs are integer-valued, so every result is exact and compared with ==. Sizes are chosen so
that neither the batch nor the hidden width divides by most rank counts (uneven shares).

    python examples/tensor_parallel.py --ranks 4
    mpiexec -n 4 python examples/tensor_parallel.py
"""

from __future__ import annotations

import sys

import numpy as np
from launch import Report, main, offsets, parser, shares

import pycoll

BATCH, IN, HIDDEN, OUT = 7, 5, 10, 4


def weights() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """X, A, B: integer-valued, the same on every rank (a real model would load only its
    shard of A and B)."""
    rng = np.random.default_rng(0)
    return tuple(rng.integers(-3, 4, shape).astype(np.float64)
                 for shape in ((BATCH, IN), (IN, HIDDEN), (HIDDEN, OUT)))


def on_rank(args) -> Report:
    comm = pycoll.world()
    report = Report()
    x, a, b = weights()
    expected = np.maximum(x @ a, 0) @ b  # the single-process layer
    h_start, h_stop = offsets(shares(HIDDEN, comm.size))[comm.rank : comm.rank + 2]
    a_mine, b_mine = a[:, h_start:h_stop], b[h_start:h_stop, :]  # column and row shards
    partial = np.maximum(x @ a_mine, 0) @ b_mine  # this rank's addend of Y

    y = pycoll.allreduce(partial, "sum")
    report.check("allreduce: Y on every rank", np.array_equal(y, expected))

    rows = shares(BATCH, comm.size)
    r_start, r_stop = offsets(rows)[comm.rank : comm.rank + 2]
    y_rows = pycoll.reduce_scatter(partial, "sum", counts=rows)
    report.check("reduce_scatter: this rank's rows of Y",
                 np.array_equal(y_rows, expected[r_start:r_stop]))
    report.check("allgather after reduce_scatter = allreduce",
                 np.array_equal(pycoll.allgather(y_rows, counts=rows), y))
    report.say(f"Y = relu(X A) B, X {x.shape}, A {a.shape} split by columns "
               f"{shares(HIDDEN, comm.size)}, B {b.shape} split by rows alike")
    report.say(f"AllReduce: every rank gets Y {y.shape}; ReduceScatter: rank r gets rows "
               f"{rows} of it ({y_rows.nbytes} B on rank {comm.rank} instead of {y.nbytes} B)")
    return report


if __name__ == "__main__":
    sys.exit(0 if main("tensor_parallel", on_rank, parser(__doc__)) else 1)
