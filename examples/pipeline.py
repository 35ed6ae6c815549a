"""Pipeline parallelism: stages pass activations forward and gradients back by **Send/Recv**.

In pipeline parallelism, a stage sends forward activations to the next stage. During backward,
activation gradients travel in the opposite direction. Several microbatches can be in flight,
so matching the stage and microbatch matters.

Before: stage s (rank s) owns layer s of the network, and, during a step, receives the
activations of microbatch m from stage s - 1 (stage 0 reads the inputs). After: stage s has
sent its activations of every microbatch to stage s + 1, received their gradients back from
it, sent the gradients of its own inputs to stage s - 1, and updated its layer with the
gradient accumulated over the microbatches; it holds its layer, nothing else. Each message is
matched by (peer, tag), the tag naming the step, the microbatch and the direction, and it
carries its microbatch's label, which the receiver checks.

Why Send/Recv and not a collective: only neighbouring stages exchange, one direction in each
phase, and one stage at a time per microbatch; a collective would involve every rank.

    python examples/pipeline.py --ranks 4
    mpiexec -n 4 python examples/pipeline.py
"""

from __future__ import annotations

import sys

import mlp
import numpy as np
from launch import Report, main, parser

import pycoll

INPUTS, HIDDEN, OUTPUTS = 6, 8, 3
MICROBATCHES, EXAMPLES = 4, 22  # uneven microbatches: 6, 6, 5, 5 examples
STEPS, LEARNING_RATE, SEED = 3, 0.05, 0
FORWARD, BACKWARD = 0, 1


def tag(step: int, microbatch: int, direction: int) -> int:
    """One tag per (step, microbatch, direction): no two messages in flight share one."""
    return 2 * (step * MICROBATCHES + microbatch) + direction


def labelled(values: np.ndarray, label: int) -> np.ndarray:
    """``values`` with an extra column holding the microbatch's label (step * M + m)."""
    return np.hstack([values, np.full((len(values), 1), float(label))])


def receive(src: int, rows: int, width: int, message_tag: int, label: int,
            mismatches: list[str]) -> np.ndarray:
    """Recv one labelled microbatch; note it if its label is not the one expected (a shape
    mismatch raises in recv itself)."""
    buffer = pycoll.recv(np.empty((rows, width + 1)), src, message_tag)
    if not np.all(buffer[:, -1] == label):
        mismatches.append(f"tag {message_tag} from {src}: label {buffer[0, -1]}, not {label}")
    return buffer[:, :-1]


def train_step(layer: mlp.Layer, stage: int, stages: int, step: int,
               inputs: list[np.ndarray], targets: list[np.ndarray], widths: list[int],
               mismatches: list[str]) -> tuple[mlp.Layer, float]:
    """One GPipe step of stage ``stage``: forwards of microbatches 0..M-1, backwards M-1..0,
    then SGD on the mean loss; returns the new layer and (last stage) the mean loss.

    Deadlock freedom: a send may wait until its receiver takes it (in-process it always does),
    async sends run one at a time in call order, and a blocking recv first waits for the
    queued sends. In the forward phase stage s waits only for s - 1 (its recv) and s + 1 (to
    take its sends); the last stage sends nothing forward, so the waits end there. Backward is
    the mirror image, ending at stage 0. Within a phase, each stage sends microbatches in the
    order its neighbour receives them, so no queued send waits behind one taken later.
    """
    first, last = stage == 0, stage == stages - 1
    rows = [len(t) for t in targets]
    stash, output_grads, in_flight = {}, {}, []
    loss = 0.0
    for m in range(MICROBATCHES):
        label = step * MICROBATCHES + m
        x = inputs[m] if first else receive(stage - 1, rows[m], widths[stage],
                                            tag(step, m, FORWARD), label, mismatches)
        output, stash[m] = mlp.layer_forward(layer, x, last)  # kept until m's backward
        if last:
            loss_m, grad = mlp.loss_and_grad(output, targets[m])
            loss += loss_m
            output_grads[m] = grad / EXAMPLES  # the mean over the whole batch, not per microbatch
        else:  # async: work on m + 1 while stage s + 1 takes m
            in_flight.append(pycoll.send(labelled(output, label), stage + 1,
                                         tag(step, m, FORWARD), async_op=True))
    grad_w, grad_b = np.zeros_like(layer[0]), np.zeros_like(layer[1])
    for m in reversed(range(MICROBATCHES)):
        label = step * MICROBATCHES + m
        grad_out = output_grads[m] if last else receive(
            stage + 1, rows[m], widths[stage + 1], tag(step, m, BACKWARD), label, mismatches)
        (w_m, b_m), grad_in = mlp.layer_backward(layer, stash.pop(m), grad_out)
        grad_w += w_m
        grad_b += b_m
        if not first:
            in_flight.append(pycoll.send(labelled(grad_in, label), stage - 1,
                                         tag(step, m, BACKWARD), async_op=True))
    for work in in_flight:  # the sent arrays must outlive their sends; errors surface here
        work.wait()
    return (layer[0] - LEARNING_RATE * grad_w, layer[1] - LEARNING_RATE * grad_b), loss / EXAMPLES


