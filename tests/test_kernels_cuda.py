"""GPU kernels (pycoll.kernels: table, cuda_c, numba_cuda, device), checked with and without a GPU.

Without a GPU (CI): the dtype x op table; every CUDA C kernel compiled by nvcc for sm_90 and
sm_80, and by NVRTC with RawModule's options (through CuPy's binding, else cuda-bindings');
every Numba kernel compiled to PTX for sm_90; the Numba kernels run under the CUDA simulator
against numpy (tests/cudasim, in a subprocess, since NUMBA_ENABLE_CUDASIM must be set
before numba.cuda is imported). The slow compiles run as background processes started when
this module starts (only those whose tests were selected), overlapping the in-process tests.

With a GPU: both backends on CuPy arrays against the host reducer, the 16-byte vector and
scalar paths, misaligned slices, float semantics (subnormals under CuPy's -ftz, NaN),
streams and large sizes. They skip with the reason "no CUDA GPU" when there is none.

Without a GPU too, the same tests of kernel results run on "cuda_c-on-host": reduce.cu and
common.cuh compiled for the CPU with the host's C++ compiler (tests/cuda_c_host.h runs
each thread of a small grid in turn), driven by cuda_c's own launch code, and failing on
any 16-byte access that would be misaligned on the GPU.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import pycoll
from pycoll import kernels
from pycoll.kernels import cuda_c, device, host, table
from pycoll.kernels.host import ReduceOp

ROOT = Path(__file__).resolve().parents[1]
KERNEL_DIR = Path(kernels.__file__).resolve().parent
SIM_SUITE = Path(__file__).resolve().parent / "cudasim" / "sim_numba_kernels.py"
ARCHS = ["sm_90", "sm_80"]
# NVRTC checks the target device's arch only: nvcc covers both, and each extra compile costs
# about 12 s on the 2-core CI machine, which runs these jobs side by side.
NVRTC_ARCHS = ["sm_90"]
BF16 = np.dtype(ml_dtypes.bfloat16)
GPU_DTYPES = [row.dtype for row in table.GPU_DTYPES]
OPS = ["sum", "prod", "min", "max", "avg"]
JOB_TIMEOUT = 600


def _ids(value: object) -> str:
    return value.name if isinstance(value, np.dtype) else str(value)


def _have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found is None and Path("/usr/local/cuda/bin/nvcc").exists():
        found = "/usr/local/cuda/bin/nvcc"
    return found


HAVE_CUPY = _have("cupy")
HAVE_NUMBA_CUDA = _have("numba_cuda")
# NVRTC: through CuPy, else cuda-bindings (installed by numba-cuda[cu13] with the NVRTC wheel)
HAVE_NVRTC = HAVE_CUPY or _have("cuda.bindings.nvrtc")
NVCC = _nvcc()


def _gpu_count() -> int:
    if HAVE_CUPY:
        try:
            import cupy

            return int(cupy.cuda.runtime.getDeviceCount())
        except Exception:  # no driver, no device: CuPy raises CUDARuntimeError
            return 0
    if HAVE_NUMBA_CUDA and not os.environ.get("NUMBA_ENABLE_CUDASIM"):
        from numba import cuda

        return len(cuda.gpus) if cuda.is_available() else 0
    return 0


HAVE_GPU = _gpu_count() > 0
needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="no CUDA GPU")


# ---------------------------------------------------------------- background jobs


def nvcc_unit() -> str:
    """A translation unit instantiating every kernel x dtype x op of the table."""
    lines = ['#include "reduce.cu"', ""]
    for row in table.GPU_DTYPES:  # the table's C types must have numpy's sizes
        lines.append(f'static_assert(sizeof({row.ctype}) == {row.dtype.itemsize}, "{row.name}");')
    nbytes = 8 * table.MAX_SOURCES  # the host packs this many bytes of pointers
    lines.append(f'static_assert(sizeof(pycoll::Sources<float>) == {nbytes}, "Sources");')
    lines.append("")
    lines.extend(table.instantiation(k, dt, op) for k, dt, op in table.instances())
    return "\n".join(lines) + "\n"


HOST_CXX = shutil.which("g++") or shutil.which("c++")
HOST_HEADER = Path(__file__).resolve().parent / "cuda_c_host.h"
HOST_BACKEND = "cuda_c-on-host"


def _host_include_dir() -> str | None:
    """A CUDA toolkit's headers for a host compiler (the pip wheels' lack crt/, which NVRTC
    builds in)."""
    homes = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    if NVCC is not None:
        homes.insert(2, str(Path(NVCC).resolve().parent.parent))
    for home in homes:
        if home and (Path(home) / "include" / "crt" / "host_defines.h").exists():
            return str(Path(home) / "include")
    return None


HAVE_HOST_BUILD = HOST_CXX is not None and _host_include_dir() is not None


def host_unit() -> tuple[str, dict[str, str]]:
    """The host build of every instance (tests/cuda_c_host.h), and {name expression: symbol}."""
    lines = ['#include "cuda_c_host.h"', ""]
    symbols: dict[str, str] = {}
    for i, (kernel, dt, op) in enumerate(table.instances()):
        name = table.name_expression(kernel, dt, op)
        symbols[name] = f"pycoll_host_{i}"
        adapter = "host_" + name.removeprefix("pycoll::")
        lines.append(f'extern "C" void pycoll_host_{i}(PYCOLL_HOST_ARGS) {{ '
                     f"{adapter}(g, b, p, k, n, r); }}")
    return "\n".join(lines) + "\n", symbols


_NVRTC_SCRIPT = """\
import json, sys
from pycoll.kernels import cuda_c
cubin, lowered, binding = cuda_c.nvrtc_compile(sys.argv[1])
missing = [name for name, low in lowered.items() if low.encode() not in cubin]
elf = cubin[:4] == b"\\x7fELF"
print(json.dumps({"elf": elf, "lowered": lowered, "missing": missing, "binding": binding}))
"""


def _job_commands(tmp: Path) -> dict[str, list[str]]:
    """Every background job: name -> argv (run in tmp)."""
    jobs: dict[str, list[str]] = {}
    if NVCC is not None:
        (tmp / "all.cu").write_text(nvcc_unit())
        for arch in ARCHS:
            jobs[f"nvcc_{arch}"] = [
                NVCC,
                "-std=c++17",
                f"-arch={arch}",
                "-ftz=true",  # as CuPy compiles; the PTX check below relies on it
                "--Werror",
                "all-warnings",
                f"-I{KERNEL_DIR}",
                "--keep",
                "--keep-dir",
                str(tmp / arch),
                "-c",
                str(tmp / "all.cu"),
                "-o",
                str(tmp / f"all_{arch}.o"),
            ]
            (tmp / arch).mkdir(exist_ok=True)
    if HAVE_HOST_BUILD:
        (tmp / "host.cpp").write_text(host_unit()[0])
        # -O1 keeps the 216 instances' build short; no strict aliasing: the kernels read
        # element arrays through uint4 pointers, as CUDA does.
        jobs["host"] = [HOST_CXX, "-std=c++17", "-O1", "-fno-strict-aliasing", "-fPIC",
                        "-shared", f"-I{HOST_HEADER.parent}", f"-I{KERNEL_DIR}",
                        f"-I{_host_include_dir()}", str(tmp / "host.cpp"),
                        "-o", str(tmp / "host.so")]
    if HAVE_NVRTC:
        for arch in NVRTC_ARCHS:
            jobs[f"nvrtc_{arch}"] = [sys.executable, "-c", _NVRTC_SCRIPT, arch]
    if HAVE_NUMBA_CUDA:
        jobs["simulator"] = [
            sys.executable,
            "-m",
            "pytest",
            str(SIM_SUITE),
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            f"--junitxml={tmp / 'sim.xml'}",
        ]
    return jobs


def _jobs_for(item: pytest.Item) -> list[str]:
    name = getattr(item, "originalname", item.name)
    params = getattr(getattr(item, "callspec", None), "params", {})
    if name in ("test_nvcc_compiles_every_kernel", "test_nvcc_ptx_is_free_of_ftz"):
        return [f"nvcc_{params.get('arch', 'sm_90')}"]
    if name == "test_nvrtc_compiles_every_kernel":
        return [f"nvrtc_{params['arch']}"]
    if name == "test_numba_simulator_suite":
        return ["simulator"]
    if params.get("gpu") == HOST_BACKEND:
        return ["host"]
    return []


class Jobs:
    """Subprocesses started together; each test waits for the one it checks."""

    def __init__(self, tmp: Path, wanted: set[str]) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen] = {}
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for name, argv in _job_commands(tmp).items():
            if name not in wanted:
                continue
            job_env = dict(env)
            if name == "simulator":
                job_env["NUMBA_ENABLE_CUDASIM"] = "1"
            with open(tmp / f"{name}.log", "w") as out:  # the child keeps its own copy
                self.procs[name] = subprocess.Popen(
                    argv, cwd=ROOT, env=job_env, stdout=out, stderr=subprocess.STDOUT
                )

    def result(self, name: str) -> tuple[int, str]:
        proc = self.procs.get(name)
        if proc is None:
            pytest.fail(f"background job {name} was not started")
        rc = proc.wait(timeout=JOB_TIMEOUT)
        return rc, (self.tmp / f"{name}.log").read_text()

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module", autouse=True)
def jobs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Jobs]:
    here = Path(__file__).resolve()
    wanted = {
        job
        for item in request.session.items
        if Path(item.path).resolve() == here
        for job in _jobs_for(item)
    }
    started = Jobs(tmp_path_factory.mktemp("kernels_cuda"), wanted)
    yield started
    started.close()


# ---------------------------------------------------------------- the table


def test_table_covers_every_host_dtype_but_complex():
    host_real = [dt for dt in host.SUPPORTED_DTYPES if dt.kind != "c"]
    assert sorted(GPU_DTYPES, key=str) == sorted(host_real, key=str)
    for row in table.GPU_DTYPES:
        assert set(row.ops) == {ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX}


def test_table_generates_every_instance_once():
    names = table.all_name_expressions()
    per_dtype = sum(len(table.GPU_DTYPES[0].ops) if k.has_op else 1 for k in table.KERNELS)
    assert len(names) == len(set(names)) == len(GPU_DTYPES) * per_dtype
    assert table.name_expression("reduce_pair", np.float32, ReduceOp.SUM) == (
        "pycoll::reduce_pair<float, pycoll::Sum>"
    )
    # avg combines as sum: the same instance
    assert table.name_expression("reduce_n", BF16, "avg") == table.name_expression(
        "reduce_n", BF16, "sum"
    )
    assert table.instantiation("copy", np.uint8) == (
        "template __global__ void pycoll::copy<unsigned char>"
        "(unsigned char*, const unsigned char*, long long);"
    )


@pytest.mark.parametrize("bad", [np.complex64, np.complex128, np.bool_, "U3", None, "nope"])
def test_table_rejects_dtypes_without_kernels(bad):
    with pytest.raises(TypeError, match="allowed: float16, bfloat16"):
        table.gpu_dtype(bad)


def test_table_argument_errors():
    with pytest.raises(ValueError, match="kernel='nope' is unknown"):
        table.name_expression("nope", np.float32, ReduceOp.SUM)
    with pytest.raises(ValueError, match="needs an op"):
        table.name_expression("reduce_inplace", np.float32)
    with pytest.raises(ValueError, match="nranks=0"):
        table.check_nranks(0)
    with pytest.raises(TypeError, match="nranks=True"):
        table.check_nranks(True)
    with pytest.raises(ValueError, match=r"2\*\*63"):
        table.check_nranks(2**63)
    with pytest.raises(TypeError, match="work must be an array"):
        table.row_of([1.0], "work")


# ---------------------------------------------------------------- backend selection


def test_backend_selection(monkeypatch):
    monkeypatch.delenv("PYCOLL_KERNELS", raising=False)
    assert device.kernel_backend() == "cupy"  # the default until measured on a GPU
    monkeypatch.setenv("PYCOLL_KERNELS", "numba")
    assert device.kernel_backend() == "numba"
    assert device.kernel_backend("CuPy") == "cupy"
    monkeypatch.setenv("PYCOLL_KERNELS", "triton")
    with pytest.raises(ValueError, match="PYCOLL_KERNELS='triton'.*allowed: cupy, numba"):
        device.kernel_backend()


def test_import_pycoll_loads_no_cuda_package():
    code = (
        "import sys, pycoll, pycoll.kernels\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('cupy', 'numba', 'cuda'))\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert pycoll.kernels is kernels


def test_source_inlines_the_header():
    from pycoll.kernels import cuda_c

    text = cuda_c.source()
    assert '#include "common.cuh"' not in text
    assert "struct Num<__nv_bfloat16>" in text and "__global__ void reduce_copy" in text


def test_cuda_c_rejects_bad_arguments_without_a_gpu():
    from pycoll.kernels.cuda_c import CudaCKernels

    k = CudaCKernels()
    with pytest.raises(TypeError, match="complex64"):
        k.reducer("sum", np.complex64)
    with pytest.raises(ValueError, match="op='mean'"):
        k.reducer("mean", np.float32)
    with pytest.raises(TypeError, match="dst must be a cupy.ndarray, got ndarray"):  # no GPU used
        k.reducer("min", np.float32)(np.zeros(3, np.float32), np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="nranks=0"):
        k.finish(np.zeros(3, np.float32), "avg", 0)
    with pytest.raises(ValueError, match="threads=0"):
        CudaCKernels(threads=0)


# ---------------------------------------------------------------- nvcc


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch", ARCHS)
def test_nvcc_compiles_every_kernel(jobs, arch):
    rc, log = jobs.result(f"nvcc_{arch}")
    assert rc == 0, log
    assert (jobs.tmp / f"all_{arch}.o").stat().st_size > 0


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_nvcc_ptx_is_free_of_ftz(jobs):
    # Built with CuPy's -ftz=true: no instruction may flush subnormals, min/max must
    # propagate NaN, and every instance must be a kernel entry.
    rc, log = jobs.result("nvcc_sm_90")
    assert rc == 0, log
    ptx = "\n".join(p.read_text() for p in (jobs.tmp / "sm_90").glob("*.ptx"))
    assert ".ftz" not in ptx
    assert "min.NaN.f32" in ptx and "max.NaN.f32" in ptx
    assert len(re.findall(r"\.entry\s+_ZN6pycoll", ptx)) == len(table.all_name_expressions())


# ---------------------------------------------------------------- NVRTC (CuPy)


@pytest.mark.skipif(not HAVE_NVRTC, reason="NVRTC not installed (neither CuPy nor cuda-bindings)")
@pytest.mark.parametrize("arch", NVRTC_ARCHS)
def test_nvrtc_compiles_every_kernel(jobs, arch):
    rc, log = jobs.result(f"nvrtc_{arch}")
    assert rc == 0, log
    out = json.loads(log.strip().splitlines()[-1])
    assert out["binding"] == ("cupy" if HAVE_CUPY else "cuda-bindings")
    assert out["elf"]
    assert sorted(out["lowered"]) == sorted(table.all_name_expressions())
    assert out["missing"] == []  # every lowered name is a symbol of the cubin


# ---------------------------------------------------------------- Numba


@pytest.mark.skipif(not HAVE_NUMBA_CUDA, reason="numba-cuda not installed")
@pytest.mark.parametrize("dt", GPU_DTYPES, ids=_ids)
def test_numba_kernels_compile_to_ptx_for_sm90(dt):
    if os.environ.get("NUMBA_ENABLE_CUDASIM"):
        pytest.skip(
            "NUMBA_ENABLE_CUDASIM is set in this process: compile_ptx needs the real target"
        )
    from numba import cuda

    from pycoll.kernels import numba_cuda

    for kernel, _, op in table.instances(dt):
        nsrc = 3 if kernel == "reduce_n" else 2
        fn = numba_cuda.python_kernel(kernel, dt, op)
        ptx, _ = cuda.compile_ptx(fn, numba_cuda.signature(kernel, dt, nsrc), cc=(9, 0))
        where = f"{kernel} {dt.name} {op}"
        assert ".target sm_90" in ptx, where
        # Self-contained: no calls (numba-cuda's fp16/bf16 operators would be shim calls).
        assert not re.search(r"^\s*call", ptx, re.M), where
        assert ".ftz" not in ptx, where
        if dt.kind in "iu":  # integer kernels stay in integers (no signed/unsigned mixing)
            assert not re.search(r"\.f(32|64)\b", ptx), where


@pytest.mark.skipif(not HAVE_NUMBA_CUDA, reason="numba-cuda not installed")
def test_numba_kernels_say_when_numba_cuda_cannot_load_under_this_numpy(monkeypatch):
    if os.environ.get("NUMBA_ENABLE_CUDASIM"):
        pytest.skip("NUMBA_ENABLE_CUDASIM is set in this process: the check is not made there")
    from pycoll.kernels import numba_cuda

    def numpy_2_5():  # what numba-cuda 0.30 does under numpy 2.5
        raise AttributeError("module 'numpy' has no attribute 'row_stack'")

    monkeypatch.setattr(numba_cuda, "_load_numpy_support", numpy_2_5)
    numba_cuda.check_numba_cuda_loads.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"numba-cuda#907\); allowed: PYCOLL_KERNELS=cupy"):
            numba_cuda.NumbaKernels()
    finally:
        numba_cuda.check_numba_cuda_loads.cache_clear()
    monkeypatch.undo()
    numba_cuda.check_numba_cuda_loads()  # here it loads


@pytest.mark.skipif(not HAVE_NUMBA_CUDA, reason="numba-cuda not installed")
def test_numba_kernels_name_an_older_numba_cuda(monkeypatch):
    """A GPU machine's own, older numba-cuda lacks numba.cuda.np.arrayobj: the error names the
    version found and what is allowed, not a bare ImportError at the first kernel."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM"):
        pytest.skip("NUMBA_ENABLE_CUDASIM is set in this process: the check is not made there")
    from pycoll.kernels import numba_cuda

    def older():
        raise ModuleNotFoundError("No module named 'numba.cuda.np.arrayobj'")

    monkeypatch.setattr(numba_cuda, "_load_numpy_support", older)
    numba_cuda.check_numba_cuda_loads.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"\(numba-cuda >= 0\.30\), which failed to "
                                               r"import from numba-cuda [0-9.]+ \(No module"):
            numba_cuda.NumbaKernels()
    finally:
        numba_cuda.check_numba_cuda_loads.cache_clear()


