"""Tests for pycoll.oracle: the numpy statement of every collective's result."""

from __future__ import annotations

import ast
import enum
import inspect

import ml_dtypes
import numpy as np
import pytest
from conftest import ALL_DTYPES

from pycoll import oracle

BF16 = np.dtype(ml_dtypes.bfloat16)


class Op(enum.Enum):
    """Stand-in for pycoll.ReduceOp: the oracle only needs ``.value``."""

    SUM = "sum"
    AVG = "avg"


def seed(dt: np.dtype | None = None) -> list[np.ndarray]:
    """The seed document's 4 ranks: rank r holds [4r+1, 4r+2, 4r+3, 4r+4] (int32 default)."""
    return [np.arange(4 * r + 1, 4 * r + 5).astype(dt or np.int32) for r in range(4)]


def eq(actual: np.ndarray, expected: object, dt: np.dtype) -> None:
    np.testing.assert_array_equal(actual, np.asarray(expected).astype(dt), strict=True)


# --- the seed document's worked numbers, in every dtype --------------------------------


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=str)
def test_seed_allreduce_sum(dt: np.dtype) -> None:
    eq(oracle.allreduce(seed(dt), "sum"), [28, 32, 36, 40], dt)


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=str)
def test_seed_reduce_to_root0(dt: np.dtype) -> None:
    eq(oracle.reduce(seed(dt), "sum", root=0), [28, 32, 36, 40], dt)


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=str)
def test_seed_reduce_scatter(dt: np.dtype) -> None:
    out = oracle.reduce_scatter(seed(dt), "sum")
    assert len(out) == 4
    for r, expected in enumerate([[28], [32], [36], [40]]):
        eq(out[r], expected, dt)


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=str)
def test_seed_allgather(dt: np.dtype) -> None:
    shards = [np.array([v]).astype(dt) for v in (1, 6, 11, 16)]
    eq(oracle.allgather(shards), [1, 6, 11, 16], dt)


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=str)
def test_seed_alltoall(dt: np.dtype) -> None:
    out = oracle.alltoall(seed(dt))
    eq(out[2], [3, 7, 11, 15], dt)
    for j in range(4):
        eq(out[j], [j + 1, j + 5, j + 9, j + 13], dt)


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=str)
def test_seed_sendrecv_and_broadcast(dt: np.dtype) -> None:
    eq(oracle.sendrecv(seed(dt), src=0, dst=1), [1, 2, 3, 4], dt)
    eq(oracle.broadcast(seed(dt), root=0), [1, 2, 3, 4], dt)
    eq(oracle.broadcast(seed(dt), root=3), [13, 14, 15, 16], dt)


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        ("min", [1, 2, 3, 4]),
        ("max", [13, 14, 15, 16]),
        ("avg", [7, 8, 9, 10]),
        ("prod", [1 * 5 * 9 * 13, 2 * 6 * 10 * 14, 3 * 7 * 11 * 15, 4 * 8 * 12 * 16]),
    ],
)
@pytest.mark.parametrize("dt", [np.int64, np.float64], ids=str)
def test_seed_other_ops(op: str, expected: list[int], dt: type) -> None:
    eq(oracle.allreduce(seed(np.dtype(dt)), op), expected, np.dtype(dt))


# --- op forms --------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["sum", "SUM", "Sum", Op.SUM])
def test_op_names_and_value_objects(op: object) -> None:
    eq(oracle.allreduce(seed(), op), [28, 32, 36, 40], np.dtype(np.int32))


def test_op_accepts_pycoll_reduceop() -> None:
    from pycoll.kernels import ReduceOp

    eq(oracle.allreduce(seed(), ReduceOp.AVG), [7, 8, 9, 10], np.dtype(np.int32))


@pytest.mark.parametrize("bad", ["mean", "", 3, None, Op])
def test_bad_op_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match=r"is not a reduction; allowed: 'sum', 'prod'") as info:
        oracle.allreduce(seed(), bad)
    assert f"op={bad!r}" in str(info.value)


@pytest.mark.parametrize("dt", [np.complex64, np.complex128], ids=str)
@pytest.mark.parametrize("op", ["min", "max"])
def test_min_max_on_complex_rejected(dt: type, op: str) -> None:
    name = np.dtype(dt).name
    with pytest.raises(ValueError, match=rf"op='{op}' is not defined for {name}; allowed"):
        oracle.allreduce(seed(np.dtype(dt)), op)


