"""bench/summarize_gpu.py: issue 4's bars read off gpu_check.sh's folder (synthetic results
here; the real ones come from a GPU run)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

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


def test_the_ring_with_and_without_its_reduce_and_forward(tmp_path):
    ring = [collective("allreduce", 4, size, "ring", t) for size, t in ((MiB, 50), (64 * MiB, 800))]
    write(tmp_path, collectives={
        "allreduce-4.json": [*ring, collective("allreduce", 4, 64 * MiB, "tree", 700)],
        "unforwarded-allreduce-4.json": [collective("allreduce", 4, 64 * MiB, "ring", 1000, 2)],
    })
    page = summarize_gpu.main(str(tmp_path))
    assert "| allreduce (PYCOLL_FORWARD=0) | 4 | 1 | 2 |" in page
    assert "| 64 MiB | 83.9 | 67.1 | 1.25 |" in page  # only sizes measured both ways
    assert "| 1 MiB |" not in page.split("ring's forwarding")[-1]
    assert "#wrong = 0: NOT met (2 wrong values in all)" in page
    alone = tmp_path / "alone"
    alone.mkdir()
    write(alone, collectives={"allreduce-4.json": ring})
    assert "Not measured (no allreduce-4.json and unforwarded-allreduce-4.json)" in (
        summarize_gpu.main(str(alone)))


@pytest.mark.parametrize("ipc_fails", [0, 3, 124])
def test_gpu_check_brings_back_at_most_8_files(tmp_path, ipc_fails):
    """The device tool returns at most 8 files from $OUT, named in letters, digits, '.', '_'
    and '-', at most 2 folders down: gpu_check.sh must fit, its page and the collectives' JSON
    included. mpiexec is a stand-in that writes one row where --json says (no GPU here), or,
    with ``ipc_fails``, exits so in every run not staged through the host, as a machine that
    refuses CUDA IPC would (3), or where it hangs on the GPU until the run's time limit
    (124): the other IPC runs are then skipped (125), and one staged AllReduce runs, outside
    the IPC bar."""
    row = json.dumps([collective("allreduce", 2, MiB, "ring", 9)])
    out = tmp_path / "out"
    calls = tmp_path / "calls.txt"
    run = _gpu_check(tmp_path, "12", f"""#!/bin/sh
