"""The small numpy model the training examples share: tanh hidden layers, a linear output
layer, and the squared error 0.5 * |output - target|^2 per example.

Layers are (W, b) pairs, so that data parallelism (ddp.py) can flatten them all, full sharding
(fsdp.py) can gather one layer at a time, and pipelining (pipeline.py) can give each stage its
own. The gradients are of the *sum* of the per-example losses: a caller divides by the number
of examples it means to average over, which is where the weighting rules live.
"""

from __future__ import annotations

import numpy as np

Layer = tuple[np.ndarray, np.ndarray]  # W (fan_in x fan_out), b (fan_out)


def init(widths: list[int], seed: int) -> list[Layer]:
    """Layers mapping widths[0] -> widths[1] -> ... -> widths[-1], drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in),
             rng.standard_normal(fan_out) * 0.1)
            for fan_in, fan_out in zip(widths[:-1], widths[1:])]


def layer_forward(layer: Layer, x: np.ndarray, last: bool) -> tuple[np.ndarray, tuple]:
    """One layer: tanh(x W + b), or x W + b for the last; returns the output and what the
    backward pass needs."""
    w, b = layer
    z = x @ w + b
    y = z if last else np.tanh(z)
    return y, (x, y, last)


def layer_backward(layer: Layer, cache: tuple, grad_y: np.ndarray
                   ) -> tuple[Layer, np.ndarray]:
    """Gradients of the layer's (W, b), and of its input, from the gradient of its output."""
    x, y, last = cache
    grad_z = grad_y if last else grad_y * (1.0 - y * y)
    return (x.T @ grad_z, grad_z.sum(axis=0)), grad_z @ layer[0].T


def forward(layers: list[Layer], x: np.ndarray) -> tuple[np.ndarray, list[tuple]]:
    caches = []
    for i, layer in enumerate(layers):
        x, cache = layer_forward(layer, x, last=i == len(layers) - 1)
        caches.append(cache)
    return x, caches


def backward(layers: list[Layer], caches: list[tuple], grad_out: np.ndarray) -> list[Layer]:
    grads: list[Layer] = []
    for layer, cache in zip(reversed(layers), reversed(caches)):
        grad, grad_out = layer_backward(layer, cache, grad_out)
        grads.append(grad)
    return grads[::-1]


def loss_and_grad(output: np.ndarray, target: np.ndarray) -> tuple[float, np.ndarray]:
    """The summed squared error over the batch, and its gradient with respect to the output."""
    error = output - target
    return 0.5 * float(np.sum(error * error)), error


def gradients(layers: list[Layer], x: np.ndarray, target: np.ndarray
              ) -> tuple[float, list[Layer]]:
    """The summed loss of a batch and the gradients of that sum."""
    output, caches = forward(layers, x)
    loss, grad_out = loss_and_grad(output, target)
    return loss, backward(layers, caches, grad_out)


def flatten(layers: list[Layer]) -> np.ndarray:
    """Every parameter in one contiguous vector (W then b, layer by layer)."""
    return np.concatenate([a.reshape(-1) for layer in layers for a in layer])


def unflatten(flat: np.ndarray, like: list[Layer]) -> list[Layer]:
    """Views of ``flat`` shaped as ``like``'s layers (the inverse of :func:`flatten`)."""
    layers, at = [], 0
    for w, b in like:
        layer = []
        for a in (w, b):
            layer.append(flat[at : at + a.size].reshape(a.shape))
            at += a.size
        layers.append(tuple(layer))
    return layers


def dataset(examples: int, widths: list[int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets (a fixed random teacher network plus noise)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((examples, widths[0]))
    teacher = init(widths, seed + 1)
    y, _ = forward(teacher, x)
    return x, y + 0.1 * rng.standard_normal(y.shape)