@pytest.mark.skipif(not HAVE_NUMBA_CUDA, reason="numba-cuda not installed")
def test_numba_grid_fills_every_sm_of_an_h200(monkeypatch):
    if os.environ.get("NUMBA_ENABLE_CUDASIM"):
        pytest.skip("NUMBA_ENABLE_CUDASIM is set in this process: tests/cudasim checks its grid")
    import types

    from numba import cuda

    from pycoll.kernels import numba_cuda

    h200 = types.SimpleNamespace(MULTIPROCESSOR_COUNT=132)
    monkeypatch.setattr(cuda, "get_current_device", lambda: h200)
    kernels = numba_cuda.NumbaKernels(threads=256)
    assert kernels._grid(1 << 28) == numba_cuda.BLOCKS_PER_SM * 132 == 4224
    assert kernels._grid(256 * 1000 + 1) == 1001  # one pass, when that takes fewer blocks
    assert kernels._grid(1) == 1
    assert numba_cuda.NumbaKernels(threads=256, max_blocks=8)._grid(1 << 28) == 8


@pytest.mark.skipif(not HAVE_NUMBA_CUDA, reason="numba-cuda not installed")
def test_numba_simulator_suite(jobs):
    rc, log = jobs.result("simulator")
    suite = ET.parse(jobs.tmp / "sim.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    assert rc == 0, log
    assert counts["failures"] == counts["errors"] == counts["skipped"] == 0, (counts, log)
    # every kernel x op x dtype at 5 sizes, plus the rest (the suite checks its own total)
    assert counts["tests"] > len(GPU_DTYPES) * len(OPS) * 5, counts


# ---------------------------------------------------------------- on a GPU

BACKENDS = ["cupy", "numba"]


def _exact(dt: np.dtype, op: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, n, GPU_DTYPES.index(dt)])
    if op == "prod":
        v = rng.choice([1, 2] if dt.kind == "u" else [-1, 1, 2], size=n)
        v[rng.random(n) < 0.9] = 1  # keep long products in range
    elif dt.kind == "u":
        v = rng.integers(0, 4, n)
    else:
        v = rng.integers(-3, 4, n)
    return v.astype(np.float64).astype(dt)


