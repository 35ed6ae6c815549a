"""Tests for the host (numpy) reducer: pycoll.kernels.host."""

from __future__ import annotations

import math
import tracemalloc
import warnings

import ml_dtypes
import numpy as np
import pytest

import pycoll
from pycoll import kernels, oracle

# Bound from the package so the test exercises the public re-exports.
SUPPORTED_DTYPES = kernels.SUPPORTED_DTYPES
ReduceOp = kernels.ReduceOp
check_dtype = kernels.check_dtype
check_op_for_dtype = kernels.check_op_for_dtype
finish = kernels.finish
reduce_into = kernels.reduce_into
host = kernels.host

BF16 = np.dtype(ml_dtypes.bfloat16)
COMPLEX = {np.dtype(np.complex64), np.dtype(np.complex128)}
VALID_PAIRS = [
    (op, dt)
    for op in ReduceOp
    for dt in SUPPORTED_DTYPES
    if not (dt in COMPLEX and op in (ReduceOp.MIN, ReduceOp.MAX))
]


def _ids(pair: tuple[ReduceOp, np.dtype]) -> str:
    return f"{pair[0].value}-{pair[1].name}"


def _small_values(dt: np.dtype, seed: int, n: int = 64) -> np.ndarray:
    """Small integer-valued data (negatives for signed/float/complex): every op is exact."""
    rng = np.random.default_rng(seed)
    if dt.kind == "u":
        return rng.integers(0, 6, n).astype(dt)
    re = rng.integers(-5, 6, n)
    if dt in COMPLEX:
        return (re + 1j * rng.integers(-5, 6, n)).astype(dt)
    return re.astype(dt)


def _wide(dt: np.dtype) -> type:
    if dt in COMPLEX:
        return np.complex128
    if dt.kind in "iu":
        return np.int64
    return np.float64


_DIRECT = {
    ReduceOp.SUM: lambda a, b: a + b,
    ReduceOp.AVG: lambda a, b: a + b,
    ReduceOp.PROD: lambda a, b: a * b,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}


# --- reduce_into: every op x every dtype -------------------------------------------------


@pytest.mark.parametrize("pair", VALID_PAIRS, ids=_ids)
def test_reduce_into_matches_direct_numpy(pair: tuple[ReduceOp, np.dtype]) -> None:
    op, dt = pair
    dst, src = _small_values(dt, 1), _small_values(dt, 2)
    w = _wide(dt)
    expected = _DIRECT[op](dst.astype(w), src.astype(w)).astype(dt)
    src_before = src.copy()
    buf = dst
    reduce_into(dst, src, op)
    assert dst is buf and dst.dtype == dt
    np.testing.assert_array_equal(dst, expected, strict=True)
    np.testing.assert_array_equal(src, src_before, strict=True)


@pytest.mark.parametrize("pair", VALID_PAIRS, ids=_ids)
def test_reduce_then_finish_matches_oracle(pair: tuple[ReduceOp, np.dtype]) -> None:
    op, dt = pair
    inputs = [_small_values(dt, s, 16) for s in range(3)]
    work = inputs[0].copy()
    for x in inputs[1:]:
        reduce_into(work, x, op)
    finish(work, op, len(inputs))
    np.testing.assert_array_equal(work, oracle.allreduce(inputs, op), strict=True)


@pytest.mark.parametrize("dt", [np.float16, np.float32, np.float64, BF16], ids=str)
@pytest.mark.parametrize("op", list(ReduceOp), ids=lambda o: o.value)
def test_fractional_floats_match_oracle(dt: type, op: ReduceOp) -> None:
    # Same fold order, so rounded results agree bit for bit, avg quotient included.
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal(200).astype(dt) for _ in range(5)]
    work = inputs[0].copy()
    for x in inputs[1:]:
        reduce_into(work, x, op)
    finish(work, op, len(inputs))
    np.testing.assert_array_equal(work, oracle.allreduce(inputs, op), strict=True)


