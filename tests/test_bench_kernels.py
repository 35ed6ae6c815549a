"""`pycoll bench kernels` without a GPU: the L2 buffer rotation, the spin kernel's source,
error rows, and rows streamed as they are measured. The measuring itself needs a GPU
(tests/test_bench.py and bench/gpu_check.sh run it there)."""

from __future__ import annotations

import itertools
import json
import math
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pycoll import bench_kernels
from pycoll.bench_kernels import KernelRow, buffer_sets
from pycoll.cli import main

MiB = 1 << 20
H200_L2 = 50 * MiB  # about what an H200 reports as l2CacheSize
BENCH_SIZES = [MiB << (2 * i) for i in range(6)]  # gpu_check.sh's -b 1M -e 1G -f 4
REAL_SPIN = bench_kernels._Spin


# ---------------------------------------------------------------- L2 rotation


@pytest.mark.parametrize("size", BENCH_SIZES)
def test_rotated_sets_exceed_twice_the_l2_or_one_set_does(size):
    call = 2 * size  # the copy's footprint, by which _measure sizes the rotation
    count = buffer_sets(call, H200_L2)
    assert count * call > 2 * H200_L2
    assert count == 1 or (count - 1) * call <= 2 * H200_L2  # the fewest that do
    # the memory held stays within about 5 L2s plus one set
    held = count * bench_kernels.BUFFERS_PER_SET * size
    assert held <= bench_kernels.BUFFERS_PER_SET * (H200_L2 + size)


def test_rotation_at_the_bench_sizes():
    counts = {size: buffer_sets(2 * size, H200_L2) for size in BENCH_SIZES}
    assert counts == {MiB: 51, 4 * MiB: 13, 16 * MiB: 4, 64 * MiB: 1, 256 * MiB: 1,
                      1024 * MiB: 1}


def test_rotation_is_capped_at_tiny_sizes():
    assert buffer_sets(8, H200_L2) == bench_kernels.MAX_BUFFER_SETS
    assert buffer_sets(8, H200_L2, max_sets=3) == 3
    assert buffer_sets(1, 0) == 1  # no L2: nothing to rotate


def test_rotation_refuses_bad_arguments():
    with pytest.raises(ValueError, match="call_bytes=0"):
        buffer_sets(0, H200_L2)
    with pytest.raises(ValueError, match="max_sets=0"):
        buffer_sets(8, H200_L2, max_sets=0)


# ---------------------------------------------------------------- the spin kernel


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found is None and Path("/usr/local/cuda/bin/nvcc").exists():
        found = "/usr/local/cuda/bin/nvcc"
    return found