def _host(op: str, dt: np.dtype, arrays: list[np.ndarray], nranks: int = 1) -> np.ndarray:
    out = arrays[0].copy()
    with np.errstate(all="ignore"):
        for a in arrays[1:]:
            host.reducer(ReduceOp.parse(op), dt)(out, a)
    host.finish(out, ReduceOp.parse(op), nranks)
    return out


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    if got.dtype.kind == "f" or got.dtype == BF16:
        g, w = got.astype(np.float64), want.astype(np.float64)
        return bool(np.array_equal(g, w, equal_nan=True))
    return bool(np.array_equal(got, want))


class HostCudaCKernels(cuda_c.CudaCKernels):
    """cuda_c's reducer interface on numpy arrays, launching the host build of the same
    kernels (tests/cuda_c_host.h): cuda_c's own argument checks, grid sizing and reduce_n
    chaining, on a grid small enough to take many grid-stride turns."""

    def __init__(self, lib: ctypes.CDLL, symbols: dict[str, str], threads: int, sms: int):
        super().__init__(threads=threads, blocks_per_sm=1)
        self._lib, self._symbols, self._sm_total = lib, symbols, sms

    def _sms(self) -> int:
        return self._sm_total

    def _check_type(self, x, name: str) -> None:
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name} must be a numpy.ndarray here, got {type(x).__name__}")

    @staticmethod
    def _ptr(x) -> int:
        return int(x.ctypes.data) if x.size else 0  # as CuPy: an empty array has no memory

    def _run(self, kernel, dtype, op, blocks, args) -> None:
        pointers: list[int] = []
        numbers: list[int] = []
        for arg in args:
            if isinstance(arg, np.ndarray) and arg.dtype == cuda_c._SOURCES_DTYPE:
                pointers.extend(int(v) for v in arg["ptr"][0])
            elif isinstance(arg, np.ndarray):
                pointers.append(self._ptr(arg))
            else:
                numbers.append(int(arg))
        if kernel == "reduce_n":  # (dst, sources, k, n)
            (k, n), r = numbers, 0
        elif kernel == "divide":  # (x, n, nranks)
            k, (n, r) = 0, numbers
        else:
            k, (n,), r = 0, numbers, 0
        fn = getattr(self._lib, self._symbols[table.name_expression(kernel, dtype, op)])
        fn(ctypes.c_uint(blocks), ctypes.c_uint(self._threads),
           (ctypes.c_void_p * len(pointers))(*pointers), ctypes.c_int(k),
           ctypes.c_longlong(n), ctypes.c_longlong(r))

    def misaligned(self) -> int:
        return int(self._lib.pycoll_host_misaligned_count())