@pytest.mark.parametrize("op", list(ReduceOp), ids=lambda o: o.value)
def test_bfloat16_matches_float32_rounded(op: ReduceOp) -> None:
    # bfloat16 op == the float32 op rounded to bfloat16 (exact, round-half-even).
    rng = np.random.default_rng(3)
    a = (rng.standard_normal(4096) * 100).astype(BF16)
    b = (rng.standard_normal(4096) * 100).astype(BF16)
    expected = host._UFUNCS[op](a.astype(np.float32), b.astype(np.float32)).astype(BF16)
    reduce_into(a, b, op)
    np.testing.assert_array_equal(a, expected, strict=True)


@pytest.mark.parametrize("op", list(ReduceOp), ids=lambda o: o.value)
def test_bfloat16_float32_fallback_is_exact(op: ReduceOp, monkeypatch: pytest.MonkeyPatch) -> None:
    # The fallback is used only if ml_dtypes lacks a loop; force it and compare.
    rng = np.random.default_rng(4)
    a = (rng.standard_normal(1000) * 1e3).astype(BF16)
    b = (rng.standard_normal(1000) * 1e3).astype(BF16)
    native = a.copy()
    reduce_into(native, b, op)
    fallback = {uf: host._float32_fallback(uf) for uf in set(host._UFUNCS.values())}
    monkeypatch.setattr(host, "_BF16_FALLBACK", fallback)
    buf = a
    reduce_into(a, b, op)
    assert a is buf
    np.testing.assert_array_equal(a, native, strict=True)


def test_reduce_into_accepts_op_names_and_nd_views() -> None:
    dst = np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2]
    src = np.ones((3, 2), dtype=np.int32)
    reduce_into(dst, src, "Sum")  # type: ignore[arg-type]
    np.testing.assert_array_equal(dst, [[1, 3], [5, 7], [9, 11]])


def test_reduce_into_same_buffer() -> None:
    x = np.array([1, -2, 3], dtype=np.int16)
    reduce_into(x, x, ReduceOp.SUM)
    np.testing.assert_array_equal(x, [2, -4, 6])


# --- C semantics: wrap, inf, NaN, no warnings ------------------------------------------


def test_integer_overflow_wraps_silently() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = np.array([127, -128], dtype=np.int8)
        reduce_into(a, np.array([1, -1], dtype=np.int8), ReduceOp.SUM)
        np.testing.assert_array_equal(a, [-128, 127])
        u = np.array([255, 0], dtype=np.uint8)
        reduce_into(u, np.array([1, 0], dtype=np.uint8), ReduceOp.SUM)
        np.testing.assert_array_equal(u, [0, 0])
        big = np.array([2**62], dtype=np.int64)
        reduce_into(big, np.array([4], dtype=np.int64), ReduceOp.PROD)
        np.testing.assert_array_equal(big, [0])


@pytest.mark.parametrize("dt", [np.float16, np.float32, np.float64, BF16], ids=str)
def test_float_overflow_and_nan_are_silent(dt: type) -> None:
    big = float(ml_dtypes.finfo(dt).max)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = np.array([big, np.inf, np.nan, 1.0], dtype=dt)
        reduce_into(a, np.array([big, -np.inf, 1.0, np.nan], dtype=dt), ReduceOp.SUM)
        f = a.astype(np.float32)
        assert f[0] == np.inf and np.isnan(f[1:]).all()
        for op in (ReduceOp.MIN, ReduceOp.MAX):
            m = np.array([np.nan, 1.0], dtype=dt)
            reduce_into(m, np.array([1.0, np.nan], dtype=dt), op)  # NaN propagates
            assert np.isnan(m.astype(np.float32)).all()


ALLOC_DTYPES = {
    np.dtype(d)
    for d in (np.int8, np.int32, np.int64, np.float16, np.float32, np.float64, BF16, np.complex64)
}


