"""Fully sharded data parallelism (FSDP): **AllGather** parameters, **ReduceScatter** gradients.

Before a step each rank owns one shard of every layer's parameters, and the optimizer state
(Adam's first and second moments) of that shard only. To compute a layer, the ranks AllGather
its shards: the full values are reconstructed, not added, so AllGather and not AllReduce; the
full layer is dropped again after use (gathered again for backward), so a rank holds one full
layer at a time. Each rank then has gradient contributions from its own local batch for every
parameter of the layer, but updates only its shard, so it needs only its shard of the summed
gradient: ReduceScatter. An AllReduce would also deliver the other owners' positions, which
this rank would throw away. The ReduceScatter runs in place, as NCCL's: the summed shard lands
in this rank's rows of the local gradient, so it holds no array of its own. After the step
each rank owns its updated shard; the next gather reconstructs the updated parameters.

First the seed's scalar example, exactly: four scalar parameters [10, 20, 30, 40], owned one
per rank at 4 ranks (split as evenly as the rank count allows otherwise); four local batches
with gradients [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16] (batch b on rank
b mod p); ReduceScatter(sum) gives the owner of w0 28, of w1 32, ...; each owner divides by 4
and takes an SGD step with learning rate 0.1; AllGather reconstructs [9.3, 19.2, 29.1, 39.0].

Then a small MLP (examples/mlp.py) trained with SGD and with Adam on unequal local batches
(the summed-loss gradients, divided by the global example count), equal to single-process
training on the concatenated batch, and the peak parameter-state memory per rank against DDP.

    python examples/fsdp.py --ranks 4
    mpiexec -n 4 python examples/fsdp.py
"""

from __future__ import annotations

import sys

import mlp
import numpy as np
from launch import Report, main, offsets, parser, shares

import pycoll

SEED_PARAMETERS = [10.0, 20.0, 30.0, 40.0]
SEED_RESULT = [9.3, 19.2, 29.1, 39.0]
WIDTHS = [8, 24, 24, 24, 24, 3]  # layers of similar size: one full layer is a small part
STEPS = 4
RATES = {"sgd": 0.1, "adam": 0.01}
BETAS, EPSILON = (0.9, 0.999), 1e-8


def seed_step() -> np.ndarray:
    """The seed's FSDP step on this rank; returns the gathered parameters."""
    comm = pycoll.world()
    counts = shares(len(SEED_PARAMETERS), comm.size)
    start, stop = offsets(counts)[comm.rank : comm.rank + 2]
    shard = np.array(SEED_PARAMETERS[start:stop])
    pycoll.allgather(shard, counts=counts)  # gathered for compute (the gradients are given)
    batches = [np.arange(4.0) + 4 * b + 1 for b in range(4)]
    local = sum((g for b, g in enumerate(batches) if b % comm.size == comm.rank),
                np.zeros(4))
    mean = pycoll.reduce_scatter(local, "sum", counts=counts) / len(batches)
    return pycoll.allgather(shard - 0.1 * mean, counts=counts)


class Optimizer:
    """SGD or Adam on one flat vector (a shard, or the whole model for the reference); Adam
    keeps its moments for exactly the elements it updates."""

    def __init__(self, kind: str, size: int):
        self.kind, self.rate, self.t = kind, RATES[kind], 0
        self.moments = (np.zeros(size), np.zeros(size)) if kind == "adam" else ()

    def step(self, parameters: np.ndarray, grad: np.ndarray) -> None:
        if self.kind == "sgd":
            parameters -= self.rate * grad
            return
        self.t += 1
        (b1, b2), (m, v) = BETAS, self.moments
        m += (1 - b1) * (grad - m)
        v += (1 - b2) * (grad * grad - v)
        corrected = (m / (1 - b1**self.t)) / (np.sqrt(v / (1 - b2**self.t)) + EPSILON)
        parameters -= self.rate * corrected


class Ledger:
    """Bytes of parameter state (parameters, gradients, optimizer moments) held, and the
    most held at once."""

    def __init__(self) -> None:
        self.held, self.peak = 0, 0

    def hold(self, *arrays: np.ndarray) -> None:
        self.held += sum(a.nbytes for a in arrays)
        self.peak = max(self.peak, self.held)

    def release(self, *arrays: np.ndarray) -> None:
        self.held -= sum(a.nbytes for a in arrays)


def batch_sizes(nranks: int) -> list[int]:
    return [1 + 2 * r for r in range(nranks)]


