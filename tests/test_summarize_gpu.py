"""bench/summarize_gpu.py: issue 4's bars read off gpu_check.sh's folder (synthetic results
here; the real ones come from a GPU run)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("summarize_gpu", ROOT / "bench/summarize_gpu.py")
summarize_gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summarize_gpu)

MiB = 1 << 20


def kernel(size, kernel, backend, of_copy, vs_add=None, error=None, dtype="float32"):
    row = {"size": size, "dtype": dtype, "kernel": kernel, "backend": backend,
           "time_us": None if error else 100.0, "bandwidth": None if error else 4000 * of_copy,
           "of_copy": None if error else of_copy, "vs_cupy_add": vs_add}
    if error:
        row["error"] = error
    return row


def collective(name, nranks, size, algorithm, time_us, wrong=0):
    return {"collective": name, "nranks": nranks, "size": size, "algorithm": algorithm,
            "time_us": time_us, "busbw": size / time_us / 1e3, "wrong": wrong}


def write(folder: Path, kernels=None, collectives=None, summary="gpu tests exit 0\n"):
    (folder / "environment.txt").write_text(
        "# gpu_check 2026-12-01T10:00Z\nname, memory.total [MiB]\nNVIDIA H200, 143771 MiB\n")
    (folder / "gpu-tests.txt").write_text("....\n42 passed in 80.0s\n")
    if summary is not None:
        (folder / "summary.txt").write_text(summary)
    if kernels is not None:
        (folder / "kernels.json").write_text(json.dumps(kernels))
    for name, rows in (collectives or {}).items():
        (folder / name).write_text(json.dumps(rows))


def test_bars_met_and_the_faster_backend_named(tmp_path):
    rows = [kernel(1 * MiB, "reduce", "cupy", 0.5)]  # small sizes do not count
    for size in (256 * MiB, 1024 * MiB):
        for name in summarize_gpu.REDUCE_KERNELS:
            rows.append(kernel(size, name, "cupy", 0.95, 1.1 if name == "reduce_pair" else 0.7))
            rows.append(kernel(size, name, "numba", 0.92, 1.0 if name == "reduce_pair" else 0.6))
    write(tmp_path, rows, {"allreduce-2.json": [collective("allreduce", 2, 64 * MiB, "ring", 90),
                                                collective("allreduce", 2, 64 * MiB, "tree", 80),
                                                collective("allreduce", 2, 64 * MiB, "auto", 70)]})
    page = summarize_gpu.main(str(tmp_path))
    assert page.startswith("# GPU check on NVIDIA H200")
    assert "| cupy | 95.0% | met | 1.10 | met |" in page
    assert "| numba | 92.0% | met | 1.00 | met |" in page
    assert "Faster backend (median fraction of copy at >= 256 MiB): **cupy**" in page
    assert "| allreduce | 2 | 3 | 0 | 64 MiB .. 64 MiB | tree (" in page  # auto is not a family
    assert "#wrong = 0: met (0 wrong values in all)" in page
    assert "42 passed in 80.0s" in page


def test_bars_not_met_are_said_so(tmp_path):
    rows = [kernel(256 * MiB, "reduce", "cupy", 0.85),
            kernel(256 * MiB, "reduce_pair", "cupy", 0.95, 0.9),
            kernel(256 * MiB, "reduce_n", "numba", 0.0, error="CompileException: bad\nmore")]
    write(tmp_path, rows, {"allgather-4.json": [collective("allgather", 4, MiB, "ring", 9, 3)]})
    page = summarize_gpu.main(str(tmp_path))
    assert "| cupy | 85.0% | NOT met | 0.90 | NOT met |" in page
    assert "| 256 MiB | float32 | reduce_n | numba | failed: CompileException: bad |" in page
    assert "#wrong = 0: NOT met (3 wrong values in all)" in page


def test_a_run_cut_short_still_gives_a_page(tmp_path):
    write(tmp_path, kernels=[kernel(MiB, "reduce", "cupy", 0.5)], summary=None)
    page = summarize_gpu.main(str(tmp_path))
    assert "(no summary.txt: the script did not finish)" in page
    assert "No reduce kernel was measured at >= 256 MiB" in page
    assert "No collective results." in page
