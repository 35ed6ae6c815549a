"""The Numba kernels under the CUDA simulator, against the host (numpy) reducer, exactly.

Not collected by the main run (the name does not match test_*.py): NUMBA_ENABLE_CUDASIM
must be set before numba.cuda is first imported, so tests/test_kernels_cuda.py runs this
file in a subprocess with it set and requires every test here to pass. By hand:

    NUMBA_ENABLE_CUDASIM=1 python -m pytest tests/cudasim/sim_numba_kernels.py -q

The simulator runs one Python thread per CUDA thread, so grids are tiny: 16 threads x at
most 2 blocks, which still makes every size above 32 go round the grid-stride loop.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

from pycoll.kernels import host, table
from pycoll.kernels.host import ReduceOp

if not os.environ.get("NUMBA_ENABLE_CUDASIM"):
    pytest.exit("run with NUMBA_ENABLE_CUDASIM=1 (see the docstring)", returncode=4)

from pycoll.kernels.numba_cuda import (  # noqa: E402
    SIM_MAX_BLOCKS,
    NumbaKernels,
    simulator_enabled,
)

DTYPES = [row.dtype for row in table.GPU_DTYPES]
FLOATS = [row.dtype for row in table.GPU_DTYPES if row.kind == "float"]
INTS = [row.dtype for row in table.GPU_DTYPES if row.kind != "float"]
OPS = ["sum", "prod", "min", "max", "avg"]
SIZES = [0, 1, 7, 33, 100]
BF16 = np.dtype(ml_dtypes.bfloat16)

REDUCE_CASES = [(dt, op, n) for dt in DTYPES for op in OPS for n in SIZES]
COPY_CASES = [(dt, n) for dt in DTYPES for n in SIZES]
NAN_CASES = [(dt, op) for dt in FLOATS for op in ("min", "max")]
ROUNDING_CASES = [(dt, op) for dt in FLOATS for op in ("sum", "prod", "avg")]
PLAIN_TESTS = 6  # the unparametrized tests below
EXPECTED = (
    len(REDUCE_CASES)
    + len(COPY_CASES)
    + len(DTYPES)  # test_divide_truncates_like_host
    + len(NAN_CASES)
    + len(ROUNDING_CASES)
    + PLAIN_TESTS
)


def _ids(value: object) -> str:
    return value.name if isinstance(value, np.dtype) else str(value)


@pytest.fixture(scope="module")
def kernels() -> NumbaKernels:
    assert simulator_enabled()
    return NumbaKernels(threads=16, max_blocks=2)


def values(dt: np.dtype, op: str, n: int, seed: int) -> np.ndarray:
    """Small integers (powers of two and -1 for prod): every op and fold is exact."""
    rng = np.random.default_rng([seed, n, DTYPES.index(dt)])
    if op == "prod":
        v = rng.choice([1, 2] if dt.kind == "u" else [-1, 1, 2], size=n)
    elif dt.kind == "u":
        v = rng.integers(0, 4, n)
    else:
        v = rng.integers(-3, 4, n)
    return v.astype(np.float64).astype(dt)


def same(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal bit for bit, except that any NaN matches any NaN."""
    if got.dtype.kind == "f" or got.dtype == BF16:
        g, w = got.astype(np.float64), want.astype(np.float64)
        return bool(
            np.array_equal(g, w, equal_nan=True) and np.array_equal(np.signbit(g), np.signbit(w))
        )
    return bool(np.array_equal(got, want))


def host_fold(op: ReduceOp, dt: np.dtype, arrays: list[np.ndarray]) -> np.ndarray:
    out = arrays[0].copy()
    for a in arrays[1:]:
        host.reducer(op, dt)(out, a)
    return out


@pytest.mark.parametrize(("dt", "op", "n"), REDUCE_CASES, ids=_ids)
def test_reduce_forms_match_host(kernels, dt, op, n):
    rop = ReduceOp.parse(op)
    a, b, c = (values(dt, op, n, seed) for seed in (1, 2, 3))
    reduce = kernels.reducer(op, dt)

    got = a.copy()
    reduce(got, b)  # dst = dst op src
    want = host_fold(rop, dt, [a, b])
    assert same(got, want)

    got = np.zeros_like(a)
    reduce(got, b, first=a)  # dst = first op src
    assert same(got, want)

    dst, peer = np.zeros_like(a), np.zeros_like(a)
    kernels.reduce_copy(dst, peer, a, b, op)
    assert same(dst, want) and same(peer, want)

    for srcs in ([a], [a, b, c]):
        got = np.zeros_like(a)
        kernels.reduce_n(got, srcs, op)
        assert same(got, host_fold(rop, dt, srcs))

    got = a.copy()
    kernels.reduce_n(got, [got, b, c], op)  # dst may be the first source
    assert same(got, host_fold(rop, dt, [a, b, c]))

    for nranks in (1, 3):
        got, want = host_fold(rop, dt, [a, b, c]), host_fold(rop, dt, [a, b, c])
        kernels.finish(got, op, nranks)
        host.finish(want, rop, nranks)
        assert same(got, want)


@pytest.mark.parametrize(("dt", "n"), COPY_CASES, ids=_ids)
def test_copy(kernels, dt, n):
    src = values(dt, "sum", n, 4)
    dst = np.zeros_like(src)
    kernels.copy(dst, src)
    assert same(dst, src)
    dst, peer = np.zeros_like(src), np.zeros_like(src)
    kernels.copy_pair(dst, peer, src)
    assert same(dst, src) and same(peer, src)