class _NumpyAsDevice:
    """What the GPU tests call on cupy, for numpy arrays (asarray copies, as to a device)."""

    asnumpy = staticmethod(np.asarray)
    zeros = staticmethod(np.zeros)
    zeros_like = staticmethod(np.zeros_like)

    @staticmethod
    def asarray(x):
        return np.array(x, copy=True)


@pytest.fixture(scope="module")
def host_build(jobs):
    rc, log = jobs.result("host")
    assert rc == 0, log
    lib = ctypes.CDLL(str(jobs.tmp / "host.so"))
    lib.pycoll_host_misaligned_count.restype = ctypes.c_longlong
    return lib, host_unit()[1]


@pytest.fixture(params=[*BACKENDS, HOST_BACKEND])
def gpu(request):
    """(cupy-like module, kernels, backend): the GPU backends, and the CUDA C kernels built
    for the CPU (no GPU needed: CI runs that one)."""
    if request.param == HOST_BACKEND:
        if not HAVE_HOST_BUILD:
            pytest.skip("no C++ compiler or CUDA headers for the host build")
        lib, symbols = request.getfixturevalue("host_build")
        kernels = HostCudaCKernels(lib, symbols, threads=32, sms=2)
        before = kernels.misaligned()
        yield _NumpyAsDevice, kernels, request.param
        assert kernels.misaligned() == before, "a 16-byte access the GPU would fault on"
        return
    if not HAVE_GPU:
        pytest.skip("no CUDA GPU")
    if not HAVE_CUPY:
        pytest.skip("CuPy not installed")
    if request.param == "numba" and not HAVE_NUMBA_CUDA:
        pytest.skip("numba-cuda not installed")
    import cupy

    yield cupy, device.gpu_kernels(backend=request.param), request.param


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dt", GPU_DTYPES, ids=_ids)
def test_gpu_every_kernel_matches_host(gpu, dt, op):
    cp, k, _ = gpu
    for n in (0, 1, 7, 33, 100, 4099, (1 << 20) + 5):
        a, b, c = (_exact(dt, op, n, s) for s in (1, 2, 3))
        da, db, dc = (cp.asarray(x) for x in (a, b, c))
        want = _host(op, dt, [a, b])

        got = da.copy()
        k.reducer(op, dt)(got, db)
        assert _same(cp.asnumpy(got), want), n
        got = cp.zeros_like(da)
        k.reducer(op, dt)(got, db, first=da)
        assert _same(cp.asnumpy(got), want), n

        dst, peer = cp.zeros_like(da), cp.zeros_like(da)
        k.reduce_copy(dst, peer, da, db, op)
        assert _same(cp.asnumpy(dst), want) and _same(cp.asnumpy(peer), want), n

        many = [a, b, c] * 6 + [a]  # 19 sources: more than one launch's 16
        for srcs in ([a], [a, b, c], many):
            got = cp.zeros_like(da)
            k.reduce_n(got, [cp.asarray(s) for s in srcs], op)
            assert _same(cp.asnumpy(got), _host(op, dt, srcs)), (n, len(srcs))

        got = cp.asarray(_host(op, dt, [a, b, c]))
        k.finish(got, op, 3)
        assert _same(cp.asnumpy(got), _host(op, dt, [a, b, c], nranks=3)), n

        got = cp.zeros_like(da)
        k.copy(got, dc)
        assert _same(cp.asnumpy(got), c), n

        dst, peer = cp.zeros_like(da), cp.zeros_like(da)
        k.copy_pair(dst, peer, dc)
        assert _same(cp.asnumpy(dst), c) and _same(cp.asnumpy(peer), c), n


