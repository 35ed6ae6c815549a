"""Mixture of experts: expert parallelism by **AllToAllv** dispatch and return (counts by AllToAll).

Expert parallelism assigns experts to different ranks: expert e lives on rank
e // EXPERTS_PER_RANK. Before: each rank holds its own tokens (a different number per rank)
and only its own experts' weights. A mixture-of-experts (MoE) router picks the top-k experts
of every token, so top-k routing creates several token-expert assignments per token; the rank
groups those token vectors by destination expert. After: each rank holds the MoE layer's
output for its own tokens, in their original order.

Real routing can produce unequal counts or empty destinations (here rank 0's tokens may not
use rank 1's experts, a routing constraint that guarantees rank 0 sends rank 1 nothing).
Variable-size exchanges need matching send/receive counts for each peer, so the per-expert
counts go first, by an AllToAll of a (ranks x local experts) table: each receiver learns how
many rows each source sends each of its experts. Dispatch then sends the groups to their
owners by AllToAllv; the owners run their experts; a return AllToAllv, with the counts
transposed, sends the expert outputs back to the original token owners for combination. The
combine operation must restore token order and apply the routing weights.

Why AllToAllv: every (source, destination) pair carries its own amount of data, and only the
rows routed there. AllGather would send every token to every rank (P times the traffic, most of
it discarded); AllReduce would sum a full tokens x d output from every rank, zeros for every
expert a token did not pick, after every token had reached every rank.
The result is compared with the single-process MoE layer that computes every expert on every
token, without communication.

    python examples/moe.py --ranks 4
    mpiexec -n 4 python examples/moe.py
"""

from __future__ import annotations

import sys

import numpy as np
from launch import Report, main, parser

import pycoll

EXPERTS_PER_RANK, TOP_K, D_MODEL, D_HIDDEN = 2, 2, 8, 16
TOKEN_SEED, ROUTER_SEED, EXPERT_SEED = 100, 7, 1000


def tokens_of(rank: int) -> np.ndarray:
    """Rank ``rank``'s tokens: 3 + 2 * rank of them, so every rank holds a different number."""
    return np.random.default_rng(TOKEN_SEED + rank).standard_normal((3 + 2 * rank, D_MODEL))


def expert_weights(expert: int) -> tuple[np.ndarray, np.ndarray]:
    """Expert ``expert``'s (W1, W2); any rank can rebuild any expert from its number."""
    rng = np.random.default_rng(EXPERT_SEED + expert)
    return (rng.standard_normal((D_MODEL, D_HIDDEN)) / np.sqrt(D_MODEL),
            rng.standard_normal((D_HIDDEN, D_MODEL)) / np.sqrt(D_HIDDEN))


def expert_forward(weights: tuple[np.ndarray, np.ndarray], x: np.ndarray) -> np.ndarray:
    w1, w2 = weights
    return np.maximum(x @ w1, 0.0) @ w2


def route(tokens: np.ndarray, rank: int, nranks: int) -> tuple[np.ndarray, np.ndarray]:
    """Each token's TOP_K experts (tokens x TOP_K) and routing weights (softmax over them)."""
    n_experts = EXPERTS_PER_RANK * nranks
    router = np.random.default_rng(ROUTER_SEED).standard_normal((D_MODEL, n_experts))
    logits = tokens @ router
    if rank == 0 and nranks > 1:  # the routing constraint: rank 0 never uses rank 1's experts
        logits[:, EXPERTS_PER_RANK:2 * EXPERTS_PER_RANK] = -np.inf
    experts = np.argsort(-logits, axis=1, kind="stable")[:, :TOP_K]  # ties: lower expert first
    chosen = np.take_along_axis(logits, experts, axis=1)
    weights = np.exp(chosen - chosen.max(axis=1, keepdims=True))
    return experts, weights / weights.sum(axis=1, keepdims=True)


def reference_layer(nranks: int) -> tuple[list[np.ndarray], np.ndarray]:
    """The single-process MoE layer: every rank's output, and rows[src, expert] routed."""
    routes = [route(tokens_of(r), r, nranks) for r in range(nranks)]
    tokens = np.concatenate([tokens_of(r) for r in range(nranks)])
    experts, weights = (np.concatenate(part) for part in zip(*routes))
    n_experts = EXPERTS_PER_RANK * nranks
    dense = np.stack([expert_forward(expert_weights(e), tokens) for e in range(n_experts)])
    picked = dense[experts, np.arange(len(tokens))[:, None]]  # tokens x TOP_K x D_MODEL
    output = (weights[..., None] * picked).sum(axis=1)
    starts = np.cumsum([len(tokens_of(r)) for r in range(nranks)])[:-1]
    routed = np.stack([np.bincount(e.ravel(), minlength=n_experts) for e, _ in routes])
    return np.split(output, starts), routed