def timetable(stages: int) -> list[str]:
    """GPipe's timetable: (s, m) runs forward at slot s + m, then backward mirrored."""
    slots = 2 * (MICROBATCHES + stages - 1)
    lines = []
    for s in range(stages):
        row = [".."] * slots
        for m in range(MICROBATCHES):
            row[s + m] = f"F{m}"
            row[slots - 1 - (s + m)] = f"B{m}"
        lines.append(f"  stage {s}: {' '.join(row)}")
    return lines


def on_rank(args) -> Report:
    comm = pycoll.world()
    stage, stages = comm.rank, comm.size
    report = Report()
    widths = [INPUTS, *[HIDDEN] * (stages - 1), OUTPUTS]  # one layer per stage
    reference = mlp.init(widths, SEED)  # every rank builds the whole model: it is small
    layer = reference[stage]
    x, y = mlp.dataset(EXAMPLES, widths, SEED + 1)
    inputs, targets = np.array_split(x, MICROBATCHES), np.array_split(y, MICROBATCHES)
    mismatches: list[str] = []
    losses, reference_losses = [], []
    for step in range(STEPS):
        layer, loss = train_step(layer, stage, stages, step, inputs, targets, widths,
                                 mismatches)
        losses.append(loss)
        # the single-process reference: the same SGD on the whole batch's mean loss
        loss_sum, grads = mlp.gradients(reference, x, y)
        reference_losses.append(loss_sum / EXAMPLES)
        reference = [(w - LEARNING_RATE * gw / EXAMPLES, b - LEARNING_RATE * gb / EXAMPLES)
                     for (w, b), (gw, gb) in zip(reference, grads)]
    report.check("every message carried its step and microbatch", not mismatches)
    for text in mismatches[:3]:
        report.say(f"stage {stage}: {text}")
    same = all(np.allclose(a, r, rtol=1e-12, atol=1e-12) for a, r in zip(layer, reference[stage]))
    report.check(f"stage {stage}: layer equals the single-process layer {stage}", same)
    if stage == stages - 1:
        report.check("loss per step equals single process",
                     np.allclose(losses, reference_losses, rtol=1e-12, atol=0))
    # for the report only: rank 0 shows the last stage's losses and the largest difference
    shown = pycoll.broadcast(np.array(losses), root=stages - 1)
    mine = max(float(np.max(np.abs(a - r))) for a, r in zip(layer, reference[stage]))
    largest = float(pycoll.allreduce(np.array([mine]), "max")[0])
    sizes = [len(t) for t in targets]
    report.say(f"{stages} stages x {MICROBATCHES} microbatches of {sizes} examples, "
               f"{STEPS} SGD steps on the mean loss; GPipe order per step:")
    report.lines += timetable(stages)
    for step, (loss, expected) in enumerate(zip(shown, reference_losses)):
        report.say(f"step {step}: pipeline loss {loss:.12f}, single process {expected:.12f}")
    report.say(f"largest |layer - single-process layer| over the stages: {largest:.1e}")
    return report


if __name__ == "__main__":
    sys.exit(0 if main("pipeline", on_rank, parser(__doc__)) else 1)
