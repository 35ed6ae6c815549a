"""Shared helpers: integer-valued inputs that make every algorithm's result exact."""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np
import pytest

from pycoll import select

ALL_DTYPES = [
    np.dtype(t)
    for t in (
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.float16,
        np.float32,
        np.float64,
        ml_dtypes.bfloat16,
        np.complex64,
        np.complex128,
    )
]
OPS = ["sum", "prod", "min", "max", "avg"]
# This Python, for a subprocess: with -P (3.11+) so that no folder shadows the installed
# pycoll (where the working folder is not this checkout); 3.10 has no -P.
PYTHON = [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else [])]


def ops_for(dtype: np.dtype) -> list[str]:
    return ["sum", "prod", "avg"] if dtype.kind == "c" else OPS


def exact_input(rank: int, shape, dtype: np.dtype, op: str, seed: int = 0) -> np.ndarray:
    """Small integers (powers of two for prod) so sums, products and means are exact."""
    rng = np.random.default_rng([seed, rank, 12345])
    if op == "prod":
        values = rng.choice([1, 2] if dtype.kind == "u" else [-1, 1, 2], size=shape)
    elif dtype.kind == "u":
        values = rng.integers(0, 4, size=shape)
    else:
        values = rng.integers(-3, 4, size=shape)
    array = values.astype(np.float64).astype(dtype)
    if dtype.kind == "c":
        array = array + 1j * rng.integers(-1, 2, size=shape).astype(dtype)
        if op == "prod":
            array = rng.choice(np.array([1, -1, 1j, -1j], dtype=dtype), size=shape)
    return np.ascontiguousarray(array.astype(dtype))


@pytest.fixture
def segments():
    """Force a segment count for one test; restores the size rule afterwards."""
    saved = select.FORCED_SEGMENTS

    def force(count: int | None) -> None:
        select.FORCED_SEGMENTS = count

    yield force
    select.FORCED_SEGMENTS = saved