def moe_layer(tokens: np.ndarray, report: Report) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The expert-parallel layer; returns the output, the counts sent and the counts received
    (both ranks x local experts)."""
    comm = pycoll.world()
    experts, weights = route(tokens, comm.rank, comm.size)
    # One row per (token, slot) assignment, grouped by destination expert: since expert e
    # lives on rank e // EXPERTS_PER_RANK, that also groups by destination rank.
    assignment_expert = experts.ravel()
    order = np.argsort(assignment_expert, kind="stable")
    rows = tokens[order // TOP_K]
    sent = np.bincount(assignment_expert, minlength=EXPERTS_PER_RANK * comm.size)
    sent = sent.reshape(comm.size, EXPERTS_PER_RANK)  # [destination rank, its local expert]
    # Counts first: received[src, local expert] is how many rows src sends each of my experts.
    received = pycoll.alltoall(sent)
    arrived = pycoll.alltoallv(rows, send_counts=sent.sum(axis=1),
                               recv_counts=received.sum(axis=1))
    # Within each source the rows come ordered by local expert: the counts say which is which.
    local_expert = np.repeat(np.tile(np.arange(EXPERTS_PER_RANK), comm.size), received.ravel())
    results = np.empty_like(arrived)
    for local in range(EXPERTS_PER_RANK):
        mine = local_expert == local  # one batch per expert, whatever source it came from
        weights_of = expert_weights(comm.rank * EXPERTS_PER_RANK + local)
        results[mine] = expert_forward(weights_of, arrived[mine])
    # Return: each source gets back exactly what it sent, in the order it sent it.
    returned = pycoll.alltoallv(results, send_counts=received.sum(axis=1),
                                recv_counts=sent.sum(axis=1))
    # Combine: undo the sort (back to token, slot order), then weight and sum the slots.
    by_assignment = np.empty_like(returned)
    by_assignment[order] = returned
    by_assignment = by_assignment.reshape(len(tokens), TOP_K, D_MODEL)
    output = (weights[..., None] * by_assignment).sum(axis=1)
    report.say(f"rank {comm.rank}: {len(tokens)} tokens, {len(rows)} assignments out, "
               f"{len(arrived)} rows in for experts "
               f"{comm.rank * EXPERTS_PER_RANK}..{(comm.rank + 1) * EXPERTS_PER_RANK - 1}")
    return output, sent, received


def on_rank(args) -> Report:
    comm = pycoll.world()
    report = Report()
    expected, routed = reference_layer(comm.size)
    output, sent, received = moe_layer(tokens_of(comm.rank), report)

    difference = float(np.abs(output - expected[comm.rank]).max())
    report.check("output equals the single-process MoE layer",
                 np.allclose(output, expected[comm.rank], rtol=1e-12, atol=1e-12))
    mine = slice(comm.rank * EXPERTS_PER_RANK, (comm.rank + 1) * EXPERTS_PER_RANK)
    report.check("counts sent match the router", np.array_equal(sent.ravel(), routed[comm.rank]))
    report.check("counts received match the router", np.array_equal(received, routed[:, mine]))
    if comm.size > 1:
        # the routing constraint's empty destination, seen from both ends of the exchange
        report.check("rank 0 sends rank 1 nothing", (comm.rank != 0 or sent[1].sum() == 0)
                     and (comm.rank != 1 or received[0].sum() == 0))
    # For the report only: every rank's rows per destination, as rank 0 cannot see them alone.
    table = pycoll.allgather(sent.sum(axis=1)).reshape(comm.size, comm.size)
    loads = pycoll.allreduce(sent.ravel(), "sum")
    report.say(f"rows sent [source, destination]:\n{table}")
    report.say(f"rows per expert: {loads.tolist()}; empty (source, destination) pairs: "
               f"{int((table == 0).sum())}; max |output - single process| = {difference:.1e}")
    return report


if __name__ == "__main__":
    sys.exit(0 if main("moe", on_rank, parser(__doc__)) else 1)