@pytest.mark.parametrize("dt", GPU_DTYPES, ids=_ids)
def test_gpu_vector_head_tail_and_scalar_paths(gpu, dt):
    # Slices at every element offset in a 16-byte window: equal offsets take the scalar
    # head + vector body + tail; unequal offsets take the all-scalar path.
    cp, k, _ = gpu
    lanes = 16 // dt.itemsize
    n = 5 * lanes + 3
    base_a = _exact(dt, "sum", n + 2 * lanes, 1)
    base_b = _exact(dt, "sum", n + 2 * lanes, 2)
    da, db = cp.asarray(base_a), cp.asarray(base_b)
    for oa in range(lanes + 1):
        for ob in (oa, (oa + 1) % (lanes + 1)):
            for size in (n, lanes - 1, 1):
                dst = cp.zeros(n + 2 * lanes, dtype=dt)
                sa, sb = slice(oa, oa + size), slice(ob, ob + size)
                k.reducer("sum", dt)(dst[sa], db[sb], first=da[sa])
                want = _host("sum", dt, [base_a[sa], base_b[sb]])
                assert _same(cp.asnumpy(dst[sa]), want), (oa, ob, size)
                assert not cp.asnumpy(dst[:oa]).any(), "wrote before the slice"
                assert not cp.asnumpy(dst[oa + size :]).any(), "wrote past the slice"
                # copy_pair and reduce_copy: into WORK (sa) and a peer's slot at the other
                # offset (sb), so that the peer alone can take the all-scalar path
                dst, peer = (cp.zeros(n + 2 * lanes, dtype=dt) for _ in range(2))
                k.copy_pair(dst[sa], peer[sb], db[sa])
                assert _same(cp.asnumpy(dst[sa]), base_b[sa]), (oa, ob, size)
                assert _same(cp.asnumpy(peer[sb]), base_b[sa]), (oa, ob, size)
                for out, at in ((dst, oa), (peer, ob)):
                    assert not cp.asnumpy(out[:at]).any(), "wrote before the slice"
                    assert not cp.asnumpy(out[at + size :]).any(), "wrote past the slice"
                dst, peer = (cp.zeros(n + 2 * lanes, dtype=dt) for _ in range(2))
                k.reduce_copy(dst[sa], peer[sb], da[sa], db[sa], "sum")
                want = _host("sum", dt, [base_a[sa], base_b[sa]])
                assert _same(cp.asnumpy(dst[sa]), want) and _same(cp.asnumpy(peer[sb]), want)