@pytest.mark.parametrize("pair", [p for p in VALID_PAIRS if p[1] in ALLOC_DTYPES], ids=_ids)
def test_reduce_into_does_not_allocate(pair: tuple[ReduceOp, np.dtype]) -> None:
    op, dtype = pair
    n = 1 << 17
    dst, src = np.ones(n, dtype=dtype), np.ones(n, dtype=dtype)
    reduce_into(dst, src, op)  # warm up any lazily built state
    tracemalloc.start()
    try:
        reduce_into(dst, src, op)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024 < dst.nbytes, f"peak {peak} bytes for a {dst.nbytes}-byte buffer"


# --- finish ----------------------------------------------------------------------------


INT_DTYPES = [d for d in SUPPORTED_DTYPES if d.kind in "iu"]


@pytest.mark.parametrize("dt", INT_DTYPES, ids=str)
@pytest.mark.parametrize("nranks", [1, 2, 3, 4, 7])
def test_integer_avg_truncates_toward_zero(dt: np.dtype, nranks: int) -> None:
    info = np.iinfo(dt)
    vals = [0, 1, 2, 3, 5, 6, 7, 13, info.max, info.max - 1]
    if info.min < 0:
        vals += [-1, -2, -3, -5, -6, -7, -13, info.min, info.min + 1]
    work = np.array(vals, dtype=dt)
    finish(work, ReduceOp.AVG, nranks)
    expected = np.array([_trunc(v, nranks) for v in vals], dtype=dt)
    np.testing.assert_array_equal(work, expected, strict=True)


def _trunc(v: int, n: int) -> int:
    q = abs(v) // n
    return -q if v < 0 else q


def test_integer_avg_hand_values() -> None:
    work = np.array([-7, 7, -8, 8, -1, 1, -128, 127], dtype=np.int8)
    finish(work, ReduceOp.AVG, 2)
    np.testing.assert_array_equal(work, [-3, 3, -4, 4, 0, 0, -64, 63])
    work = np.array([-7, 7, -9, 9], dtype=np.int64)
    finish(work, ReduceOp.AVG, 4)
    np.testing.assert_array_equal(work, [-1, 1, -2, 2])


def test_integer_avg_seed_example() -> None:
    # -7 averaged over 2 ranks: sum first (-3 + -4), then truncate toward zero.
    work = np.array([-3, 3], dtype=np.int32)
    reduce_into(work, np.array([-4, 4], dtype=np.int32), ReduceOp.AVG)
    finish(work, ReduceOp.AVG, 2)
    np.testing.assert_array_equal(work, [-3, 3])


def test_integer_avg_sum_wraps_before_division() -> None:
    # As NCCL: 100 + 100 wraps to -56 in int8, then -56 / 2 = -28.
    work = np.array([100], dtype=np.int8)
    reduce_into(work, np.array([100], dtype=np.int8), ReduceOp.AVG)
    finish(work, ReduceOp.AVG, 2)
    np.testing.assert_array_equal(work, [-28])


@pytest.mark.parametrize("dt", [np.int8, np.uint8, np.int16], ids=str)
@pytest.mark.parametrize("nranks", [127, 128, 200, 255, 256, 1000, 40000])
def test_integer_avg_nranks_beyond_dtype(dt: type, nranks: int) -> None:
    info = np.iinfo(dt)
    vals = [info.min, info.min + 1, -1 if info.min < 0 else 0, 0, 1, info.max]
    work = np.array(vals, dtype=dt)
    finish(work, ReduceOp.AVG, nranks)
    np.testing.assert_array_equal(work, np.array([_trunc(v, nranks) for v in vals], dtype=dt))


@pytest.mark.parametrize("dt", [np.float16, np.float32, np.float64, BF16], ids=str)
@pytest.mark.parametrize("nranks", [2, 3, 7, 257, 1000])
def test_float_avg_is_correctly_rounded(dt: type, nranks: int) -> None:
    rng = np.random.default_rng(nranks)
    work = (rng.standard_normal(500) * 50).astype(dt)
    expected = [float(v) / nranks for v in work.astype(np.float64)]  # float64: exact-enough
    finish(work, ReduceOp.AVG, nranks)
    np.testing.assert_array_equal(work, np.array(expected).astype(dt), strict=True)