# --- reduction semantics ---------------------------------------------------------------


def test_fold_is_in_rank_order() -> None:
    # (1e16 + 1) rounds back to 1e16, so rank order 0,1,2 gives 0, not 1.
    inputs = [np.array([1e16]), np.array([1.0]), np.array([-1e16])]
    eq(oracle.allreduce(inputs, "sum"), [0.0], np.dtype(np.float64))
    eq(oracle.allreduce([inputs[0], inputs[2], inputs[1]], "sum"), [1.0], np.dtype(np.float64))


def test_sum_stays_in_dtype_and_wraps() -> None:
    eq(oracle.allreduce([np.array([100], np.int8)] * 2, "sum"), [-56], np.dtype(np.int8))
    eq(oracle.allreduce([np.array([255], np.uint8)] * 2, "sum"), [254], np.dtype(np.uint8))
    eq(oracle.allreduce([np.array([30000], np.float16)] * 3, "sum"), [np.inf], np.dtype("f2"))


def test_bfloat16_rounds_each_step() -> None:
    # 257 is not a bfloat16: 256 + 1 rounds to 256 (half-even).
    out = oracle.allreduce([np.array([256], BF16), np.array([1], BF16)], "sum")
    eq(out, [256], BF16)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([-3, -4], -3),  # -7 / 2 -> -3 (toward zero, not floor)
        ([3, 4], 3),
        ([-1, 0, 0], 0),
        ([-5, 0, 0], -1),
        ([5, 0, 0], 1),
        ([-8, 0], -4),
    ],
)
@pytest.mark.parametrize("dt", [np.int8, np.int16, np.int32, np.int64], ids=str)
def test_integer_avg_truncates_toward_zero(values: list[int], expected: int, dt: type) -> None:
    inputs = [np.array([v], dtype=dt) for v in values]
    eq(oracle.allreduce(inputs, "avg"), [expected], np.dtype(dt))