def test_gpu_float_semantics(gpu):
    # Subnormals survive (CuPy compiles with -ftz=true), NaN propagates through min/max,
    # and non-integer data round exactly as on the host.
    cp, k, _ = gpu
    tiny = np.array([1e-45, -1e-45, 1e-40, 2e-39], dtype=np.float32)
    got = cp.asarray(tiny)
    k.reducer("sum", np.float32)(got, cp.asarray(tiny))
    assert _same(cp.asnumpy(got), tiny + tiny)
    got = cp.asarray(tiny)
    k.reducer("min", np.float32)(got, cp.asarray(tiny[::-1].copy()))
    assert _same(cp.asnumpy(got), np.minimum(tiny, tiny[::-1]))
    got = cp.asarray(tiny)
    k.finish(got, "avg", 2)
    assert _same(cp.asnumpy(got), _host("avg", np.dtype(np.float32), [tiny], 2))
    bf_tiny = np.array([1e-39, -3e-39, 1e-38], dtype=BF16)
    got = cp.asarray(bf_tiny)
    k.reducer("max", BF16)(got, cp.asarray(bf_tiny[::-1].copy()))
    assert _same(cp.asnumpy(got), _host("max", BF16, [bf_tiny, bf_tiny[::-1].copy()]))

    for dt in (np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)):
        a = np.array([np.nan, 1, np.nan, -np.inf, 2], dtype=np.float64).astype(dt)
        b = np.array([1, np.nan, np.nan, 3, np.inf], dtype=np.float64).astype(dt)
        for op in ("min", "max"):
            got = cp.asarray(a)
            k.reducer(op, dt)(got, cp.asarray(b))
            assert _same(cp.asnumpy(got), _host(op, dt, [a, b])), (dt, op)
        rng = np.random.default_rng(7)
        x = rng.standard_normal(10_001).astype(dt)
        y = rng.standard_normal(10_001).astype(dt)
        for op in ("sum", "prod", "avg"):
            got = cp.asarray(x)
            k.reducer(op, dt)(got, cp.asarray(y))
            k.finish(got, op, 7)
            assert _same(cp.asnumpy(got), _host(op, dt, [x, y], 7)), (dt, op)