def test_bfloat16_avg_does_not_round_nranks() -> None:
    # bfloat16(257) == 256; dividing in bfloat16 would give 1.0 here.
    work = np.array([257.0], dtype=BF16)  # rounds to 256
    finish(work, ReduceOp.AVG, 257)
    assert float(work[0]) == float(np.array(256.0 / 257, dtype=BF16)) != 1.0


@pytest.mark.parametrize("dt", [np.complex64, np.complex128], ids=str)
def test_complex_avg_divides_each_part(dt: type) -> None:
    vals = np.array([1 + 1j, 0.1 + 0.7j, complex(np.inf, 1), -3 - 9j], dtype=dt)
    work = vals.copy()
    finish(work, ReduceOp.AVG, 3)
    part = np.float32 if dt is np.complex64 else np.float64
    np.testing.assert_array_equal(work.real, (vals.real.astype(np.float64) / 3).astype(part))
    np.testing.assert_array_equal(work.imag, (vals.imag.astype(np.float64) / 3).astype(part))
    assert work[2].real == np.inf and work[2].imag == part(1 / 3)


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX])
def test_finish_only_changes_avg(op: ReduceOp) -> None:
    work = np.array([-7, 9], dtype=np.int32)
    finish(work, op, 4)
    np.testing.assert_array_equal(work, [-7, 9])


def test_finish_avg_one_rank_is_identity() -> None:
    work = np.array([-7, math.pi], dtype=np.float64)
    finish(work, "avg", 1)  # type: ignore[arg-type]
    np.testing.assert_array_equal(work, [-7, math.pi])


@pytest.mark.parametrize(
    ("nranks", "exc", "match"),
    [
        (0, ValueError, r"nranks=0 is invalid"),
        (-2, ValueError, r"nranks=-2 is invalid"),
        (1.5, TypeError, r"nranks=1\.5 must be an int"),
        (True, TypeError, r"nranks=True must be an int"),
        ("2", TypeError, r"nranks='2' must be an int"),
    ],
)
def test_finish_rejects_bad_nranks(nranks: object, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        finish(np.zeros(2, np.float32), ReduceOp.AVG, nranks)  # type: ignore[arg-type]


def test_finish_accepts_numpy_int_nranks() -> None:
    work = np.array([-7], dtype=np.int64)
    finish(work, ReduceOp.AVG, np.int64(2))  # type: ignore[arg-type]
    np.testing.assert_array_equal(work, [-3])


# --- ReduceOp.parse --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("sum", ReduceOp.SUM),
        ("SUM", ReduceOp.SUM),
        ("Avg", ReduceOp.AVG),
        ("pRoD", ReduceOp.PROD),
        ("min", ReduceOp.MIN),
        ("max", ReduceOp.MAX),
        (ReduceOp.MAX, ReduceOp.MAX),
    ],
)
def test_parse_accepts_names_and_members(given: str | ReduceOp, expected: ReduceOp) -> None:
    assert ReduceOp.parse(given) is expected


@pytest.mark.parametrize("bad", ["mean", "", " sum", "add", 1, None, np.add])
def test_parse_rejects_unknown_ops(bad: object) -> None:
    with pytest.raises(ValueError, match=r"is not a reduction") as info:
        ReduceOp.parse(bad)  # type: ignore[arg-type]
    assert f"op={bad!r}" in str(info.value)
    assert "'sum', 'prod', 'min', 'max', 'avg' or a pycoll.ReduceOp" in str(info.value)


def test_parse_message_exact() -> None:
    with pytest.raises(ValueError) as info:
        ReduceOp.parse("mean")
    assert str(info.value) == (
        "op='mean' is not a reduction; allowed: 'sum', 'prod', 'min', 'max', 'avg' "
        "or a pycoll.ReduceOp"
    )