def test_unsigned_avg_and_wrap_before_division() -> None:
    eq(
        oracle.allreduce([np.array([7], np.uint32)] * 2 + [np.array([0], np.uint32)], "avg"),
        [4],
        np.dtype(np.uint32),
    )
    # As NCCL: the int8 sum wraps (100 + 100 -> -56) before the division.
    eq(oracle.allreduce([np.array([100], np.int8)] * 2, "avg"), [-28], np.dtype(np.int8))
    big = np.iinfo(np.int64).max
    eq(
        oracle.allreduce([np.array([big], np.int64), np.array([0], np.int64)], "avg"),
        [big // 2],
        np.dtype(np.int64),
    )


@pytest.mark.parametrize("dt", [np.float16, np.float32, np.float64, BF16], ids=str)
def test_float_avg_divides_once_in_dtype(dt: type) -> None:
    inputs = [np.array([1.0], dt), np.array([0.0], dt), np.array([0.0], dt)]
    out = oracle.allreduce(inputs, "avg")
    eq(out, np.array([1 / 3]).astype(dt), np.dtype(dt))


def test_bfloat16_avg_does_not_round_rank_count() -> None:
    inputs = [np.array([1.0], BF16)] + [np.array([0.0], BF16)] * 256  # 257 ranks
    assert float(oracle.allreduce(inputs, "avg")[0]) == float(np.array(1 / 257).astype(BF16))


def test_complex_avg_divides_each_part() -> None:
    inputs = [
        np.array([complex(np.inf, 1), 0.1 + 0.7j]),
        np.zeros(2, complex),
        np.zeros(2, complex),
    ]
    out = oracle.allreduce(inputs, "avg")
    assert out.dtype == np.complex128
    assert out[0].real == np.inf and out[0].imag == 1 / 3
    assert out[1].real == 0.1 / 3 and out[1].imag == 0.7 / 3


# --- reduce_scatter with counts ------------------------------------------------------


def test_reduce_scatter_counts_with_zeros() -> None:
    out = oracle.reduce_scatter(seed(), "sum", counts=[0, 3, 0, 1])
    expected = [[], [28, 32, 36], [], [40]]
    assert len(out) == 4
    for r in range(4):
        eq(out[r], expected[r], np.dtype(np.int32))


def test_reduce_scatter_even_split_of_two() -> None:
    inputs = [np.arange(8, dtype=np.int64) * (r + 1) for r in range(2)]
    out = oracle.reduce_scatter(inputs, "max")
    eq(out[0], [0, 2, 4, 6], np.dtype(np.int64))
    eq(out[1], [8, 10, 12, 14], np.dtype(np.int64))


@pytest.mark.parametrize(
    ("counts", "match"),
    [
        ([1, 1, 1], r"counts has 3 entries; allowed: one per rank \(4\)"),
        ([1, 1, 1, 2], r"counts=\[1, 1, 1, 2\] sums to 5; it must equal the input length 4"),
        ([2, -1, 2, 1], r"counts\[1\]=-1 is invalid; allowed: an int >= 0"),
        ([1.0, 1, 1, 1], r"counts\[0\]=1\.0 is invalid"),
    ],
)
def test_reduce_scatter_bad_counts(counts: list[object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        oracle.reduce_scatter(seed(), "sum", counts=counts)  # type: ignore[arg-type]


def test_reduce_scatter_indivisible_without_counts() -> None:
    inputs = [np.arange(5, dtype=np.int32)] * 2
    with pytest.raises(ValueError, match=r"input length 5 does not divide by 2 ranks"):
        oracle.reduce_scatter(inputs, "sum")


# --- alltoallv -------------------------------------------------------------------------


def test_alltoallv_uneven_with_empty_pieces() -> None:
    inputs = [
        np.array([10, 11, 12], np.int32),  # to rank 0: [10]; to 1: []; to 2: [11, 12]
        np.array([20], np.int32),  # to rank 2 only
        np.array([30, 31, 32], np.int32),  # to 0: [30, 31]; to 1: [32]; to 2: []
    ]
    send_counts = [[1, 0, 2], [0, 0, 1], [2, 1, 0]]
    out = oracle.alltoallv(inputs, send_counts)
    eq(out[0], [10, 30, 31], np.dtype(np.int32))
    eq(out[1], [32], np.dtype(np.int32))
    eq(out[2], [11, 12, 20], np.dtype(np.int32))


def test_alltoallv_equal_counts_is_alltoall() -> None:
    out = oracle.alltoallv(seed(), [[1] * 4] * 4)
    for a, b in zip(out, oracle.alltoall(seed()), strict=True):
        eq(a, b, np.dtype(np.int32))


def test_alltoallv_all_empty_for_one_receiver() -> None:
    inputs = [np.array([1.5, 2.5]), np.array([3.5])]
    out = oracle.alltoallv(inputs, [[2, 0], [1, 0]])
    eq(out[0], [1.5, 2.5, 3.5], np.dtype(np.float64))
    eq(out[1], [], np.dtype(np.float64))


def test_alltoallv_bad_counts() -> None:
    with pytest.raises(ValueError, match=r"send_counts\[1\]=\[0, 0, 2\] sums to 2; .* length 1"):
        oracle.alltoallv([np.zeros(1)] * 3, [[1, 0, 0], [0, 0, 2], [0, 1, 0]])
    with pytest.raises(ValueError, match=r"send_counts has 2 rows; allowed: one per rank \(3\)"):
        oracle.alltoallv([np.zeros(1)] * 3, [[1, 0, 0], [0, 0, 1]])
    with pytest.raises(ValueError, match=r"send_counts\[0\] has 2 entries"):
        oracle.alltoallv([np.zeros(1)] * 3, [[1, 0], [0, 0, 1], [0, 1, 0]])


def test_alltoall_needs_divisible_equal_lengths() -> None:
    with pytest.raises(ValueError, match=r"inputs\[1\] has length 3; alltoall needs"):
        oracle.alltoall([np.zeros(2), np.zeros(3)])
    with pytest.raises(ValueError, match=r"inputs\[0\] has length 3; .*divisible by 2 ranks"):
        oracle.alltoall([np.zeros(3), np.zeros(3)])


# --- edge sizes ------------------------------------------------------------------------


@pytest.mark.parametrize("dt", [np.int32, np.float16, BF16, np.complex64], ids=str)
def test_zero_length_inputs(dt: type) -> None:
    d = np.dtype(dt)
    inputs = [np.zeros(0, d) for _ in range(3)]
    for op in ("sum", "prod", "avg"):
        eq(oracle.allreduce(inputs, op), [], d)
        eq(oracle.reduce(inputs, op, root=2), [], d)
    assert [x.size for x in oracle.reduce_scatter(inputs, "sum")] == [0, 0, 0]
    assert [x.size for x in oracle.alltoall(inputs)] == [0, 0, 0]
    assert [x.size for x in oracle.alltoallv(inputs, [[0] * 3] * 3)] == [0, 0, 0]
    eq(oracle.allgather(inputs), [], d)
    eq(oracle.broadcast(inputs, root=1), [], d)
    eq(oracle.sendrecv(inputs, src=2, dst=0), [], d)
    assert all(x.dtype == d for x in oracle.reduce_scatter(inputs, "sum"))


def test_allgather_uneven_and_empty_shards() -> None:
    shards = [np.array([1, 2], np.int16), np.array([], np.int16), np.array([3], np.int16)]
    eq(oracle.allgather(shards), [1, 2, 3], np.dtype(np.int16))


@pytest.mark.parametrize("op", ["sum", "prod", "min", "max", "avg"])
def test_one_rank(op: str) -> None:
    x = np.array([-7, 0, 5], np.int32)
    eq(oracle.allreduce([x], op), x, np.dtype(np.int32))
    eq(oracle.reduce([x], op, root=0), x, np.dtype(np.int32))
    (piece,) = oracle.reduce_scatter([x], op)
    eq(piece, x, np.dtype(np.int32))
    (recv,) = oracle.alltoall([x])
    eq(recv, x, np.dtype(np.int32))
    (recv,) = oracle.alltoallv([x], [[3]])
    eq(recv, x, np.dtype(np.int32))
    eq(oracle.allgather([x]), x, np.dtype(np.int32))
    eq(oracle.broadcast([x], root=0), x, np.dtype(np.int32))
    eq(oracle.sendrecv([x], src=0, dst=0), x, np.dtype(np.int32))


def test_results_do_not_alias_inputs() -> None:
    inputs = seed()
    before = [x.copy() for x in inputs]
    results = [
        oracle.allreduce(inputs[:1], "sum"),
        oracle.broadcast(inputs, root=0),
        oracle.sendrecv(inputs, src=0, dst=1),
        *oracle.reduce_scatter(inputs[:1], "sum"),
        *oracle.alltoall(inputs[:1]),
    ]
    for r in results:
        r[...] = 0
    for x, b in zip(inputs, before, strict=True):
        eq(x, b, np.dtype(np.int32))


# --- input validation ------------------------------------------------------------------


def test_validation_messages() -> None:
    with pytest.raises(ValueError, match=r"inputs is empty"):
        oracle.allreduce([], "sum")
    with pytest.raises(ValueError, match=r"inputs\[1\] has ndim=2; allowed: 1-D"):
        oracle.allgather([np.zeros(2), np.zeros((1, 2))])
    with pytest.raises(TypeError, match=r"inputs\[1\]\.dtype=float32 differs from inputs\[0\]"):
        oracle.allreduce([np.zeros(2), np.zeros(2, np.float32)], "sum")
    with pytest.raises(ValueError, match=r"inputs\[2\] has length 3 but inputs\[0\] has 2"):
        oracle.allreduce([np.zeros(2), np.zeros(2), np.zeros(3)], "sum")
    with pytest.raises(ValueError, match=r"root=4 is out of range; allowed: 0\.\.3"):
        oracle.broadcast(seed(), root=4)
    with pytest.raises(ValueError, match=r"root=-1 is out of range"):
        oracle.reduce(seed(), "sum", root=-1)
    with pytest.raises(TypeError, match=r"root=True must be an int rank"):
        oracle.broadcast(seed(), root=True)
    with pytest.raises(ValueError, match=r"src=5 is out of range"):
        oracle.sendrecv(seed(), src=5, dst=0)
    with pytest.raises(ValueError, match=r"dst=4 is out of range"):
        oracle.sendrecv(seed(), src=0, dst=4)


def test_oracle_does_not_import_kernels() -> None:
    tree = ast.parse(inspect.getsource(oracle))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add("." * node.level + (node.module or ""))
    assert imported <= {"__future__", "collections.abc", "ml_dtypes", "numpy"}, imported