@pytest.mark.parametrize("dt", [dt for dt in GPU_DTYPES if dt.kind in "iu"], ids=_ids)
def test_gpu_integer_avg_truncates_and_sums_wrap(gpu, dt):
    cp, k, _ = gpu
    info = np.iinfo(dt)
    base = (info.min, info.min + 1, -8, -7, -1, 0, 1, 7, 8, info.max)
    vals = np.array([v for v in base if info.min <= v <= info.max], dtype=dt)
    beyond = [int(info.max), int(info.max) + 1, -int(info.min)]  # 0 or -1 (min / -min)
    for d in [2, 3, 7] + [d for d in beyond if 1 <= d < 2**63]:
        got = cp.asarray(vals)
        k.finish(got, "avg", d)
        assert _same(cp.asnumpy(got), _host("avg", dt, [vals], d)), d
    for op in ("sum", "prod"):
        got = cp.asarray(vals)
        k.reducer(op, dt)(got, cp.asarray(vals[::-1].copy()))
        assert _same(cp.asnumpy(got), _host(op, dt, [vals, vals[::-1].copy()])), op


@needs_gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_given_stream_and_large_sizes(backend):
    cp = pytest.importorskip("cupy")
    stream = cp.cuda.Stream(non_blocking=True)
    k = device.gpu_kernels(stream=stream, backend=backend)
    n = (1 << 26) + 3
    rng = np.random.default_rng(0)
    a = rng.integers(-3, 4, n).astype(np.float32)
    b = rng.integers(-3, 4, n).astype(np.float32)
    with stream:
        da, db = cp.asarray(a), cp.asarray(b)
    k.reducer("sum", np.float32)(da, db)
    k.finish(da, "avg", 2)
    stream.synchronize()
    assert _same(cp.asnumpy(da), _host("avg", np.dtype(np.float32), [a, b], 2))


@needs_gpu
def test_gpu_reduce_n_refuses_dst_among_later_sources_when_chained():
    if not HAVE_CUPY:
        pytest.skip("CuPy not installed")
    import cupy as cp

    from pycoll.kernels.cuda_c import CudaCKernels

    srcs = [cp.ones(8, np.float32) for _ in range(20)]
    with pytest.raises(ValueError, match="dst is one of sources"):
        CudaCKernels().reduce_n(srcs[5], srcs, "sum")


@needs_gpu
def test_gpu_every_cupy_module_builds():
    if not HAVE_CUPY:
        pytest.skip("CuPy not installed")
    from pycoll.kernels import cuda_c

    for dt in GPU_DTYPES:
        mod = cuda_c.module(dt)
        for name in table.all_name_expressions(dt):
            assert mod.get_function(name) is not None, name
