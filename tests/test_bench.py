"""`pycoll bench`: nccl-tests conventions, in-process and under mpiexec against native MPI."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
from conftest import PYTHON
from test_mpi import mpiexec

import pycoll
from pycoll import bench
from pycoll.cli import main
from pycoll.schedule import Collective


@pytest.mark.parametrize("text,size", [("8", 8), ("64K", 65536), ("32M", 32 << 20),
                                       ("1G", 1 << 30), ("2kb", 2048)])
def test_sizes_parse_as_nccl_tests_does(text, size):
    assert bench.parse_size(text) == size


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match="size='1.5M' is invalid"):
        bench.parse_size("1.5M")
    with pytest.raises(ValueError, match="--step-factor=1"):
        bench.sizes(8, 64, 1)


def test_sweep_includes_both_ends_when_they_line_up():
    assert bench.sizes(8, 128, 4) == [8, 32, 128]


@pytest.mark.parametrize("collective,factor", [
    (Collective.ALLREDUCE, 2 * 3 / 4), (Collective.REDUCE_SCATTER, 3 / 4),
    (Collective.ALLGATHER, 3 / 4), (Collective.ALLTOALL, 3 / 4),
    (Collective.BROADCAST, 1.0), (Collective.REDUCE, 1.0), (Collective.SENDRECV, 1.0),
])
def test_bus_bandwidth_factors_follow_nccl_tests(collective, factor):
    assert bench.bus_factor(collective, 4) == pytest.approx(factor)


@pytest.mark.parametrize("collective,low,high,counts", [
    (Collective.ALLREDUCE, 1, 16, [0, 1, 2, 4]),  # 1 B and 2 B of float32: 0 elements both
    (Collective.ALLGATHER, 4, 64, [0, 3, 6, 15]),  # below 3 elements: 0 (evenly split)
])
def test_each_element_count_is_swept_once(collective, low, high, counts):
    options = bench.Options(collective=collective.value, min_bytes=low, max_bytes=high)
    float32 = bench.np.dtype("float32")
    kept = bench.distinct_sizes(options, collective, float32, 3)
    assert [bench.element_count(collective, float32.itemsize, s, 3) for s in kept] == counts


@pytest.mark.parametrize("command,args,says", [
    ("bench", ["-d", "float64", "-b", "1", "-e", "4"], "needs one float64 element, 8 B; "
                                                       "allowed: --max-bytes 8 or more"),
    ("bench", ["reduce_scatter", "--ranks", "3", "-b", "4", "-e", "8"],
     "needs 3 float32 elements \\(one per rank: reduce_scatter splits evenly\\), 12 B"),
    ("compare", ["-d", "float64", "-b", "1", "-e", "4", "-n", "1", "-w", "0"],
     "needs one float64 element"),
])
def test_a_sweep_holding_no_whole_element_is_refused(capsys, command, args, says):
    """bench printed rows of 0 B and exited 0; compare crashed in matplotlib (a log scale of
    zeros)."""
    assert main([command, *args]) == 2
    assert re.search(f"--max-bytes={args[args.index('-e') + 1]} holds no whole element: the "
                     f"sweep {says}", capsys.readouterr().err)


def test_check_takes_0_or_1(capsys):
    """-c 2 was taken (as nccl-tests' -c, it is on or off)."""
    with pytest.raises(SystemExit) as stopped:
        main(["bench", "-c", "2"])
    assert stopped.value.code == 2
    assert "-c/--check: invalid choice: 2 (choose from 0, 1)" in capsys.readouterr().err


@pytest.mark.parametrize("collective", list(bench.COLLECTIVES))
def test_in_process_sweep_checks_every_size(collective, capsys, tmp_path):
    out = tmp_path / "rows.json"
    code = main(["bench", collective, "--ranks", "3", "-b", "8", "-e", "4K", "-f", "8",
                 "-n", "2", "-w", "1", "--algorithm", "all", "--json", str(out),
                 "--csv", str(tmp_path / "rows.csv")])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "#wrong" in printed and "busbw(GB/s)" in printed
    assert "out of bounds values: 0 OK" in printed
    rows = json.loads(out.read_text())
    assert rows and all(r["wrong"] == 0 and r["nranks"] == 3 for r in rows)
    assert {r["algorithm"] for r in rows} >= {"auto"}
    assert (tmp_path / "rows.csv").read_text().startswith("collective,nranks,size")


@pytest.mark.parametrize("args,message", [
    (["--ranks", "2", "--against", "mpi"], "--against mpi needs MPI ranks"),
    (["--ranks", "2", "--algorithm", "butterfly"], "--algorithm 'butterfly' has no allreduce"),
    (["broadcast", "--ranks", "2", "--algorithm", "direct"], "has no broadcast schedule"),
    (["--ranks", "2", "-o", "mean"], "op='mean' is not a reduction"),
    (["--ranks", "2", "-d", "bool"], "dtype='bool' is not supported"),
    (["--ranks", "2", "-d", "float32,all"], "--dtype='float32,all': 'all' stands alone"),
    (["--ranks", "2", "-o", " , "], "--op=' , ' names nothing"),
    (["--ranks", "2", "-d", "float32,bool"], "dtype='bool' is not supported"),
    (["--ranks", "2", "-d", "complex64", "-o", "sum,max"], "op='max' is not defined for complex64"),
    # beside 'all', the other flag's names and every other option are still checked
    (["--ranks", "2", "-d", "float,bogus", "-o", "all"], "dtype='bogus' is not a dtype"),
    (["--ranks", "2", "-d", "all", "-o", "sum,bogus"], "op='bogus' is not a reduction"),
    (["--ranks", "2", "-d", "all", "-n", "0"], "--iters=0"),
    (["alltoall", "--ranks", "2", "-d", "all", "--algorithm", "tree"], "has no alltoall"),
    # every pair's sweep is checked before any is measured (int8's ran, then int16's stopped)
    (["--ranks", "2", "-d", "all", "-b", "1", "-e", "1"], "--max-bytes=1 holds no whole element"),
    (["nonsense", "--ranks", "2"], "collective='nonsense' is unknown"),
    (["--device", "cuda", "--against", "mpi"], "--against mpi times host arrays only"),
    (["--ranks", "2", "--algorithm", "all,ring"], "'all' stands alone"),
])
def test_bad_options_are_named(args, message, capsys):
    assert main(["bench", *args]) == 2
    assert message in capsys.readouterr().err


def test_dtypes_and_ops_take_lists_and_all_as_nccl_tests(capsys, tmp_path):
    """nccl-tests' -d and -o take 'all' (a sweep of every type and op, each checked); here a
    comma-separated list too. Rows come dtypes outer, ops inner, every size of each."""
    out = tmp_path / "rows.json"
    assert main(["bench", "--ranks", "3", "-b", "8", "-e", "64", "-f", "8", "-n", "1", "-w", "0",
                 "-d", "int8,float", "-o", "sum,MAX", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["type"], r["redop"], r["size"]) for r in rows] == [
        (dtype, op, size) for dtype, sizes in (("int8", (8, 64)), ("float32", (8, 64)))
        for op in ("sum", "max") for size in sizes]
    assert all(r["wrong"] == 0 and r["in_place_wrong"] == 0 for r in rows)
    assert main(["bench", "--ranks", "2", "-b", "16", "-e", "16", "-n", "1", "-w", "0", "-d",
                 "all", "-o", "all", "--json", str(out)]) == 0
    pairs = [(r["type"], r["redop"]) for r in json.loads(out.read_text())]
    every = [(d.name, op.value) for d in pycoll.kernels.SUPPORTED_DTYPES for op in pycoll.ReduceOp
             if not (d.kind == "c" and op.value in ("min", "max"))]  # complex has no order
    assert pairs == every and "out of bounds values: 0 OK" in capsys.readouterr().out
    assert main(["bench", "allgather", "--ranks", "2", "-b", "16", "-e", "16", "-n", "1", "-w",
                 "0", "-d", "int32,uint8", "-o", "all", "--json", str(out)]) == 0
    assert [(r["type"], r["redop"]) for r in json.loads(out.read_text())] == [
        ("int32", "none"), ("uint8", "none")]  # no op: -o is not read


def test_all_leaves_out_what_the_options_cannot_run():
    """--against mpi has no avg and no half precision: 'all' skips them, a list names them."""
    options = bench.Options(dtype="all", op="all", against="mpi")
    pairs = {(o.dtype, o.op) for o in bench.combinations(options)}
    assert ("float32", "sum") in pairs and ("int8", "max") in pairs
    assert not {d for d, op in pairs} & {"float16", "bfloat16"}
    assert not {op for d, op in pairs} & {"avg"}
    runs = bench.combinations(bench.Options(dtype="float16,float32", op="sum", against="mpi"))
    with pytest.raises(ValueError, match="--against mpi cannot run sum on float16"):
        bench.validate(runs[0])
    for dtype, op, says in [("float16,float32", "all", "cannot run sum on float16"),
                            ("all", "avg", "cannot run avg on int8")]:  # a name beside 'all'
        with pytest.raises(ValueError, match=says):  # keeps a pair, or says why it cannot
            bench.combinations(bench.Options(dtype=dtype, op=op, against="mpi"))
    # only a reducing collective reads the op: moving data takes every dtype (as bytes)
    for collective in ("broadcast", "allgather", "alltoall"):
        moved = bench.combinations(bench.Options(collective, dtype="all", op="max",
                                                 against="mpi"))
        assert [o.dtype for o in moved] == [d.name for d in pycoll.kernels.SUPPORTED_DTYPES]
        assert all(bench.validate(o) for o in moved)
    aliases = bench.combinations(bench.Options(dtype="f4,float32,FLOAT,single"))
    assert [o.dtype for o in aliases] == ["float32"]  # one dtype, however it is spelt
    on_gpu = {o.dtype for o in bench.combinations(bench.Options(dtype="all", device="cuda"))}
    assert on_gpu == {row.dtype.name for row in pycoll.kernels.table.GPU_DTYPES}  # no complex


@pytest.mark.parametrize("command,setting", [("bench", "PYCOLL_SEGMENTS=x"),
                                             ("compare", "PYCOLL_SEGMENTS=x"),
                                             ("bench", "PYCOLL_SHM_CMA=yes")])
def test_a_bad_setting_on_one_rank_stops_every_rank_and_is_said_once(command, setting,
                                                                      tmp_path):
    """A rank whose PYCOLL_SEGMENTS was bad stopped at once; its peers waited forever in
    making the world (collective) it never joined. The settings are now checked with the
    command line, which the ranks agree on; PYCOLL_SHM_CMA was not among them (a hang)."""
    args = [*PYTHON, "-m", "pycoll", command, "-e", "64", "-n", "1", "-w", "0",
            "--output" if command == "compare" else "--json", str(tmp_path / "out")]
    done = subprocess.run([mpiexec(), "-n", "1", "env", setting, *args, ":",
                           "-n", "2", *args], capture_output=True, text=True, timeout=120)
    name, value = setting.split("=")
    said = f"{name}='{value}' is invalid"
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count(said) == 1, done.stderr
    assert f"pycoll {command} (rank 0): {said}" in done.stderr


# A closed descriptor in the child: subprocess closes every inherited one but 0, 1 and 2
_CLOSED_FD = "250"


@pytest.mark.parametrize("left_over", [
    {"PMIX_RANK": "0"},  # no size among them
    {"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": _CLOSED_FD},  # a rank's child's environment
])
def test_in_process_ranks_need_no_mpi_where_a_launchers_variables_are_left_over(left_over):
    """`pycoll bench --ranks 2` started MPI to learn the job's size whenever a launcher's
    variables were set, and died in MPI_Init where they were left over (a shell of srun's, a
    process a rank started): --ranks needs no MPI, and the size is read off the variables."""
    env = {**os.environ, **left_over}
    env.pop("PYCOLL_MPI", None)
    done = subprocess.run([*PYTHON, "-m", "pycoll", "bench", "allreduce", "--ranks", "2", "-b",
                           "8", "-e", "8", "-n", "1", "-w", "0"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 ranks (in-process)" in done.stdout + done.stderr


def test_a_process_a_rank_starts_is_a_world_of_one():
    """MPICH's launcher hands each rank a socket (PMI_FD) that a child process does not get:
    MPI_Init failed there on a bad file descriptor; such a child is a world of one."""
    env = {**os.environ, "PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": _CLOSED_FD}
    env.pop("PYCOLL_MPI", None)
    done = subprocess.run([*PYTHON, "-c", "import numpy, pycoll; print(pycoll.world().size, "
                           "pycoll.allreduce(numpy.arange(3)).tolist())"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["1", "[0,", "1,", "2]"], done.stdout


def test_a_launchers_socket_tells_a_rank_from_a_process_that_inherited_its_variables(
        monkeypatch):
    from pycoll.bindings import mpi

    monkeypatch.delenv("PYCOLL_MPI", raising=False)
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "3")
    ours, launchers = socket.socketpair()
    with ours, launchers, open(os.devnull) as reused:
        monkeypatch.setenv("PMI_FD", str(ours.fileno()))
        assert mpi.launched_by_mpi() and mpi.launch_size() == 3
        monkeypatch.setenv("PMI_FD", str(reused.fileno()))  # the number, now a child's file
        assert not mpi.launched_by_mpi()
        monkeypatch.setenv("PMI_FD", str(ours.fileno()))
    assert not mpi.launched_by_mpi() and mpi.launch_size() is None  # the socket closed
    monkeypatch.setenv("PYCOLL_MPI", "1")
    assert mpi.launched_by_mpi()


def test_a_data_mover_times_every_dtype_against_native_mpi_as_bytes(tmp_path):
    """mpi4py has no bfloat16 (and MPI no half-precision reductions): AllGather, Broadcast
    and AllToAll move bytes, so --against mpi times them on every dtype."""
    out = tmp_path / "rows.json"
    for collective in ("allgather", "broadcast", "alltoall", "sendrecv"):
        done = subprocess.run(
            [mpiexec(), "-n", "2", sys.executable, "-m", "pycoll", "bench", collective, "-b",
             "64", "-e", "64", "-n", "1", "-w", "0", "-d", "bfloat16,complex128,int8",
             "--against", "mpi", "--json", str(out)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        rows = json.loads(out.read_text())
        assert [r["type"] for r in rows] == ["bfloat16", "complex128", "int8"]
        assert all(r["native_time_us"] > 0 and r["wrong"] == 0 for r in rows)


def test_against_native_mpi_under_mpiexec(tmp_path):
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [mpiexec(), "-n", "2", sys.executable, "-m", "pycoll", "bench", "allreduce", "-b", "8",
         "-e", "64K", "-f", "16", "-n", "3", "-w", "1", "--algorithm", "ring,auto",
         "--against", "mpi", "--json", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "mpi(us)" in done.stdout and "ratio" in done.stdout
    rows = json.loads(out.read_text())
    assert len(rows) == 8 and all(r["native_time_us"] > 0 and r["wrong"] == 0 for r in rows)


@pytest.mark.parametrize("command,args,message", [
    ("bench", ["--iters", "0"], "iters=0"),
    ("bench", ["--ranks", "3"], "--ranks=3 runs in-process ranks, but this is one of 3 MPI"),
    ("compare", ["--ranks", "2"], "--ranks=2 runs in-process ranks, but this is one of 3 MPI"),
])
def test_a_bad_command_line_under_mpiexec_is_said_once(command, args, message):
    done = subprocess.run(
        [mpiexec(), "-n", "3", sys.executable, "-m", "pycoll", command, "allreduce", *args],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count(message) == 1, done.stderr
    assert done.stdout == "", done.stdout  # and nothing ran


def test_a_command_line_bad_on_one_rank_stops_every_rank(tmp_path):
    # rank 1 runs where --json's folder is missing: it says so (naming the rank), and rank 0
    # does not go on to wait for it in the benchmark
    (tmp_path / "a" / "out").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    line = [sys.executable, "-m", "pycoll", "bench", "allreduce", "-b", "1K", "-e", "1K",
            "--json", "out/rows.json"]
    done = subprocess.run(
        [mpiexec(), "-n", "1", "-wdir", str(tmp_path / "a"), *line,
         ":", "-n", "1", "-wdir", str(tmp_path / "b"), *line],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    said = "pycoll bench (rank 1): --json out/rows.json: cannot write a file there"
    assert done.stderr.count(said) == 1, done.stderr
    assert not (tmp_path / "a" / "out" / "rows.json").exists()


@pytest.mark.parametrize("rank_1,says", [
    (["-e", "4K"], "the ranks' command lines differ: --max-bytes '1K' on rank 0, '4K' on rank 1"),
    (["-n", "5", "-w", "3"], "the ranks' command lines differ: --iters 2 on rank 0, 5 on rank 1; "
                             "--warmup 1 on rank 0, 3 on rank 1"),
    (["--against", "mpi"], "--against None on rank 0, 'mpi' on rank 1"),
    (["env", "PYCOLL_HOST_TRANSPORT=mpi"],
     "the ranks' settings differ: PYCOLL_HOST_TRANSPORT 'auto' on rank 0, 'mpi' on rank 1"),
])
def test_ranks_given_different_command_lines_all_stop(rank_1, says):
    """Good command lines that differed between ranks passed the ranks' check, which shared
    only errors: a rank timing more sizes, iterations or warmups than its peers, or on shared
    memory while they were on MPI messages, left the job waiting forever."""
    line = [*PYTHON, "-m", "pycoll", "bench", "-b", "8", "-e", "1K", "-f", "4",
            "-n", "2", "-w", "1"]
    other = [*rank_1, *line] if rank_1[0] == "env" else [*line, *rank_1]
    done = subprocess.run([mpiexec(), "-n", "1", *line, ":", "-n", "1", *other],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count(says) == 1, done.stderr
    assert "pycoll bench: the ranks'" in done.stderr  # said once, by rank 0, for both ranks


def test_a_command_line_that_does_not_parse_on_one_rank_ends_the_job():
    """argparse exits before any MPI call: the rank's peers waited for it forever."""
    line = [*PYTHON, "-m", "pycoll", "bench", "-e", "1K", "-n", "1", "-w", "0"]
    done = subprocess.run([mpiexec(), "-n", "1", *line, ":", "-n", "1", *line, "-c", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "argument -c/--check: invalid choice: 2" in done.stderr


@pytest.mark.parametrize("command", [["demo"], ["explain", "allreduce"]])
def test_output_cut_short_is_no_traceback(command):
    """`pycoll demo | head -1` ended in BrokenPipeError and its traceback."""
    reader = subprocess.Popen([*PYTHON, "-m", "pycoll", *command],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              bufsize=1)
    assert reader.stdout.readline()
    reader.stdout.close()
    code = reader.wait(timeout=120)
    error = reader.stderr.read()
    assert "Traceback" not in error and "BrokenPipeError" not in error, error
    assert code in (0, 1)


def test_a_tuning_file_that_is_not_text_is_named(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\x00\xff\xfe")
    monkeypatch.setenv("PYCOLL_TUNING", str(bad))
    assert main(["bench", "--ranks", "2", "-e", "16", "-n", "1", "-w", "0"]) == 2
    assert f"tuning file {bad} is unreadable" in capsys.readouterr().err
    assert main(["model", "--topology", str(bad), "-e", "1K"]) == 2
    assert f"--topology {bad}: not JSON" in capsys.readouterr().err


def test_tune_refuses_an_empty_output_path(tmp_path, monkeypatch, capsys):
    """--output '' was taken as no --output: it wrote the default tuning file."""
    monkeypatch.setenv("PYCOLL_TUNING", str(tmp_path / "tuning.json"))
    assert main(["tune", "--output", ""]) == 2
    assert "--output '': not a file" in capsys.readouterr().err
    assert not (tmp_path / "tuning.json").exists()


@pytest.mark.parametrize("command,args,says", [
    ("bench", ["-d", "int8,float32", "-e", "1M"],
     "--max-bytes=1M: allreduce of 256K (int8) on 2 rank(s) of this machine needs about "
     "2.0 MiB of memory, more than the 1.0 MiB available; allowed: --max-bytes 128K or less"),
    ("bench", ["-b", "1M", "-e", "1M"], "allowed: --min-bytes and --max-bytes below 1M"),
    # --device shared keeps every size's buffers: 128K no longer fits beside those before it
    ("bench", ["-e", "1M", "--device", "shared"], "allreduce of 128K"),
    ("compare", ["-e", "4M"], "--max-bytes=4M: allreduce of 256K (float32)"),
    # direct AllReduce receives every peer's whole array: 2 + 3 arrays, not 2 + 2
    ("bench", ["-e", "128K", "--algorithm", "ring,direct"],
     "allreduce of 128K (float32) on 2 rank(s) of this machine needs about 1.2 MiB"),
])
def test_a_sweep_larger_than_the_memory_is_refused_before_measuring(monkeypatch, capsys,
                                                                     command, args, says):
    """numpy's allocations succeed lazily: -b 1G -e 100G measured 1G, then the system killed
    it (exit 137) at 2G, beyond the memory; only a MemoryError was caught. Available memory
    is faked (1 MiB) rather than anything large allocated: at 2 ranks, allreduce takes about
    4 times the array per rank (x, out and the schedules' working memory)."""
    from pycoll import cli, compare

    monkeypatch.setattr(cli, "_available_memory", lambda: 1 << 20)
    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("measured"))
    monkeypatch.setattr(compare, "run", lambda *a, **k: pytest.fail("measured"))
    assert main([command, "allreduce", "--ranks", "2", "-n", "1", "-w", "0", *args]) == 2
    assert says in capsys.readouterr().err


def test_a_sweep_that_fits_the_memory_runs(monkeypatch, capsys):
    from pycoll import cli

    if sys.platform == "linux":
        assert cli._available_memory() > 0
    monkeypatch.setattr(cli, "_available_memory", lambda: 1 << 20)
    assert main(["bench", "allreduce", "--ranks", "2", "-b", "8", "-e", "128K", "-f", "64",
                 "-n", "1", "-w", "0"]) == 0  # 8, 512 and 32K: 256 KiB at most


@pytest.mark.parametrize("collective", list(bench.COLLECTIVES))
def test_the_check_data_is_filled_a_chunk_at_a_time(monkeypatch, capsys, collective):
    """The check's data was made for all of x at once: several int64 and float64 arrays of
    its length, beyond the buffers the memory check counts. Chunks of 5 elements, so that
    the chunks split ranks' blocks and pieces, make the same data (#wrong 0)."""
    monkeypatch.setattr(bench, "CHECK_CHUNK", 5)
    assert main(["bench", collective, "--ranks", "3", "-b", "96", "-e", "96", "-n", "1",
                 "-w", "0", "-o", "min"]) == 0
    assert "out of bounds values: 0 OK" in capsys.readouterr().out


MEMORY_UNDER_MPIEXEC = """
import sys
from pycoll import cli
cli._available_memory = lambda: 1 << 20  # faked: nothing large is allocated
sys.exit(cli.main(["bench", "allreduce", "-e", "1M", "-n", "1", "-w", "0"]))
"""


@pytest.mark.parametrize("command,args,settings,message", [
    # each rank said each of these in turn (3 times)
    ("bench", ["broadcast", "-r", "3", "-e", "64"], {}, "--root=3 is not a rank; allowed: 0..2"),
    ("compare", ["broadcast", "-r", "5", "-e", "64"], {},
     "--root=5 is not a rank; allowed: 0..2"),  # was "broadcast: root=5"
    ("bench", ["allreduce", "-e", "64"], {"PYCOLL_TUNING": "bad.json"},
     "tuning file bad.json is unreadable"),
    ("compare", ["allreduce", "-e", "64"], {"PYCOLL_TUNING": "bad.json"},
     "tuning file bad.json is unreadable"),
    ("bench", ["broadcast", "-e", "64"], {"PYCOLL_ALGO": "direct"},
     "PYCOLL_ALGO forces 'direct' for broadcast, which it cannot serve"),
    ("compare", ["reduce", "-e", "64"], {"PYCOLL_ALGO": "direct"},
     "PYCOLL_ALGO forces 'direct' for reduce, which it cannot serve"),
    # the 3 ranks of one node share its memory: 3 x 4 x 128K is past 1 MiB
    ("-c", [MEMORY_UNDER_MPIEXEC], {}, "allreduce of 128K (float32) on 3 rank(s) of this "
                                       "machine"),
])
def test_what_the_run_would_refuse_is_said_once_before_it(tmp_path, command, args, settings,
                                                          message):
    import os

    (tmp_path / "bad.json").write_text("{bad")
    line = [sys.executable, "-c", *args] if command == "-c" else [
        sys.executable, "-m", "pycoll", command, *args, "-n", "1", "-w", "0",
        *(["--output", "cmp"] if command == "compare" else [])]
    done = subprocess.run([mpiexec(), "-n", "3", *line], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env={**os.environ, **settings})
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count(message) == 1, done.stderr
    assert "(rank" not in done.stderr and done.stdout == "", done.stdout + done.stderr


def test_kernel_bench_says_plainly_when_there_is_no_gpu(capsys):
    from pycoll import bench_kernels

    if bench_kernels.gpu_available():
        pytest.skip("a GPU is present: the measuring test below runs instead")
    assert main(["bench", "kernels", "-b", "1M", "-e", "1M"]) == 2
    assert capsys.readouterr().err == ("pycoll bench kernels: no CUDA GPU with CuPy found; it "
                                       "measures a GPU's kernels\n")  # its name said once


def test_device_bench_says_plainly_when_there_is_no_gpu(capsys):
    from pycoll import bench_kernels

    if bench_kernels.gpu_available():
        pytest.skip("a GPU is present: bench/gpu_check.sh runs --device cuda there")
    assert main(["bench", "--ranks", "2", "--device", "cuda", "-e", "1K"]) == 2
    assert "--device cuda needs CuPy and an NVIDIA GPU" in capsys.readouterr().err


def test_device_bench_runs_end_to_end_on_the_stand_in_device(monkeypatch, capsys):
    """--device cuda's own code (buffers, streams, upload, check) with a CuPy look-alike
    whose arrays live on the stand-in device; the GPU run is bench/gpu_check.sh's."""
    from fake_device import FakeDevice, cupy_look_alike

    from pycoll import spaces

    fake = FakeDevice(seed=5)
    monkeypatch.setitem(sys.modules, "cupy", cupy_look_alike(fake))
    spaces.register(fake)
    try:
        for collective in ("allreduce", "reduce_scatter", "allgather", "sendrecv"):
            assert main(["bench", collective, "--ranks", "3", "--device", "cuda", "--algorithm",
                         "all", "-b", "8", "-e", "64K", "-f", "8", "-n", "2", "-w", "1"]) == 0
    finally:
        spaces.unregister(fake)
    out = capsys.readouterr().out
    assert out.count("# out of bounds values: 0 OK") == 4 and "ring" in out


def test_kernel_bench_measures_every_kernel_on_a_gpu(capsys):
    from pycoll import bench_kernels

    if not bench_kernels.gpu_available():
        pytest.skip("no CUDA GPU")
    rows = bench_kernels.run([1 << 20], ["float32"], ["cupy", "numba"], repeats=2, batch=2)
    kernels = {(r.kernel, r.backend) for r in rows}
    assert {("copy", "cuda"), ("reduce", "cupy"), ("reduce_copy", "numba")} <= kernels
    assert [r.error for r in rows if r.error is not None] == []
    assert all(r.bandwidth > 0 for r in rows)


@pytest.mark.parametrize("collective,factor", [
    (Collective.ALLREDUCE, 2 * 4), (Collective.REDUCE_SCATTER, 4 + 1),
    (Collective.ALLGATHER, 1 + 4), (Collective.BROADCAST, 4), (Collective.REDUCE, 4 + 1),
    (Collective.ALLTOALL, 2 * 4),
])
def test_minimum_memory_traffic_reads_each_input_and_writes_each_output_once(collective,
                                                                              factor):
    from pycoll.bench import min_memory_traffic

    assert min_memory_traffic(collective, 1000, 4) == factor * 1000


def test_roofline_columns_report_a_share_of_the_node_bandwidth(capsys):
    assert main(["bench", "allreduce", "--ranks", "2", "-b", "64K", "-e", "256K", "-f", "4",
                 "-n", "2", "-w", "1", "--roofline"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert len(lines) == 2
    assert all(float(line.split()[-1]) > 0 for line in lines)


def test_roofline_is_for_host_memory(capsys):
    assert main(["bench", "--ranks", "2", "--device", "cuda", "--roofline"]) == 2
    assert "--roofline measures host memory" in capsys.readouterr().err


def test_rows_are_printed_and_saved_as_they_are_measured(monkeypatch, capsys, tmp_path):
    """A run stopped part way (a time limit, a failure) keeps the rows it measured: each is
    printed and the files rewritten as it comes, as nccl-tests prints."""
    measure = bench._measure
    measured = []

    def two_then_fail(options, collective, dtype, size, algorithm, comm, native):
        if len(measured) == 2 * 2:  # two rows, each measured by both ranks
            raise RuntimeError("stopped")
        row = measure(options, collective, dtype, size, algorithm, comm, native)
        measured.append(row)
        return row

    monkeypatch.setattr(bench, "_measure", two_then_fail)
    out, csv = tmp_path / "rows.json", tmp_path / "rows.csv"
    code = main(["bench", "allreduce", "--ranks", "2", "-b", "8", "-e", "8K", "-f", "4",
                 "-n", "2", "-w", "1", "--check", "1", "--json", str(out), "--csv", str(csv)])
    printed = capsys.readouterr()
    assert code == 2 and "stopped" in printed.err
    lines = printed.out.splitlines()
    assert lines[0].startswith("# pycoll bench allreduce: 2 ranks")
    assert lines[1].split() == ["#", "out-of-place", "in-place"] and "#wrong" in lines[2]
    assert [line.split()[0] for line in lines[3:]] == ["8", "32"]
    assert [r["size"] for r in json.loads(out.read_text())] == [8, 32]
    assert len(csv.read_text().splitlines()) == 1 + 2
    assert not list(tmp_path.glob("*.tmp"))


def test_a_collective_timeout_exits_2_not_1_which_says_wrong_values(monkeypatch, capsys):
    """gpu_check.sh reads exit 1 as a run that ended with #wrong > 0 (its rows count for the
    bar) and any other failure as one that did not finish: a timeout raised TimeoutError,
    which no handler caught, and under mpiexec the job aborted with 1."""
    def late(*args):
        raise pycoll.CollectiveTimeout("allreduce (ring): rank 0 waited 1 s at step 1 of 2 "
                                       "for rank(s) 1")

    monkeypatch.setattr(bench, "_measure", late)
    code = main(["bench", "allreduce", "--ranks", "2", "-b", "8", "-e", "8", "-n", "1", "-w",
                 "0"])
    assert code == 2 and "rank 0 waited 1 s" in capsys.readouterr().err


TIMED_OUT_BESIDE_A_STUCK_PEER = """
import sys, time
import pycoll
from mpi4py import MPI
from pycoll import bench, cli

def measure(*args):
    if MPI.COMM_WORLD.rank == 0:
        raise pycoll.CollectiveTimeout("allreduce (ring): rank 0 waited 1 s at step 1 of 2")
    time.sleep(60)  # where no deadline reaches (a wait on a GPU stream)

bench._measure = measure
sys.exit(cli.main(["bench", "allreduce", "-b", "8", "-e", "8", "-n", "1", "-w", "0"]))
"""


def test_a_collective_timeout_under_mpiexec_ends_the_job_with_2():
    """Returning 2 on the timed-out rank alone left the job to a peer stuck where no
    deadline reaches; the job is ended with 2 (gpu_check.sh's step then reads 2, not its own
    time limit)."""
    from test_mpi import mpiexec

    done = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-c",
                           TIMED_OUT_BESIDE_A_STUCK_PEER],
                          capture_output=True, text=True, timeout=50)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "rank 0 waited 1 s" in done.stderr


def test_json_to_stdout_is_written_once_and_the_table_goes_to_stderr(capsys):
    assert main(["bench", "reduce_scatter", "--ranks", "3", "-b", "24", "-e", "96", "-f", "4",
                 "-n", "1", "-w", "0", "--check", "1", "--json", "-"]) == 0
    printed = capsys.readouterr()
    rows = json.loads(printed.out)
    assert [r["size"] for r in rows] == [24, 96] and all(r["wrong"] == 0 for r in rows)
    assert printed.err.count("# pycoll bench") == 1  # one header: out of place, in place
    assert printed.err.count("#wrong") == 2
    *_, checked, mean = printed.err.rstrip().splitlines()
    assert checked == "# out of bounds values: 0 OK"
    assert mean.startswith("# Avg bus bandwidth    : ")


def _blocks_rotated(call):
    """``call`` (a pycoll collective taking ``out``) whose result's blocks come back rotated
    by one rank's share: a block placed at the wrong rank."""
    import numpy as np

    def wrong(x, *args, out=None, comm=None, **kwargs):
        result = call(x, *args, out=out, comm=comm, **kwargs)
        if out is not None:  # the benchmark's call (its own sums of #wrong pass no out)
            out[...] = np.roll(out.reshape(-1), out.size // comm.size).reshape(out.shape)
        return result

    return wrong


def _neighbours_block(x, op="sum", *, out=None, comm=None, **kwargs):
    """ReduceScatter that returns the next rank's block."""
    import pycoll

    whole = pycoll.allreduce(x, op, comm=comm)
    n, source = x.size // comm.size, (comm.rank + 1) % comm.size
    out[...] = whole[source * n:(source + 1) * n]
    return out


@pytest.mark.parametrize("collective,op,nranks", [
    ("allreduce", "sum", 4), ("allreduce", "prod", 2), ("allreduce", "min", 5),
    ("allreduce", "max", 6), ("reduce_scatter", "prod", 2), ("reduce_scatter", "min", 5),
    ("reduce_scatter", "max", 5), ("reduce_scatter", "sum", 3), ("allgather", "prod", 4),
])
def test_the_check_counts_a_misplaced_block(monkeypatch, capsys, collective, op, nranks):
    """#wrong must see a block at the wrong rank whatever the op and rank count (the values
    were once alike across blocks for prod at even rank counts and for min and max from 5
    ranks, and for -o prod in collectives that do not reduce)."""
    import pycoll

    faulty = (_neighbours_block if collective == "reduce_scatter"
              else _blocks_rotated(getattr(pycoll, collective)))
    monkeypatch.setattr(pycoll, collective, faulty)
    assert main(["bench", collective, "--ranks", str(nranks), "-b", str(64 * nranks), "-e",
                 str(64 * nranks), "-n", "1", "-w", "0", "-o", op, "--json", "-"]) == 1
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["wrong"] > 0


def _alltoall_faulty(fault):
    """AllToAll that exchanges nothing (``out = x``), or sends each peer the piece meant for
    the next one."""
    import numpy as np

    import pycoll

    real = pycoll.alltoall

    def wrong(x, *, out=None, comm=None, **kwargs):
        if fault == "nothing":
            out[...] = x
            return out
        pieces = x.reshape(comm.size, -1)
        return real(np.ascontiguousarray(np.roll(pieces, -1, axis=0)).reshape(x.shape), out=out,
                    comm=comm, **kwargs)

    return wrong


@pytest.mark.parametrize("fault", ["nothing", "next peer's piece"])
@pytest.mark.parametrize("piece", [86, 100, 101, 202])
def test_the_check_counts_an_alltoall_piece_for_another_peer(monkeypatch, capsys, fault, piece):
    """Every piece of a rank was alike where its length was a multiple of 101 (a piece sent to
    the wrong peer passed), and at 86 elements on 3 ranks an exchange of nothing passed."""
    import pycoll

    monkeypatch.setattr(pycoll, "alltoall", _alltoall_faulty(fault))
    size = str(piece * 3 * 4)
    assert main(["bench", "alltoall", "--ranks", "3", "-b", size, "-e", size, "-n", "1", "-w",
                 "0", "--json", "-"]) == 1
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["count"] == piece and rows[0]["wrong"] > 0


def test_an_op_in_capitals_is_the_op(capsys):
    assert main(["bench", "--ranks", "2", "-b", "8", "-e", "8", "-n", "1", "-w", "0",
                 "-o", "PROD", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["redop"] == "prod"


@pytest.mark.parametrize("collective,redop,root", [
    ("allreduce", "max", -1), ("reduce_scatter", "max", -1), ("allgather", "none", -1),
    ("alltoall", "none", -1), ("broadcast", "none", 1), ("reduce", "max", 1)])
def test_redop_and_root_read_as_nccl_tests_print_them(capsys, collective, redop, root):
    """"none" and -1 where the collective has no op or root, whatever -o and -r say (a root
    beyond the ranks is then ignored, as nccl-tests ignores it)."""
    r = "1" if root >= 0 else "5"
    assert main(["bench", collective, "--ranks", "2", "-b", "8", "-e", "8", "-n", "1",
                 "-w", "0", "-o", "max", "-r", r, "--json", "-"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert (row["redop"], row["root"]) == (redop, root)


@pytest.mark.parametrize("json_path,csv_path,message", [
    ("same", "same", "the same destination"),
    ("-", "-", "the same destination"),
    ("", None, "--json '': not a file; allowed: a file path, or - for stdout"),
])
def test_bench_refuses_outputs_that_would_clash(tmp_path, capsys, json_path, csv_path,
                                                message):
    """--json - --csv - printed JSON then CSV on stdout (neither parsed); one path for both
    kept the CSV alone; --json '' wrote <cwd>.tmp and raised IsADirectoryError."""
    args = ["bench", "--ranks", "2", "-b", "8", "-e", "8", "-n", "1", "-w", "0"]
    for flag, path in (("--json", json_path), ("--csv", csv_path)):
        if path is not None:
            args += [flag, str(tmp_path / path) if path not in ("-", "") else path]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_kernel_dtypes_are_read_one_by_one(monkeypatch):
    """nccl-tests' names each: float is float32 and half float16 (numpy would read 'float'
    as float64)."""
    from pycoll import bench_kernels

    seen = []
    monkeypatch.setattr(bench_kernels, "run", lambda sizes, dtypes, *args, **kwargs:
                        seen.append(dtypes) or [])
    main(["bench", "kernels", "-b", "1M", "-e", "1M", "-d", "float,half"])
    assert seen == [["float32", "float16"]]


def test_the_cli_module_runs_as_a_script():
    done = subprocess.run([sys.executable, "-m", "pycoll.cli", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "usage: pycoll" in done.stdout, done.stderr


def test_json_and_csv_go_through_a_symbolic_link(tmp_path):
    """As --json /dev/stdout would: the link is written through, not replaced by a file."""
    for flag, name in (("--json", "rows.json"), ("--csv", "rows.csv")):
        real, link = tmp_path / name, tmp_path / f"link-{name}"
        real.write_text("")
        link.symlink_to(real)
        assert main(["bench", "--ranks", "2", "-b", "8", "-e", "8", "-n", "1", "-w", "0",
                     flag, str(link)]) == 0
        assert link.is_symlink() and "allreduce" in real.read_text()


def test_json_to_dev_stdout_reaches_a_pipe():
    done = subprocess.run([sys.executable, "-m", "pycoll", "bench", "--ranks", "2", "-b", "8",
                           "-e", "8", "-n", "1", "-w", "0", "--json", "/dev/stdout"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count('"collective": "allreduce"') == 1


def test_without_the_check_nothing_is_said_to_be_right(capsys):
    """-c 0: #wrong is N/A (nccl-tests' word), null in JSON, and the footer says so."""
    assert main(["bench", "--ranks", "2", "-b", "8", "-e", "8", "-n", "1", "-w", "0", "-c", "0",
                 "--csv", "-"]) == 0
    captured = capsys.readouterr()  # the table on stderr, the CSV on stdout
    assert "N/A" in captured.err and "# out of bounds values: not checked (-c 0)" in captured.err
    header, row = captured.out.strip().splitlines()
    assert dict(zip(header.split(","), row.split(",")))["wrong"] == ""


@pytest.mark.parametrize("collective,count", [("allreduce", 8), ("allgather", 4),
                                              ("reduce_scatter", 4), ("alltoall", 4),
                                              ("broadcast", 8)])
def test_count_is_per_rank_where_nccl_tests_prints_it_so(capsys, collective, count):
    """size is the whole array's bytes; count, as nccl-tests prints it, each rank's elements
    where the array splits over the ranks (it was the whole array's)."""
    assert main(["bench", collective, "--ranks", "2", "-b", "32", "-e", "32", "-n", "1",
                 "-w", "0", "--json", "-"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert (row["size"], row["count"]) == (32, count)


@pytest.mark.parametrize("collective", [c for c in bench.COLLECTIVES if c != "sendrecv"])
def test_each_size_is_timed_and_checked_in_place_too(capsys, collective):
    """As nccl-tests' second set of columns: the same call in place (AllGather's x this rank's
    rows of out, ReduceScatter's out this rank's rows of x, the others out=x)."""
    assert main(["bench", collective, "--ranks", "3", "-b", "12", "-e", "1K", "-f", "8",
                 "-n", "2", "-w", "1", "--json", "-"]) == 0
    printed = capsys.readouterr()
    rows = json.loads(printed.out)
    factor = bench.bus_factor(bench.COLLECTIVES[collective], 3)
    assert len(rows) == 3
    for row in rows:
        assert row["in_place_wrong"] == 0 and row["in_place_time_us"] > 0
        assert row["in_place_algbw"] == pytest.approx(row["size"] / row["in_place_time_us"]
                                                      / 1e3)
        assert row["in_place_busbw"] == pytest.approx(row["in_place_algbw"] * factor)
    assert "in-place" in printed.err


def test_in_place_0_times_out_of_place_only(capsys):
    assert main(["bench", "allgather", "--ranks", "2", "-b", "8", "-e", "8", "-n", "1",
                 "-w", "0", "--in-place", "0", "--json", "-"]) == 0
    printed = capsys.readouterr()
    row = json.loads(printed.out)[0]
    assert row["wrong"] == 0 and row["in_place_time_us"] is None
    assert row["in_place_wrong"] is None and "in-place" not in printed.err


@pytest.mark.parametrize("collective", ["allgather", "reduce_scatter", "allreduce"])
def test_the_in_place_check_counts_what_only_the_in_place_call_gets_wrong(
        monkeypatch, capsys, collective):
    """A call wrong in place alone: out of place 0 wrong, in place one per rank, exit 1."""
    import numpy as np

    real = getattr(pycoll, collective)

    def wrong_in_place(x, *args, out=None, **kwargs):
        result = real(x, *args, out=out, **kwargs)
        if out is not None and np.shares_memory(x, out):
            out.reshape(-1)[0] += 1
        return result

    monkeypatch.setattr(pycoll, collective, wrong_in_place)
    assert main(["bench", collective, "--ranks", "3", "-b", "96", "-e", "96", "-n", "1",
                 "-w", "0", "--json", "-"]) == 1
    printed = capsys.readouterr()
    row = json.loads(printed.out)[0]
    assert (row["wrong"], row["in_place_wrong"]) == (0, 3)
    assert "# out of bounds values: 3 FAILED" in printed.err


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather", "reduce"])
@pytest.mark.parametrize("broken", ["ring", "tree"])
def test_compare_counts_an_algorithm_that_leaves_out_unwritten(monkeypatch, capsys, tmp_path,
                                                               collective, broken):
    """Every algorithm's check shared one out array: after the first had written the right
    result there, an algorithm that wrote nothing was counted 0 wrong (exit 0)."""
    real = bench._Case._call

    def call(case, algorithm):
        if algorithm != broken:
            real(case, algorithm)

    monkeypatch.setattr(bench._Case, "_call", call)
    assert main(["compare", collective, "--ranks", "3", "-b", "96", "-e", "96", "-n", "1",
                 "-w", "0", "--output", str(tmp_path / "c")]) == 1
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if line.startswith("| 96 B |"))
    # 24 float32 of out on each of 3 ranks; ReduceScatter's 8 each; Reduce's root's 24
    wrong = {"allreduce": 72, "reduce_scatter": 24, "allgather": 72, "reduce": 24}
    assert row.endswith(f"| {wrong[collective]} |"), table


def test_the_mean_bus_bandwidth_counts_every_row_in_both_sets():
    """nccl-tests' '# Avg bus bandwidth', which scripts read: the mean over every busbw
    printed, out of place and in place."""
    rows = [bench.Row("allreduce", 2, 8, 2, "float32", "sum", -1, "ring", 1.0, 1.0, busbw,
                      0, in_place_busbw=in_place, in_place_wrong=0)
            for busbw, in_place in [(1.0, 2.0), (3.0, 6.0)]]
    assert bench.format_footer(rows).splitlines() == [
        "# out of bounds values: 0 OK", "# Avg bus bandwidth    : 3"]
    rows[1].in_place_busbw = None  # --in-place 0
    assert bench.format_footer(rows).splitlines()[1] == "# Avg bus bandwidth    : 2"


@pytest.mark.parametrize("nranks", [2, 3])
def test_sendrecv_sends_to_the_next_rank_as_nccl_tests_sendrecv_perf(capsys, nranks):
    """Each rank sends to rank + 1 and receives from rank - 1; busbw = algbw; no redop, root
    or in-place columns (nccl-tests checks no in-place sendrecv; it would receive into what
    it sends)."""
    assert main(["bench", "sendrecv", "--ranks", str(nranks), "-b", "1", "-e", "1M", "-f",
                 "32", "-n", "2", "-w", "1", "-d", "int8", "--json", "-"]) == 0
    printed = capsys.readouterr()
    rows = json.loads(printed.out)
    assert [r["count"] for r in rows] == [1, 32, 1024, 32768, 1 << 20]
    for row in rows:
        assert row["wrong"] == 0 and row["in_place_time_us"] is None
        assert (row["redop"], row["root"], row["algorithm"]) == ("none", -1, "auto")
        assert row["busbw"] == pytest.approx(row["algbw"])
    assert "in-place" not in printed.err


def test_the_check_counts_a_message_from_the_wrong_rank(monkeypatch, capsys):
    """Sent to rank + 2 and received from rank - 2 (the pairs still match at 3 ranks): every
    element is another rank's."""
    import pycoll

    real_send, real_recv = pycoll.send, pycoll.recv

    def send(x, dst, *args, comm=None, **kwargs):
        return real_send(x, (dst + 1) % comm.size, *args, comm=comm, **kwargs)

    def recv(out, src, *args, comm=None, **kwargs):
        return real_recv(out, (src - 1) % comm.size, *args, comm=comm, **kwargs)

    monkeypatch.setattr(pycoll, "send", send)
    monkeypatch.setattr(pycoll, "recv", recv)
    assert main(["bench", "sendrecv", "--ranks", "3", "-b", "400", "-e", "400", "-n", "1",
                 "-w", "0", "--json", "-"]) == 1
    assert json.loads(capsys.readouterr().out)[0]["wrong"] == 3 * 100


@pytest.mark.parametrize("command,args,says", [
    ("bench", [], "sendrecv on 1 rank: each rank sends to the next and receives from the one "
                  "before, never itself; allowed: 2 ranks or more"),
    ("compare", ["--ranks", "2"], "collective='sendrecv' has one algorithm (direct)"),
    ("model", [], "collective='sendrecv'; allowed: allreduce"),
])
def test_sendrecv_is_refused_where_it_cannot_run(capsys, command, args, says):
    assert main([command, "sendrecv", *args]) == 2
    assert says in capsys.readouterr().err


def _shifted_within(call, at: int, by: int, length: int):
    """``call``, after which out[at:at + length] holds what out[at + by:...] should."""
    def faulty(*args, out=None, **kwargs):
        result = call(*args, out=out, **kwargs)
        result[at:at + length] = result[at + by:at + by + length].copy()
        return result

    return faulty


@pytest.mark.parametrize("collective,by", [("allreduce", 6), ("allgather", 101)])
def test_the_check_counts_a_block_moved_by_the_old_patterns_period(monkeypatch, capsys,
                                                                   collective, by):
    """Rank 0's reduced data was 1 + (exponent(i + 1) + i) mod 3, and moved data
    1 + (37r + 11i) mod 101: a block moved by a multiple of 3 (and of the rank count) within
    one power of two, or by 101 within a rank's block, read as right."""
    import pycoll

    monkeypatch.setattr(pycoll, collective, _shifted_within(getattr(pycoll, collective), 70,
                                                            by, 30))
    assert main(["bench", collective, "--ranks", "2", "-b", "4096", "-e", "4096", "-n", "1",
                 "-w", "0", "--in-place", "0", "-d", "int32", "--json", "-"]) == 1
    assert json.loads(capsys.readouterr().out)[0]["wrong"] > 0


def test_every_rank_ends_its_timed_calls_before_the_samples_are_gathered(monkeypatch):
    """In-process, a rank done first went on to gather the samples; preparing that gather
    (a shape not seen before) held the GIL through its peer's last timed call, which took
    about 10x as long: the first size's time, in bench and in compare."""
    events = []

    class Case:
        comm = pycoll.world()

        def call(self, algorithm):
            events.append("call")

    def gather(samples, op, comm):
        events.append("gather")
        return samples

    monkeypatch.setattr(bench.pycoll, "allreduce", gather)
    bench._time(Case(), "auto", bench.Options(iters=2, warmup=1), lambda: events.append(
        "barrier"), None)
    assert events == ["barrier", "call"] * 3 + ["barrier", "gather"]


def test_compare_ends_every_timed_call_before_the_samples_are_gathered(monkeypatch):
    from pycoll import compare

    events = []

    class Case:
        def __init__(self, options, collective, dtype, size, comm):
            self.count, self.x = size // dtype.itemsize, np.zeros(size // dtype.itemsize, dtype)

        def call(self, algorithm):
            events.append("call")

    def gather(samples, op, comm):
        events.append("gather")
        return samples

    monkeypatch.setattr(bench, "_Case", Case)
    monkeypatch.setattr(bench, "barrier_of", lambda comm: lambda: events.append("barrier"))
    monkeypatch.setattr(compare.pycoll, "allreduce", gather)
    options = bench.Options(min_bytes=64, max_bytes=64, iters=2, warmup=0, check=False)
    compare.run(options, pycoll.world(), algorithms=["ring"])
    assert events == ["barrier", "call"] * 4 + ["barrier", "gather"]  # ring and auto, twice


TINY_BENCH = ["bench", "--ranks", "2", "-b", "8", "-e", "32", "-n", "1", "-w", "0",
              "--in-place", "0"]


@pytest.mark.parametrize("other", ["./{name}", "link"])
def test_one_file_under_two_names_is_the_same_destination(tmp_path, monkeypatch, capsys,
                                                          other):
    """--json x --csv ./x (or a link to x) kept the CSV alone, the JSON silently lost."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").write_text("")
    (tmp_path / "link").symlink_to(tmp_path / "out")
    assert main([*TINY_BENCH, "--json", "out", "--csv", other.format(name="out")]) == 2
    assert "the same destination" in capsys.readouterr().err


def test_a_pipe_gets_the_rows_once_after_the_run(tmp_path, capsys):
    """A pipe took each row's rewrite in turn: three JSON arrays one after another."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    read: list[str] = []
    done = threading.Event()

    def drain():  # each writer's text, until the run is over
        while not done.is_set():
            text = fifo.read_text()
            if text:
                read.append(text)

    reader = threading.Thread(target=drain)
    reader.start()
    assert main([*TINY_BENCH, "--json", str(fifo)]) == 0
    done.set()
    fifo.open("w").close()  # the reader's last open returns
    reader.join(timeout=60)
    assert len(read) == 1, read
    assert [row["size"] for row in json.loads(read[0])] == [8, 16, 32]


def test_dev_stdout_is_stdout(tmp_path):
    """--json /dev/stdout with stdout sent to a file replaced that file (the table went to
    the replaced one); it is now '-': the JSON on stdout, the table on stderr."""
    out = tmp_path / "out.txt"
    with out.open("w") as stdout:
        done = subprocess.run([*PYTHON, "-m", "pycoll", *TINY_BENCH, "--json",
                               "/dev/stdout"], stdout=stdout, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [row["size"] for row in json.loads(out.read_text())] == [8, 16, 32]
    assert "# Avg bus bandwidth" in done.stderr


def test_an_output_that_cannot_be_written_is_named(tmp_path, monkeypatch, capsys):
    """A dangling link passed the folder check (its own folder exists) and the run ended in
    a FileNotFoundError traceback; a file the folder refuses (/proc/x) likewise."""
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "missing" / "x.json")
    assert main([*TINY_BENCH, "--json", str(dangling)]) == 2
    assert f"--json {dangling}: cannot write a file there" in capsys.readouterr().err

    def refused(text, path):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(bench, "write_whole", refused)
    path = tmp_path / "x.csv"
    assert main([*TINY_BENCH, "--csv", str(path)]) == 2
    assert f"--csv {path}: cannot write it (Permission denied)" in capsys.readouterr().err


def test_a_tuning_file_through_a_link_gets_its_target_folder(tmp_path):
    from pycoll import model, scaling

    link = tmp_path / "tuning.json"
    link.symlink_to(tmp_path / "made" / "here.json")
    model.save_tuning([("local", scaling.builtin_topologies()["ethernet"])], link)
    assert "local" in model.load_tuning(tmp_path / "made" / "here.json")