def _spin_loop_is_kept(ptx: str) -> None:
    assert ".entry pycoll_spin" in ptx
    # clock64 read before and inside the loop, and a branch back: the wait was not elided
    assert ptx.count("%clock64") >= 2
    assert "bra" in ptx


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not installed")
def test_spin_kernel_compiles_for_sm90_with_nvcc(tmp_path):
    (tmp_path / "spin.cu").write_text(bench_kernels.SPIN_SOURCE)
    done = subprocess.run(
        [_nvcc(), "-arch=sm_90", "--Werror", "all-warnings", "-ptx", "-o", "spin.ptx",
         "spin.cu"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    ptx = (tmp_path / "spin.ptx").read_text()
    assert ".target sm_90" in ptx
    _spin_loop_is_kept(ptx)


def _nvrtc_ptx(source: str, arch: str) -> str:
    """PTX from NVRTC: CuPy's binding where CuPy is installed, else cuda-bindings' (which
    numba-cuda[cu13] brings, as the kernels' own NVRTC test uses)."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError:
        from cuda.bindings import nvrtc as bindings

        def check(result):
            err, *rest = result
            assert err == bindings.nvrtcResult.NVRTC_SUCCESS, err
            return rest[0] if rest else None

        prog = check(bindings.nvrtcCreateProgram(source.encode(), b"spin.cu", 0, [], []))
        try:
            check(bindings.nvrtcCompileProgram(prog, 1, [f"-arch={arch}".encode()]))
            ptx = b" " * check(bindings.nvrtcGetPTXSize(prog))
            check(bindings.nvrtcGetPTX(prog, ptx))
            return ptx.rstrip(b"\0 ").decode()
        finally:
            check(bindings.nvrtcDestroyProgram(prog))
    prog = nvrtc.createProgram(source, "spin.cu", (), ())
    try:
        nvrtc.compileProgram(prog, (f"-arch={arch}",))
        return nvrtc.getPTX(prog).decode()
    finally:
        nvrtc.destroyProgram(prog)


def test_spin_kernel_compiles_with_nvrtc():
    # RawKernel compiles with NVRTC; CuPy's own compile call needs a device, the binding not.
    _spin_loop_is_kept(_nvrtc_ptx(bench_kernels.SPIN_SOURCE, "compute_90"))


class TimingCupy:
    """What _Spin and _timer touch, logging the order of launches and event records.

    ``caught_up``: for each attempt, whether the GPU had reached the start event by the
    time the batch was queued (then the last value for the rest)."""

    def __init__(self, caught_up: list[bool], elapsed_ms: list[float]) -> None:
        self.log: list[str] = []
        self.caught_up, self.elapsed_ms = list(caught_up), list(elapsed_ms)
        self.attempts = 0
        self.events = itertools.count()
        cuda = types.SimpleNamespace(
            Event=self._event,
            get_current_stream=lambda: types.SimpleNamespace(
                synchronize=lambda: self.log.append("sync")),
            get_elapsed_time=lambda start, stop: self.elapsed_ms.pop(0),
        )
        self.cuda = cuda

    def RawKernel(self, source: str, name: str):  # noqa: N802 - CuPy's name
        assert source == bench_kernels.SPIN_SOURCE and name == "pycoll_spin"

        def launch(grid, block, args):
            assert grid == block == (1,)  # one thread is enough to hold the stream
            self.log.append(f"spin {int(args[0])}")
        return launch

    def _event(self):
        timing = self
        name = "start" if next(self.events) % 2 == 0 else "stop"  # made in pairs

        class Event:
            def record(self) -> None:
                timing.log.append(name)
                if name == "start":
                    timing.attempts += 1

            @property
            def done(self) -> bool:
                flags = timing.caught_up
                return flags.pop(0) if len(flags) > 1 else flags[0]

            def synchronize(self) -> None:
                pass

        return Event()


def test_the_spin_is_queued_before_the_start_and_the_batch_after_it():
    fake = TimingCupy(caught_up=[False], elapsed_ms=[4.0, 2.0, 3.0])
    spin = bench_kernels._Spin(fake, batch=4)
    first = max(bench_kernels.SPIN_MIN_CYCLES, 4 * bench_kernels.SPIN_CYCLES_PER_LAUNCH)
    seconds = bench_kernels._timer(fake, lambda: fake.log.append("call"), 3, 4, spin)
    assert seconds == pytest.approx(3.0e-3 / 4)  # the median batch's time per launch
    attempt = [f"spin {first}", "start", "call", "call", "call", "call", "stop"]
    # compiled at construction (a zero spin), then warm-up, then each timed batch
    assert fake.log == ["spin 0", "call", "sync", *attempt * 3]


def test_a_spin_the_gpu_outran_is_doubled_and_that_batch_measured_again():
    fake = TimingCupy(caught_up=[True, True, False], elapsed_ms=[4.0, 2.0, 3.0])
    spin = bench_kernels._Spin(fake, batch=2)
    first = spin.cycles
    bench_kernels._timer(fake, lambda: None, 3, 2, spin)
    assert fake.attempts == 5  # two attempts discarded
    spins = [int(entry.split()[1]) for entry in fake.log if entry.startswith("spin ")][1:]
    assert spins == [first, 2 * first, 4 * first, 4 * first, 4 * first]
    assert spin.cycles == 4 * first  # kept for the next kernels


def test_the_spin_stops_growing_at_its_cap():
    fake = TimingCupy(caught_up=[True], elapsed_ms=[1.0] * 3)
    spin = bench_kernels._Spin(fake, batch=2)
    doublings = math.ceil(math.log2(bench_kernels.SPIN_MAX_CYCLES / spin.cycles))
    bench_kernels._timer(fake, lambda: None, 3, 2, spin)
    assert spin.cycles == bench_kernels.SPIN_MAX_CYCLES
    assert fake.attempts == doublings + 3  # then it measures anyway


# ---------------------------------------------------------------- _measure with stand-ins


class CompileException(Exception):
    """Stands in for cupy.cuda.compiler.CompileException."""


class FakeBuffer:
    def __init__(self, ptr: int, dtype: Any = np.float32) -> None:
        self.data = types.SimpleNamespace(ptr=ptr)
        self.dtype = np.dtype(dtype)

    def view(self, dtype: Any) -> FakeBuffer:
        return FakeBuffer(self.data.ptr, dtype)


def _fake_cupy(launches: list[tuple[str, int]]) -> types.SimpleNamespace:
    """Just what _measure touches; every launch is logged as (what, dst pointer)."""
    ptrs = itertools.count(1)
    runtime = types.SimpleNamespace(
        memcpyDeviceToDevice=3,
        memcpyAsync=lambda dst, src, n, kind, stream: launches.append(("copy", dst)),
    )
    return types.SimpleNamespace(
        ones=lambda n, dtype: FakeBuffer(next(ptrs), dtype),
        add=lambda a, b, out: launches.append(("cupy_add", out.data.ptr)),
        cuda=types.SimpleNamespace(
            runtime=runtime, get_current_stream=lambda: types.SimpleNamespace(ptr=0)),
    )


class FakeKernels:
    """A backend whose numba reduce_n does not compile."""

    def __init__(self, backend: str, launches: list[tuple[str, int]]) -> None:
        self.backend, self.launches = backend, launches

    def reducer(self, op, dtype):
        def reduce(dst, src, first=None):
            kernel = "reduce" if first is None else "reduce_pair"
            self.launches.append((f"{kernel}/{self.backend}", dst.data.ptr))
        return reduce

    def reduce_n(self, dst, sources, op):
        if self.backend == "numba":
            raise CompileException("reduce.cu(1): error: no\nsecond line")
        assert len(sources) == bench_kernels.SOURCES
        self.launches.append((f"reduce_n/{self.backend}", dst.data.ptr))

    def reduce_copy(self, dst, peer, a, b, op):
        assert peer is not dst
        self.launches.append((f"reduce_copy/{self.backend}", dst.data.ptr))

    def copy_pair(self, dst, peer, src):
        assert len({dst.data.ptr, peer.data.ptr, src.data.ptr}) == 3
        assert {x.dtype for x in (dst, peer, src)} == {np.dtype(np.uint32)}  # float32's words
        self.launches.append((f"copy_pair/{self.backend}", dst.data.ptr))


def test_a_failing_kernel_is_a_row_and_the_rest_still_run(monkeypatch):
    from pycoll.kernels import device
    from pycoll.kernels.host import ReduceOp

    launches: list[tuple[str, int]] = []
    calls_per_timing = 7

    def fake_timer(cupy, call, repeats, batch, spin, warmup):
        for _ in range(calls_per_timing):
            call()
        return 1e-3

    monkeypatch.setattr(bench_kernels, "_timer", fake_timer)
    monkeypatch.setattr(device, "gpu_kernels",
                        lambda backend: FakeKernels(backend, launches))
    n = 1024
    nbytes = 4 * n
    l2 = 2 * nbytes  # three sets of 2 * nbytes exceed twice this
    rows: list[KernelRow] = []
    bench_kernels._measure(_fake_cupy(launches), np.dtype(np.float32), n, ["cupy", "numba"],
                           ReduceOp.SUM, 5, 10, None, l2, rows.append)

    assert [(r.kernel, r.backend) for r in rows] == [
        ("copy", "cuda"), ("cupy_add", "cupy"),
        ("reduce", "cupy"), ("reduce_pair", "cupy"), ("reduce_n", "cupy"),
        ("reduce_copy", "cupy"), ("copy_pair", "cupy"),
        ("reduce", "numba"), ("reduce_pair", "numba"), ("reduce_n", "numba"),
        ("reduce_copy", "numba"), ("copy_pair", "numba"),
    ]
    failed = rows[9]
    assert failed.error == "CompileException: reduce.cu(1): error: no\nsecond line"
    assert math.isnan(failed.time_us) and math.isnan(failed.bandwidth)
    assert failed.of_copy is None and failed.vs_cupy_add is None
    measured = [r for r in rows if r.error is None]
    assert len(measured) == 11
    copy_bw = 2 * nbytes / 1e-3 / 1e9
    assert rows[0].bandwidth == pytest.approx(copy_bw)
    assert rows[4].bandwidth == pytest.approx(5 * nbytes / 1e-3 / 1e9)  # reduce_n: 5 per el.
    assert rows[6].bandwidth == pytest.approx(3 * nbytes / 1e-3 / 1e9)  # copy_pair: 3 per el.
    assert all(r.vs_cupy_add == pytest.approx(1.0) for r in measured[1:])

    # every kernel, baselines included, went round the same three sets of buffers
    count = buffer_sets(2 * nbytes, l2)
    assert count == 3
    by_kernel: dict[str, list[int]] = {}
    for what, dst in launches:
        by_kernel.setdefault(what, []).append(dst)
    assert set(by_kernel) == {"copy", "cupy_add", "reduce/cupy", "reduce_pair/cupy",
                              "reduce_n/cupy", "reduce_copy/cupy", "copy_pair/cupy",
                              "reduce/numba", "reduce_pair/numba", "reduce_copy/numba",
                              "copy_pair/numba"}
    dsts = {dst for dsts in by_kernel.values() for dst in dsts}
    assert len(dsts) == count
    for what, seq in by_kernel.items():
        assert len(seq) == calls_per_timing, what
        assert all(seq[i] != seq[i + 1] for i in range(len(seq) - 1)), what
        assert all(seq[i] == seq[i + count] for i in range(len(seq) - count)), what


def test_one_set_when_a_call_outgrows_twice_the_l2(monkeypatch):
    from pycoll.kernels import device
    from pycoll.kernels.host import ReduceOp

    launches: list[tuple[str, int]] = []
    monkeypatch.setattr(bench_kernels, "_timer",
                        lambda cupy, call, repeats, batch, spin, warmup: (call(), call(), 1e-3)[-1])
    monkeypatch.setattr(device, "gpu_kernels", lambda backend: FakeKernels(backend, launches))
    bench_kernels._measure(_fake_cupy(launches), np.dtype(np.float32), 1024, ["cupy"],
                           ReduceOp.SUM, 5, 10, None, 4096 - 1, lambda row: None)
    assert len({dst for _, dst in launches}) == 1


# ---------------------------------------------------------------- streaming, through the CLI


@pytest.fixture
def fake_gpu(monkeypatch):
    """run() with a stand-in GPU; the test sets bench_kernels._measure."""
    look_alike = types.ModuleType("cupy")
    look_alike.get_default_memory_pool = lambda: types.SimpleNamespace(
        free_all_blocks=lambda: None)
    monkeypatch.setitem(sys.modules, "cupy", look_alike)
    monkeypatch.setattr(bench_kernels, "gpu_available", lambda: True)
    monkeypatch.setattr(bench_kernels, "_Spin", lambda cupy, batch: None)
    monkeypatch.setattr(bench_kernels, "_l2_bytes", lambda cupy: H200_L2)


def _rows_for(nbytes: int) -> list[KernelRow]:
    return [
        KernelRow(nbytes, "float32", "copy", "cuda", 10.0, 200.0, 1.0, None),
        KernelRow(nbytes, "float32", "reduce_n", "numba", math.nan, math.nan, None, None,
                  "CompileException: reduce.cu(1): error: no\nsecond line"),
    ]


def test_rows_are_printed_and_saved_as_they_are_measured(fake_gpu, monkeypatch, capsys,
                                                         tmp_path):
    out = tmp_path / "kernels.json"
    seen: list[tuple[str, list]] = []

    def fake_measure(cupy, dtype, n, backends, op, repeats, batch, spin, l2, emit, warmup):
        nbytes = n * dtype.itemsize
        if nbytes > MiB:
            raise KeyboardInterrupt  # as if the step's timeout killed the run here
        first, failed = _rows_for(nbytes)
        emit(first)
        seen.append((capsys.readouterr().out, json.loads(out.read_text())))
        emit(failed)

    monkeypatch.setattr(bench_kernels, "_measure", fake_measure)
    with pytest.raises(KeyboardInterrupt):
        main(["bench", "kernels", "-b", "1M", "-e", "4M", "-f", "4", "--json", str(out)])

    # the first row was out, header first, and on disk before the next was measured
    [(printed, saved)] = seen
    assert printed.splitlines() == [bench_kernels.TABLE_HEADER,
                                    bench_kernels.format_row(_rows_for(MiB)[0])]
    assert "1048576  float32         copy    cuda       10.0      200.0  100.0%      -" \
        in printed
    assert saved == [{"size": MiB, "dtype": "float32", "kernel": "copy", "backend": "cuda",
                      "time_us": 10.0, "bandwidth": 200.0, "of_copy": 1.0,
                      "vs_cupy_add": None}]
    # the failed kernel's row followed, and the run's kill kept both
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split() == ["1048576", "float32", "reduce_n", "numba", "error:",
                                  "CompileException:", "reduce.cu(1):", "error:", "no"]
    assert printed[1:] == ["#   second line"]
    saved = json.loads(out.read_text())
    assert [r["kernel"] for r in saved] == ["copy", "reduce_n"]
    assert saved[1]["time_us"] is None and saved[1]["bandwidth"] is None
    assert saved[1]["error"].startswith("CompileException: reduce.cu(1)")
    assert list(tmp_path.iterdir()) == [out]  # no temporary file left behind


def test_a_failed_kernel_fails_the_run_after_the_rest(fake_gpu, monkeypatch, capsys):
    sizes: list[int] = []

    def fake_measure(cupy, dtype, n, backends, op, repeats, batch, spin, l2, emit, warmup):
        sizes.append(n * dtype.itemsize)
        for row in _rows_for(n * dtype.itemsize):
            emit(row)

    monkeypatch.setattr(bench_kernels, "_measure", fake_measure)
    assert main(["bench", "kernels", "-b", "1M", "-e", "4M", "-f", "4", "--json", "-"]) == 1
    assert sizes == [MiB, 4 * MiB]
    captured = capsys.readouterr()
    assert "pycoll bench kernels: failed: reduce_n/numba" in captured.err
    # --json -: stdout is the JSON's alone, written once, at the end; the table goes to stderr
    assert captured.err.count("error: CompileException") == 2
    assert len(json.loads(captured.out)) == 4


def test_bad_dtype_or_backend_is_refused_before_anything_is_measured(fake_gpu, monkeypatch,
                                                                    capsys):
    monkeypatch.setattr(bench_kernels, "_measure", lambda *args: pytest.fail("measured"))
    assert main(["bench", "kernels", "-b", "1M", "-e", "1M", "-d", "float32,complex64"]) == 2
    assert main(["bench", "kernels", "-b", "1M", "-e", "1M", "--backend", "cupy,opencl"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "complex64" in captured.err and "opencl" in captured.err


@pytest.mark.parametrize("flag", [["--ranks", "2"], ["-c", "0"], ["-r", "1"],
                                  ["--algorithm", "ring"], ["--against", "mpi"],
                                  ["--device", "cuda"], ["--roofline"]])
def test_a_flag_for_collectives_is_refused_not_ignored(fake_gpu, monkeypatch, capsys, flag):
    monkeypatch.setattr(bench_kernels, "_measure", lambda *args: pytest.fail("measured"))
    assert main(["bench", "kernels", "-b", "1M", "-e", "1M", *flag]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"pycoll bench kernels: {flag[0]}=" in captured.err
    assert "does not apply to kernels" in captured.err


def test_the_kernels_backend_flag_is_refused_for_a_collective(capsys):
    assert main(["bench", "allreduce", "-e", "8", "--ranks", "1", "--backend", "numba"]) == 2
    assert "--backend='numba' is for `pycoll bench kernels` only" in capsys.readouterr().err


def test_iterations_warmup_and_csv_reach_the_kernel_run(fake_gpu, monkeypatch, capsys,
                                                        tmp_path):
    counts: list[tuple[int, int]] = []

    def fake_measure(cupy, dtype, n, backends, op, repeats, batch, spin, l2, emit, warmup):
        counts.append((batch, warmup))
        for row in _rows_for(n * dtype.itemsize):
            emit(row)

    monkeypatch.setattr(bench_kernels, "_measure", fake_measure)
    out = tmp_path / "kernels.csv"
    main(["bench", "kernels", "-b", "1M", "-e", "1M", "--csv", str(out)])
    capsys.readouterr()
    main(["bench", "kernels", "-b", "1M", "-e", "1M", "-n", "3", "-w", "0", "--csv", "-"])
    assert counts == [(bench_kernels.BATCH, bench_kernels.WARMUP), (3, 0)]
    assert main(["bench", "kernels", "-b", "1M", "-e", "1M", "-n", "0"]) == 2
    assert counts == [(bench_kernels.BATCH, bench_kernels.WARMUP), (3, 0)]

    expected = [
        "size,dtype,kernel,backend,time_us,bandwidth,of_copy,vs_cupy_add,error",
        f"{MiB},float32,copy,cuda,10.0,200.0,1.0,,",
        f'{MiB},float32,reduce_n,numba,,,,,"CompileException: reduce.cu(1): error: no',
        'second line"',
    ]
    assert out.read_text().splitlines() == expected
    captured = capsys.readouterr()
    assert captured.out.splitlines() == expected  # --csv -: stdout is the CSV's alone
    assert "-n=0 (launches per timed batch)" in captured.err


def test_warmup_launches_precede_the_timed_batches():
    fake = TimingCupy(caught_up=[False], elapsed_ms=[1.0])
    spin = bench_kernels._Spin(fake, batch=2)
    bench_kernels._timer(fake, lambda: fake.log.append("call"), 1, 2, spin, warmup=3)
    assert fake.log == ["spin 0", "call", "call", "call", "sync",
                        f"spin {spin.cycles}", "start", "call", "call", "stop"]


def test_a_spin_kernel_that_does_not_compile_stops_the_run_plainly(fake_gpu, monkeypatch,
                                                                  capsys):
    def no_nvrtc(source, name):
        raise CompileException("cannot open source file cuda_fp16.h")

    monkeypatch.setattr(sys.modules["cupy"], "RawKernel", no_nvrtc, raising=False)
    monkeypatch.setattr(bench_kernels, "_Spin", REAL_SPIN)
    monkeypatch.setattr(bench_kernels, "_measure", lambda *args: pytest.fail("measured"))
    assert main(["bench", "kernels", "-b", "1M", "-e", "1M"]) == 2
    assert ("pycoll bench kernels: the timing spin kernel failed: CompileException: cannot "
            "open source file cuda_fp16.h") in capsys.readouterr().err


def test_a_size_whose_buffers_fail_is_a_row_and_the_other_sizes_still_run(fake_gpu, monkeypatch,
                                                                          capsys):
    """An error outside the kernels (allocating the buffers, the copy baseline: out of memory,
    a fill CuPy refuses) is that size's copy row; the run goes on, and fails at the end."""
    measured: list[tuple[str, int]] = []

    def fake_measure(cupy, dtype, n, backends, op, repeats, batch, spin, l2, emit, warmup):
        nbytes = n * dtype.itemsize
        if dtype.name == "bfloat16" and nbytes == 4 * MiB:
            raise MemoryError("Out of memory allocating 4,194,304 bytes")
        measured.append((dtype.name, nbytes))
        emit(KernelRow(nbytes, dtype.name, "copy", "cuda", 10.0, 200.0, 1.0, None))

    monkeypatch.setattr(bench_kernels, "_measure", fake_measure)
    assert main(["bench", "kernels", "-b", "1M", "-e", "16M", "-f", "4", "-d",
                 "float32,bfloat16", "--json", "-"]) == 1
    assert measured == [("float32", MiB), ("float32", 4 * MiB), ("float32", 16 * MiB),
                        ("bfloat16", MiB), ("bfloat16", 16 * MiB)]
    captured = capsys.readouterr()
    assert "pycoll bench kernels: failed: copy/cuda" in captured.err
    rows = json.loads(captured.out)
    [failed] = [r for r in rows if "error" in r]
    assert (failed["size"], failed["dtype"], failed["kernel"]) == (4 * MiB, "bfloat16", "copy")
    assert failed["error"] == "MemoryError: Out of memory allocating 4,194,304 bytes"
    assert failed["time_us"] is None