# which step this is, and whether $OUT already held a page (written after the step before)
for a in "$@"; do [ "$a" = --json ] && json=1; done
[ -n "$json" ] || exit 0
[ -f "{out}/gpu-summary.md" ] && page=page || page=none
echo "${{PYCOLL_DEVICE_TRANSPORT:-ipc}} $page" >> "{calls}"
[ "{ipc_fails}" != 0 ] && [ "$PYCOLL_DEVICE_TRANSPORT" != staged ] && exit {ipc_fails}
while [ $# -gt 0 ]; do [ "$1" = --json ] && echo '{row}' > "$2"; shift; done
exit 0
""")
    assert run.returncode != 0, run.stdout  # no GPU: the tests and the kernel bench fail
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 0 < len(files) <= 8, files
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", p.name) for p in files), files
    assert all(len(p.relative_to(out).parts) <= 3 for p in files), files
    # the page was written before the first collective ran
    made = calls.read_text().split("\n")[:-1]
    ipc_made = 1 if ipc_fails else 8  # after one failure or hang the rest are skipped
    assert made == ["ipc page"] * ipc_made + (["staged page"] if ipc_fails else []), made
    page = (out / "gpu-summary.md").read_text()
    assert "# no nvidia-cuda-mps-control: no run under MPS" in (out / "collectives.txt").read_text()
    # each test file's run, with its exit
    assert "# tests/test_gpu_collectives.py: exit " in page, page
    assert "# tests/test_kernels_cuda.py: exit " in page, page
    ipc_runs = [f"{c}-{n}.json" for n in (2, 4) for c in ("allreduce", "reduce_scatter",
                                                          "allgather")]
    ipc_runs += ["sendrecv-2.json", "unforwarded-allreduce-4.json"]
    if ipc_fails:
        assert "| allreduce (staged through the host, no IPC) | 2 | 1 | 0 |" in page, page
        assert f"| allreduce | 2 | 0 | - | - | - | {ipc_fails} |" in page, page
        assert "| allgather | 4 | 0 | - | - | - | 125 |" in page, page
        assert "IPC collective #wrong = 0: not shown: 8 run(s) did not finish" in page, page
        assert "An IPC run failed, so gpu_check.sh ran AllReduce staged" in page
        archived = ["staged-allreduce-2.json"]
    else:
        assert "| allreduce | 2 | 1 | 0 |" in page, page
        assert "staged" not in page
        archived = ipc_runs
    with tarfile.open(out / "collectives.tar.gz") as archive:
        names = sorted(Path(name).name for name in archive.getnames())
    assert names == sorted(archived), names


def _gpu_check(tmp_path: Path, seconds: str, mpiexec: str, mps_control: str = ""
               ) -> subprocess.CompletedProcess:
    """bench/gpu_check.sh run on a copy of the tree with GPU_CHECK_SECONDS=``seconds``, its
    $OUT in tmp_path/out, ``mpiexec`` (a script) first on PATH, and ``mps_control`` as
    nvidia-cuda-mps-control (none by default, even where the machine has one)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "mpiexec").write_text(mpiexec)
    (bin_dir / "mpiexec").chmod(0o755)
    tree = tmp_path / "tree"  # the source tree without .whl/ (whose mpiexec would come first)
    for part in ("bench", "pycoll", "kernels", "bindings", "tests"):
        shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_CHECK_SECONDS": seconds,
           "PYTHON": sys.executable, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "GPU_CHECK_MPS_CONTROL": mps_control}
    env.pop("PYCOLL_DEVICE_TRANSPORT", None)
    return subprocess.run(["bash", "bench/gpu_check.sh"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=120)


def test_gpu_check_starts_no_step_once_its_time_is_spent(tmp_path):
    """A step that would start with under 5 s left is skipped (exit 125), not started with a
    1 s cap and then read as a hang (124): here with 1 s for the whole script."""
    started = tmp_path / "started.txt"
    run = _gpu_check(tmp_path, "1", f'#!/bin/sh\necho "$@" >> "{started}"\nexit 0\n')
    assert run.returncode != 0, run.stdout
    assert not started.exists(), started.read_text()  # not even the preflight's
    page = (tmp_path / "out" / "gpu-summary.md").read_text()
    assert "ipc smoke exit 125, gpu tests exit 125 (collectives), 125 (kernels), kernel " \
           "bench exit 125, collectives exit 125" in page, page
    assert "# tests/test_kernels_cuda.py::numba-matrix: exit 125" in page, page
    assert "| allreduce | 2 | 0 | - | - | - | 125 |" in page, page
    assert "| 124 |" not in page and ": exit 124" not in page, page


def test_a_collective_run_stopped_by_the_time_limit_keeps_the_bar_from_being_met(tmp_path):
    """A run killed part way leaves the rows it measured (pycoll bench rewrites its JSON per
    row) and its exit status in collectives.txt; one killed before its first row, only that."""
    write(tmp_path, collectives={
        "allreduce-2.json": [collective("allreduce", 2, MiB, "ring", 9)],
        "allgather-4.json": [collective("allgather", 4, MiB, "ring", 9)],
    })
    (tmp_path / "collectives.txt").write_text(
        "# allreduce on 2 ranks: exit 0\n# allgather on 4 ranks: exit 124\n"
        "# allreduce on 4 ranks, ring, PYCOLL_FORWARD=0: exit 124\n")
    page = summarize_gpu.main(str(tmp_path))
    assert "| allreduce | 2 | 1 | 0 | 1 MiB .. 1 MiB | ring (116.5 GB/s busbw) | 0 |" in page
    assert "| allgather | 4 | 1 | 0 | 1 MiB .. 1 MiB | ring (116.5 GB/s busbw) | 124 |" in page
    assert "| allreduce (PYCOLL_FORWARD=0) | 4 | 0 | - | - | - | 124 |" in page
    assert ("#wrong = 0: not shown: 2 run(s) did not finish (allgather-4: exit 124, "
            "unforwarded-allreduce-4: exit 124; exit 124 is gpu_check.sh's time limit, 125 "
            "skipped after an IPC run timed out or failed or with no time left, 2 a refusal "
            "such as no GPU)") in page
    (tmp_path / "collectives.txt").write_text(
        "# allreduce on 2 ranks: exit 0\n# allgather on 4 ranks: exit 0\n")
    assert "#wrong = 0: met (0 wrong values in all)" in summarize_gpu.main(str(tmp_path))


def test_rows_run_without_the_check_keep_the_bar_from_being_met(tmp_path):
    """`pycoll bench -c 0` writes #wrong None: such rows are shown as not checked and
    count for no bar (the summary raised TypeError on them)."""
    write(tmp_path, collectives={"allreduce-2.json": [
        collective("allreduce", 2, MiB, "ring", 9),
        collective("allreduce", 2, MiB, "direct", 10, wrong=None)]})
    page = summarize_gpu.main(str(tmp_path))
    assert "| allreduce | 2 | 2 | 0 (1 not checked) | 1 MiB .. 1 MiB |" in page
    assert ("#wrong = 0: not shown: rows run without --check in allreduce-2 "
            "(0 wrong values in all)") in page


def test_a_test_run_that_skipped_for_want_of_a_gpu_says_why_it_failed(tmp_path):
    """gpu_check.sh fails a pytest run whose tests skipped for want of a GPU (CuPy saw
    none): the page shows that verdict beside the counts, not a bare exit 3."""
    write(tmp_path)
    (tmp_path / "gpu-tests.txt").write_text(
        "sss\nSKIPPED [3] tests/test_gpu_collectives.py:47: no CUDA GPU\n3 skipped in 1.0s\n"
        "# tests skipped for want of a GPU on a GPU machine: counted as failed\n"
        "# tests/test_gpu_collectives.py: exit 3\n"
        "..\n2 passed in 1.0s\n# tests/test_kernels_cuda.py: exit 0\n")
    page = summarize_gpu.main(str(tmp_path))
    assert ("3 skipped in 1.0s\n# tests skipped for want of a GPU on a GPU machine: counted "
            "as failed\n# tests/test_gpu_collectives.py: exit 3\n2 passed in 1.0s\n"
            "# tests/test_kernels_cuda.py: exit 0") in page, page


def test_allreduce_under_mps_against_taking_turns(tmp_path):
    """AllReduce at 4 ranks under MPS beside the same run without: per algorithm at the
    smallest and largest size; its #wrong counts toward the IPC bar, its failing to run
    (where MPS refuses) does not."""
    write(tmp_path, collectives={
        "allreduce-4.json": [collective("allreduce", 4, s, a, t) for s, a, t in (
            (MiB, "ring", 6000), (4 * MiB, "ring", 6100), (64 * MiB, "ring", 7000),
            (64 * MiB, "tree", 3500))],
        "mps-allreduce-4.json": [collective("allreduce", 4, s, "ring", t, w) for s, t, w in (
            (MiB, 300, 0), (4 * MiB, 400, 0), (64 * MiB, 1400, 5))],
    })
    (tmp_path / "collectives.txt").write_text(
        "# allreduce on 4 ranks: exit 0\n# allreduce on 4 ranks, under MPS: exit 1\n")
    page = summarize_gpu.main(str(tmp_path))
    section = page.split("under MPS", 1)[1]
    assert "| ring | 1 MiB | 6000.0 | 300.0 | 20.00 | 0 |" in section, page
    assert "| ring | 64 MiB | 7000.0 | 1400.0 | 5.00 | 5 |" in section, page
    assert "| ring | 4 MiB |" not in section and "| tree |" not in section, page
    assert "| allreduce (under MPS) | 4 | 3 | 5 |" in page, page
    assert "#wrong = 0: NOT met (5 wrong values in all)" in page, page  # wrong is wrong
    assert "staged" not in page, page
    # a run under MPS that failed (the clients refused, say) is said, and keeps no bar
    (tmp_path / "mps-allreduce-4.json").unlink()
    (tmp_path / "collectives.txt").write_text(
        "# allreduce on 4 ranks: exit 0\n# allreduce on 4 ranks, under MPS: exit 2\n")
    page = summarize_gpu.main(str(tmp_path))
    assert "| allreduce (under MPS) | 4 | 0 | - | - | - | 2 |" in page, page
    assert "#wrong = 0: met (0 wrong values in all)" in page, page
    assert "The run under MPS did not finish (exit 2;" in page, page
    alone = tmp_path / "alone"
    alone.mkdir()
    write(alone, collectives={"allreduce-4.json": [collective("allreduce", 4, MiB, "ring", 9)]})
    assert "Not measured (no allreduce-4.json and mps-allreduce-4.json" in (
        summarize_gpu.main(str(alone)))


def test_gpu_check_runs_allreduce_under_mps_where_the_machine_has_it(tmp_path):
    """With nvidia-cuda-mps-control, gpu_check.sh starts its daemon (pipe and log folders
    of its own, exported to the ranks), runs AllReduce at 4 ranks under it, last, asks it for
    its servers and quits it (without, test_gpu_check_brings_back_at_most_8_files)."""
    log = tmp_path / "mps.txt"
    control = tmp_path / "nvidia-cuda-mps-control"
    control.write_text(f'#!/bin/sh\n[ "$1" = -d ] && what=-d || read -r what\n'
                       f'echo "control $what ${{GPU_CHECK_RUN:-unmarked}}" >> "{log}"\n')
    control.chmod(0o755)
    row = json.dumps([collective("allreduce", 4, MiB, "ring", 9)])
    mpiexec = f"""#!/bin/sh
for a in "$@"; do [ "$a" = --json ] && json=1; done
[ -n "$json" ] || exit 0
echo "mpiexec $2 ${{CUDA_MPS_PIPE_DIRECTORY:+pipe}} $*" >> "{log}"
while [ $# -gt 0 ]; do [ "$1" = --json ] && echo '{row}' > "$2"; shift; done
"""
    run = _gpu_check(tmp_path, "60", mpiexec, str(control))
    said = log.read_text().splitlines()
    assert said[-4] == "control -d unmarked", said  # reap spares the daemon
    assert said[-3].startswith("mpiexec 4 pipe ") and "mps-allreduce-4.json" in said[-3], said
    assert "--algorithm all" in said[-3], said
    assert [line.split()[1] for line in said[-2:]] == ["get_server_list", "quit"], said
    assert not any(" pipe " in line for line in said[:-3]), said  # only that run under MPS
    page = (tmp_path / "out" / "gpu-summary.md").read_text()
    assert "| allreduce (under MPS) | 4 | 1 | 0 |" in page, page
    assert "| ring | 1 MiB | 9.0 | 9.0 | 1.00 | 0 |" in page, page
    with tarfile.open(tmp_path / "out" / "collectives.tar.gz") as archive:
        assert "mps-allreduce-4.json" in {Path(n).name for n in archive.getnames()}
    assert run.returncode != 0  # no GPU here: the tests fail; MPS changes nothing of that