def test_reduce_into_rejects_bad_op() -> None:
    with pytest.raises(ValueError, match=r"op='mean' is not a reduction"):
        reduce_into(np.zeros(2), np.zeros(2), "mean")  # type: ignore[arg-type]


# --- dtypes ----------------------------------------------------------------------------


def test_supported_dtypes_list() -> None:
    names = [d.name for d in SUPPORTED_DTYPES]
    assert names == [
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "bfloat16",
        "complex64",
        "complex128",
    ]
    assert all(isinstance(d, np.dtype) for d in SUPPORTED_DTYPES)


@pytest.mark.parametrize("dt", SUPPORTED_DTYPES, ids=str)
def test_check_dtype_accepts_supported(dt: np.dtype) -> None:
    assert check_dtype(dt) == dt
    assert check_dtype(dt.name) == dt
    assert check_dtype(dt.type) == dt


BAD_DTYPES = [
    (bool, r"dtype='bool' is not supported"),
    (np.bool_, r"dtype='bool' is not supported"),
    (object, r"dtype='object' is not supported"),
    (str, r"dtype='<U0' is not supported"),
    ("U5", r"dtype='<U5' is not supported"),
    (np.dtype(">i4"), r"dtype='>i4' is not supported"),
    ("notadtype", r"dtype='notadtype' is not a dtype"),
    (None, r"dtype=None is not supported"),
]
if hasattr(np, "float128"):
    BAD_DTYPES.append((np.float128, r"dtype='float128' is not supported"))
if hasattr(ml_dtypes, "float8_e4m3fn"):
    BAD_DTYPES.append((ml_dtypes.float8_e4m3fn, r"dtype='float8_e4m3fn' is not supported"))


@pytest.mark.parametrize(("dt", "match"), BAD_DTYPES, ids=lambda x: str(x))
def test_check_dtype_rejects(dt: object, match: str) -> None:
    with pytest.raises(TypeError, match=match) as info:
        check_dtype(dt)
    assert "allowed: int8, int16" in str(info.value) and "bfloat16" in str(info.value)


@pytest.mark.parametrize(
    "arr",
    [np.array([True, False]), np.array(["a", "b"]), np.array([1, "x"], dtype=object)],
    ids=["bool", "str", "object"],
)
def test_reduce_into_rejects_unsupported_arrays(arr: np.ndarray) -> None:
    with pytest.raises(TypeError, match=rf"dtype='{arr.dtype}' is not supported"):
        reduce_into(arr.copy(), arr, ReduceOp.SUM)


@pytest.mark.parametrize("dt", [np.complex64, np.complex128], ids=str)
@pytest.mark.parametrize("op", [ReduceOp.MIN, ReduceOp.MAX], ids=lambda o: o.value)
def test_min_max_on_complex_rejected(dt: type, op: ReduceOp) -> None:
    name = np.dtype(dt).name
    msg = rf"^op='{op.value}' is not defined for {name}; allowed for complex: 'sum', 'prod', 'avg'$"
    with pytest.raises(ValueError, match=msg):
        check_op_for_dtype(op, dt)
    a = np.zeros(2, dtype=dt)
    with pytest.raises(ValueError, match=msg):
        reduce_into(a, a.copy(), op)
    with pytest.raises(ValueError, match=msg):
        finish(a, op, 2)


@pytest.mark.parametrize("pair", VALID_PAIRS, ids=_ids)
def test_check_op_for_dtype_accepts_valid(pair: tuple[ReduceOp, np.dtype]) -> None:
    check_op_for_dtype(*pair)


def test_reduce_into_rejects_mismatched_buffers() -> None:
    with pytest.raises(TypeError, match=r"src\.dtype=int64 differs from dst\.dtype=int32"):
        reduce_into(np.zeros(3, np.int32), np.zeros(3, np.int64), ReduceOp.SUM)
    with pytest.raises(ValueError, match=r"src\.shape=\(4,\) differs from dst\.shape=\(3,\)"):
        reduce_into(np.zeros(3), np.zeros(4), ReduceOp.SUM)
    with pytest.raises(TypeError, match=r"dst must be a numpy\.ndarray, got list"):
        reduce_into([1, 2], np.zeros(2), ReduceOp.SUM)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"src must be a numpy\.ndarray, got list"):
        reduce_into(np.zeros(2), [1, 2], ReduceOp.SUM)  # type: ignore[arg-type]