@pytest.mark.parametrize("dt", DTYPES, ids=_ids)
def test_divide_truncates_like_host(kernels, dt):
    # Integers: C truncation toward zero, divisors beyond the dtype's range (0, or -1 for
    # min / -min); floats: the float64 quotient rounded once.
    if dt.kind in "iu":
        info = np.iinfo(dt)
        base = [info.min, info.min + 1, -8, -7, -1, 0, 1, 7, 8, info.max]
        vals = np.array([v for v in base if info.min <= v <= info.max], dtype=dt)
        beyond = [int(info.max), int(info.max) + 1, -int(info.min)]
        divisors = [2, 3, 7] + [d for d in beyond if 1 <= d < 2**63]
    else:
        vals = (np.arange(-40, 41) * 0.75).astype(dt)
        divisors = [2, 3, 7, 10, 1000]
    for d in divisors:
        got, want = vals.copy(), vals.copy()
        kernels.finish(got, "avg", d)
        host.finish(want, ReduceOp.AVG, d)
        assert same(got, want), (d, got, want)


@pytest.mark.parametrize(("dt", "op"), NAN_CASES, ids=_ids)
def test_min_max_propagate_nan(kernels, dt, op):
    a = np.array([np.nan, 1, np.nan, -np.inf, 2], dtype=np.float64).astype(dt)
    b = np.array([1, np.nan, np.nan, 3, np.inf], dtype=np.float64).astype(dt)
    got = a.copy()
    kernels.reducer(op, dt)(got, b)
    want = a.copy()
    with np.errstate(all="ignore"):
        host.reducer(ReduceOp.parse(op), dt)(want, b)
    assert same(got, want)


@pytest.mark.parametrize(("dt", "op"), ROUNDING_CASES, ids=_ids)
def test_rounding_matches_host_on_random_values(kernels, dt, op):
    # Non-integer data: each op is one correctly rounded operation on both sides, so the
    # float16/bfloat16 paths (float32 compute, round to nearest even) must agree bitwise.
    rng = np.random.default_rng(DTYPES.index(dt))
    a = rng.standard_normal(100).astype(dt)
    b = rng.standard_normal(100).astype(dt)
    got, want = a.copy(), a.copy()
    kernels.reducer(op, dt)(got, b)
    host.reducer(ReduceOp.parse(op), dt)(want, b)
    if op == "avg":
        kernels.finish(got, op, 3)
        host.finish(want, ReduceOp.AVG, 3)
    assert same(got, want)


def test_collected_everything(request):
    # The parent test counts on this suite: a case list that silently shrank fails here.
    assert len(request.session.items) == EXPECTED


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_integers_wrap_like_host(kernels):
    for dt in INTS:
        info = np.iinfo(dt)
        a = np.array([info.max, info.min, info.max], dtype=dt)
        b = np.array([1, -1 if info.min else 1, 2], dtype=dt)
        for op in ("sum", "prod"):
            got, want = a.copy(), a.copy()
            kernels.reducer(op, dt)(got, b)  # numpy scalars in the simulator's threads
            with np.errstate(all="ignore"):
                host.reducer(ReduceOp.parse(op), dt)(want, b)
            assert same(got, want), (dt, op)


def test_bad_arguments_name_the_argument(kernels):
    a = np.zeros(4, np.float32)
    with pytest.raises(TypeError, match="src.dtype=float64"):
        kernels.reducer("sum", np.float32)(a, np.zeros(4, np.float64))
    with pytest.raises(ValueError, match="src.size=5"):
        kernels.reducer("sum", np.float32)(a, np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="first must be C-contiguous"):
        kernels.reducer("sum", np.float32)(a, a, first=np.zeros(8, np.float32)[::2])
    with pytest.raises(TypeError, match="complex64"):
        kernels.reducer("sum", np.complex64)
    with pytest.raises(ValueError, match="sources must be a non-empty"):
        kernels.reduce_n(a, [], "sum")
    with pytest.raises(ValueError, match="nranks=0"):
        kernels.finish(a, "avg", 0)
    with pytest.raises(TypeError, match="dst must be"):
        kernels.copy([1, 2], a)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_bfloat16_runs_on_the_simulator(kernels):
    # bfloat16 travels as uint16 bits; the kernels widen and round them by bit arithmetic.
    a = np.array([1.5, -2.0, 3.0e38, 1e-40], dtype=BF16)
    got = a.copy()
    kernels.reducer("sum", BF16)(got, a)
    want = a.copy()
    host.reducer(ReduceOp.SUM, BF16)(want, a)
    assert same(got, want)


def test_contiguous_arrays_of_any_shape(kernels):
    # The kernels index flat; a C-contiguous 2-D array is reduced as its 1-D view.
    a = values(np.dtype(np.int32), "sum", 24, 1).reshape(4, 6)
    b = values(np.dtype(np.int32), "sum", 24, 2).reshape(4, 6)
    got = a.copy()
    kernels.reducer("max", np.int32)(got, b, first=got)  # dst may be first
    assert same(got, np.maximum(a, b))


def test_default_grid_stays_tiny():
    # One Python thread per CUDA thread: the default cap must not scale like a real GPU's.
    kernels = NumbaKernels()
    assert kernels._grid(1 << 30) == SIM_MAX_BLOCKS == 4
    assert kernels._grid(1) == 1