def train_fsdp(kind: str, ledger: Ledger) -> list[np.ndarray]:
    """FSDP training on this rank; returns every layer's gathered flat parameters."""
    comm = pycoll.world()
    template = mlp.init(WIDTHS, seed=0)  # every rank makes the same start, keeps its shards
    counts = [shares(mlp.flatten([layer]).size, comm.size) for layer in template]
    shards, optimizers = [], []
    for layer, layer_counts in zip(template, counts):
        start, stop = offsets(layer_counts)[comm.rank : comm.rank + 2]
        shards.append(mlp.flatten([layer])[start:stop].copy())
        optimizers.append(Optimizer(kind, stop - start))
        ledger.hold(shards[-1], *optimizers[-1].moments)
    # the full model is not kept, only its shapes (zero-byte broadcast views)
    template = [tuple(np.broadcast_to(0.0, a.shape) for a in layer) for layer in template]

    def gathered(index: int) -> tuple[mlp.Layer, np.ndarray]:
        """Layer ``index`` reconstructed from every rank's shard (and the flat array)."""
        full = pycoll.allgather(shards[index], counts=counts[index])
        ledger.hold(full)
        return mlp.unflatten(full, [template[index]])[0], full

    sizes = batch_sizes(comm.size)
    start, stop = offsets(sizes)[comm.rank : comm.rank + 2]
    for step in range(STEPS):
        x, y = mlp.dataset(sum(sizes), WIDTHS, seed=200 + step)
        activation, caches = x[start:stop], []
        for index in range(len(shards)):  # forward: gather, compute, reshard
            layer, full = gathered(index)
            activation, cache = mlp.layer_forward(layer, activation, index == len(shards) - 1)
            caches.append(cache)
            ledger.release(full)
        _, grad_out = mlp.loss_and_grad(activation, y[start:stop])
        for index in reversed(range(len(shards))):  # backward: gather again, scatter grads
            layer, full = gathered(index)
            grads, grad_out = mlp.layer_backward(layer, caches[index], grad_out)
            flat_grad = mlp.flatten([grads])
            ledger.hold(flat_grad)
            # in place, as NCCL's: the summed shard lands in this rank's rows of flat_grad
            first, last = offsets(counts[index])[comm.rank : comm.rank + 2]
            mine = pycoll.reduce_scatter(flat_grad, "sum", counts=counts[index],
                                         out=flat_grad[first:last])
            mine /= sum(sizes)
            ledger.release(full)
            optimizers[index].step(shards[index], mine)
            ledger.release(flat_grad)
    return [pycoll.allgather(shard, counts=c) for shard, c in zip(shards, counts)]


def train_single_process(kind: str) -> list[np.ndarray]:
    """The same training in one process, on the concatenated batch."""
    layers = mlp.init(WIDTHS, seed=0)
    flat = mlp.flatten(layers)
    layers = mlp.unflatten(flat, layers)
    optimizer = Optimizer(kind, flat.size)
    sizes = batch_sizes(pycoll.world().size)
    for step in range(STEPS):
        x, y = mlp.dataset(sum(sizes), WIDTHS, seed=200 + step)
        _, grads = mlp.gradients(layers, x, y)
        optimizer.step(flat, mlp.flatten(grads) / sum(sizes))
    return [mlp.flatten([layer]) for layer in layers]


def on_rank(args) -> Report:
    comm = pycoll.world()
    report = Report()
    result = seed_step()
    report.check("the seed's scalar step", result.tolist() == SEED_RESULT)
    report.say(f"seed step at {comm.size} ranks: {result.tolist()} (the seed: {SEED_RESULT})")
    total = sum(mlp.flatten([layer]).size for layer in mlp.init(WIDTHS, seed=0))
    for kind in RATES:
        ledger = Ledger()
        trained, expected = train_fsdp(kind, ledger), train_single_process(kind)
        difference = max(float(np.max(np.abs(a - b))) for a, b in zip(trained, expected))
        report.check(f"{kind}: equals single process",
                     all(np.allclose(a, b, rtol=1e-10, atol=1e-12)
                         for a, b in zip(trained, expected)))
        # DDP holds the full parameters, the full gradients and full moments all the time
        ddp = 8 * total * (2 + len(Optimizer(kind, 0).moments))
        report.say(f"{kind}, local batches {batch_sizes(comm.size)}: max |FSDP - single "
                   f"process| = {difference:.1e}; peak parameter state on rank {comm.rank}: "
                   f"{ledger.peak} B (DDP: {ddp} B, {ledger.peak / ddp:.0%})")
    return report


if __name__ == "__main__":
    sys.exit(0 if main("fsdp", on_rank, parser(__doc__)) else 1)