def test_package_reexports() -> None:
    assert sorted(kernels.__all__) == sorted(
        [
            "ReduceOp",
            "SUPPORTED_DTYPES",
            "check_dtype",
            "check_op_for_dtype",
            "reduce_into",
            "reducer",
            "finish",
        ]
    )
    for name in kernels.__all__:
        assert getattr(kernels, name) is getattr(host, name)


@pytest.mark.parametrize("dt", [np.int16, np.float32, BF16, np.complex128], ids=str)
@pytest.mark.parametrize("shape", [(), (2, 3)], ids=["0d", "2d"])
def test_avg_any_shape(dt: type, shape: tuple[int, ...]) -> None:
    work = np.full(shape, -7, dtype=dt)
    reduce_into(work, np.full(shape, 0, dtype=dt), ReduceOp.AVG)
    finish(work, ReduceOp.AVG, 2)
    expected = -3 if np.dtype(dt).kind == "i" else -3.5
    np.testing.assert_array_equal(work, np.full(shape, expected, dtype=dt), strict=True)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_reducer_matches_reduce_into(dtype) -> None:
    ops = [ReduceOp.SUM, ReduceOp.PROD] if dtype.kind == "c" else list(ReduceOp)
    for op in ops:
        a = (np.arange(6) % 3 + 1).astype(dtype)
        b = (np.arange(6) % 2 + 1).astype(dtype)
        expected = a.copy()
        reduce_into(expected, b, op)
        kernels.reducer(op, dtype)(a, b)
        assert a.tobytes() == expected.tobytes()


@pytest.mark.parametrize("dt", [np.float16, np.float32, np.float64], ids=str)
def test_the_fast_reducer_overflows_to_inf_with_numpys_warning(dt: type) -> None:
    big = float(np.finfo(dt).max)
    a = np.array([big, 1.0], dtype=dt)
    with pytest.warns(RuntimeWarning, match="overflow"):
        kernels.reducer(ReduceOp.SUM, np.dtype(dt))(a, np.array([big, 2.0], dtype=dt))
    assert a[0] == np.inf and a[1] == 3.0


def test_the_fast_bfloat16_reducer_is_silent_on_nan() -> None:
    m = np.array([np.nan, 1.0], dtype=BF16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernels.reducer(ReduceOp.MIN, BF16)(m, np.array([1.0, np.nan], dtype=BF16))
    assert np.isnan(m.astype(np.float32)).all()


@pytest.mark.parametrize("dt", [np.complex64, np.complex128], ids=str)
@pytest.mark.parametrize("size", [1, 3])
def test_a_complex_product_overflows_to_inf_on_one_element_too(dt: type, size: int) -> None:
    """Complex prod on a one-element block (its own path) raised FloatingPointError under
    np.errstate(over="raise") where longer blocks gave inf: the ranks whose pieces had one
    element failed and the others were left waiting (PeerFailed; under MPI the job ended)."""
    big = float(np.finfo(dt).max) / 2
    for strict in (lambda: np.errstate(over="raise", invalid="raise"), warnings.catch_warnings):
        with strict():
            warnings.simplefilter("error")
            a = np.full(size, big + 0j, dtype=dt)
            kernels.reducer(ReduceOp.PROD, np.dtype(dt))(a, np.full(size, big + 0j, dtype=dt))
            assert np.isinf(a.real).all(), a

    def step() -> np.ndarray:
        with np.errstate(over="raise"):
            return pycoll.allreduce(np.full(size, big + 0j, dtype=dt), "prod")

    for result in pycoll.run_local(2, step):
        assert np.isinf(result.real).all(), result
