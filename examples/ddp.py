"""Data parallelism (DDP): **Broadcast** the initial parameters, **AllReduce** the gradients.

Before training every rank builds the model itself, each from its own random state; after a
Broadcast from rank 0 every replica holds rank 0's parameters. Broadcast, not AllReduce or
AllGather: one rank's values are copied everywhere, and nothing is combined. It synchronizes
the start only.

Each step every rank computes gradients on its own local batch; the replicas stay identical
only if they apply the same update, so the gradients are summed over ranks and every rank
receives the whole sum: AllReduce. (Reduce would leave the sum at one rank; ReduceScatter
would give each rank a piece, which is FSDP's choice when each rank updates only its shard.)
As DDP does, the gradients are flattened into one vector and cut into buckets, last layer
first (the order backward produces them), and each bucket is AllReduced as soon as it is
ready (here: ``async_op=True``, all waited for before the update).

The weighting rule: the goal is the mean loss over the global batch. With equal local batch
sizes each rank's mean-loss gradient can be averaged over ranks (op "avg": the sum divided by
the rank count). With unequal sizes that average would weight a small batch's examples more
than a large one's; instead each rank contributes the gradient of its *summed* loss, the ranks
sum them, and every rank divides by the global example count.

After several steps the parameters equal single-process training on the concatenated batch
(to floating-point tolerance: the sum is associated differently), and they are the same bits
on every rank.

    python examples/ddp.py --ranks 4
    mpiexec -n 4 python examples/ddp.py
"""

from __future__ import annotations

import sys
import zlib

import mlp
import numpy as np
from launch import Report, main, offsets, parser

import pycoll

WIDTHS = [6, 16, 16, 3]
STEPS = 5
LEARNING_RATE = 0.1
BUCKET_BYTES = 512  # small, so that this small model has several buckets


def batch_sizes(nranks: int, equal: bool) -> list[int]:
    """Local batch sizes: 6 each, or 2, 5, 8, ... (rank r: 2 + 3r)."""
    return [6 if equal else 2 + 3 * r for r in range(nranks)]


def step_data(step: int, sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of ``step`` (every rank can make it; each uses its own rows)."""
    return mlp.dataset(sum(sizes), WIDTHS, seed=100 + step)


def buckets(flat: np.ndarray) -> list[np.ndarray]:
    """Views of ``flat`` of at most BUCKET_BYTES each, last parameters first."""
    per_bucket = max(1, BUCKET_BYTES // flat.itemsize)
    ends = list(range(flat.size, 0, -per_bucket))
    return [flat[max(0, end - per_bucket) : end] for end in ends]


def train(sizes: list[int], rule: str) -> np.ndarray:
    """This rank's DDP training; returns its flat parameters. ``rule``: "avg" (average the
    local-mean gradients) or "sum" (sum the summed-loss gradients, divide by the count)."""
    comm = pycoll.world()
    layers = mlp.init(WIDTHS, seed=comm.rank)  # every replica starts differently...
    flat = mlp.flatten(layers)
    pycoll.broadcast(flat, root=0)  # ...until rank 0's parameters are copied to all
    layers = mlp.unflatten(flat, layers)  # views: updating ``flat`` updates the layers
    start, stop = offsets(sizes)[comm.rank : comm.rank + 2]
    for step in range(STEPS):
        x, y = step_data(step, sizes)
        _, grads = mlp.gradients(layers, x[start:stop], y[start:stop])
        grad = mlp.flatten(grads)
        if rule == "avg":
            grad /= max(stop - start, 1)  # the local mean
        work = [pycoll.allreduce(bucket, rule, out=bucket, async_op=True)
                for bucket in buckets(grad)]
        for handle in work:
            handle.wait()
        if rule == "sum":
            grad /= sum(sizes)  # the global mean
        flat -= LEARNING_RATE * grad
    return flat


def single_process(sizes: list[int]) -> np.ndarray:
    """The same training in one process, on the concatenated batch."""
    layers = mlp.init(WIDTHS, seed=0)
    flat = mlp.flatten(layers)
    layers = mlp.unflatten(flat, layers)
    for step in range(STEPS):
        x, y = step_data(step, sizes)
        _, grads = mlp.gradients(layers, x, y)
        flat -= LEARNING_RATE * mlp.flatten(grads) / sum(sizes)
    return flat


def same_on_every_rank(values: np.ndarray) -> bool:
    digests = pycoll.allgather(np.array([zlib.crc32(values.tobytes())], np.int64))
    return len(set(digests.tolist())) == 1


def on_rank(args) -> Report:
    comm = pycoll.world()
    report = Report()
    initial = mlp.flatten(mlp.init(WIDTHS, seed=comm.rank))
    pycoll.broadcast(initial, root=0)
    report.check("broadcast: rank 0's initial parameters",
                 np.array_equal(initial, mlp.flatten(mlp.init(WIDTHS, seed=0))))
    report.say(f"model {WIDTHS}: {initial.size} parameters in {len(buckets(initial))} buckets "
               f"of <= {BUCKET_BYTES} B; {STEPS} SGD steps, lr {LEARNING_RATE}")
    for equal, rule in ((True, "avg"), (False, "sum")):
        sizes = batch_sizes(comm.size, equal)
        trained, expected = train(sizes, rule), single_process(sizes)
        difference = float(np.max(np.abs(trained - expected)))
        name = f"local batches {sizes}, rule {rule}"
        report.check(f"{name}: equals single process",
                     np.allclose(trained, expected, rtol=1e-10, atol=1e-12))
        report.check(f"{name}: same bits on every rank", same_on_every_rank(trained))
        report.say(f"{name}: max |DDP - single process| = {difference:.1e}")
    if comm.size > 1:  # averaging local means over unequal batches is the wrong rule
        sizes = batch_sizes(comm.size, equal=False)
        wrong = float(np.max(np.abs(train(sizes, "avg") - single_process(sizes))))
        report.check("unequal batches, rule avg: differs from single process", wrong > 1e-6)
        report.say(f"local batches {sizes}, rule avg (wrong here): max difference {wrong:.1e}")
    return report


if __name__ == "__main__":
    sys.exit(0 if main("ddp", on_rank, parser(__doc__)) else 1)
