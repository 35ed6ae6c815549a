"""The `pycoll` command: demo, explain, bench, tune, compare, model."""

from __future__ import annotations

import argparse
import io
import os
import sys

from pycoll.algorithms import FAMILIES

KERNEL_BACKENDS = "cupy,numba"  # `pycoll bench kernels --backend`'s default
# `pycoll bench`'s flags for collectives between ranks, with their defaults: refused by
# `bench kernels`, which would ignore them.
COLLECTIVE_ONLY_FLAGS = (
    ("-c", "check", 1), ("-r", "root", 0), ("--algorithm", "algorithm", "auto"),
    ("--against", "against", None), ("--ranks", "ranks", None), ("--device", "device", "host"),
    ("--roofline", "roofline", False),
)


def main(argv: list[str] | None = None) -> int:
    # one write per line, not the text then its newline: ranks of a job share the terminal,
    # and two ranks' errors ran together on one line
    if sys.stderr is sys.__stderr__ and isinstance(sys.stderr, io.TextIOWrapper):
        sys.stderr.reconfigure(line_buffering=True, write_through=False)
    # the tables' µ, ≥ and ×: shown as ? where the terminal's encoding has none (LC_ALL=C
    # without Python's UTF-8 coercion, PYTHONIOENCODING=latin-1), not a crash after measuring
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            stream.reconfigure(errors="replace")
    try:
        code = _main(argv)
        if sys.stdout is not None:  # None: the program was started with stdout closed
            sys.stdout.flush()  # a reader gone (`| head`) is found here at the latest
    except BrokenPipeError:
        # not an error to report: the reader has what it wanted; and none at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return code


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        prog="pycoll", description="Collective communication whose algorithms are checked data."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "demo", help="run every collective of the seed on 4 in-process ranks, then its FSDP step"
    )
    explain = commands.add_parser(
        "explain", help="print a schedule round by round on the seed's inputs, then the results"
    )
    explain.add_argument(
        "collective",
        choices=["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall"],
    )
    explain.add_argument("--ranks", type=int, default=4, help="rank count (default 4)")
    explain.add_argument("--algorithm", default=None, choices=sorted(FAMILIES),
                         help="default: ring (direct for alltoall)")
    explain.add_argument("--root", type=int, default=0, help="root of broadcast/reduce")
    explain.add_argument("--segments", type=int, default=1, help="segments per block")
    bench = commands.add_parser(
        "bench", help="time collectives over a size sweep (nccl-tests conventions)"
    )
    bench.add_argument("collective", nargs="?", default="allreduce",
                       help="allreduce (default), reduce_scatter, allgather, broadcast, reduce, "
                            "alltoall, sendrecv (to rank + 1, from rank - 1); or 'kernels' for "
                            "the GPU kernels' bandwidth")
    bench.add_argument("-b", "--min-bytes", default="8", help="smallest size (default 8)")
    bench.add_argument("-e", "--max-bytes", default="32M", help="largest size (default 32M)")
    bench.add_argument("-f", "--step-factor", type=int, default=2, help="size multiplier")
    bench.add_argument("-n", "--iters", type=int,
                       help="timed iterations (default 20; kernels: launches per timed batch, "
                            "default 10)")
    bench.add_argument("-w", "--warmup", type=int,
                       help="untimed iterations (default 5; kernels: launches before timing "
                            "each kernel, default 1)")
    bench.add_argument("-c", "--check", type=int, default=1, choices=(0, 1),
                       help="1: count #wrong; 0: skip")
    bench.add_argument("--in-place", type=int, default=1, choices=(0, 1),
                       help="1: time and check each call in place too (nccl-tests' second set "
                            "of columns); 0: out of place only")
    bench.add_argument("-d", "--dtype", default="float32",
                       help="dtype (default float32), a comma-separated list, or all")
    bench.add_argument("-o", "--op", default="sum",
                       help="sum (default), prod, min, max, avg; a comma-separated list, or all "
                            "(read where the collective reduces; kernels: one op)")
    bench.add_argument("-r", "--root", type=int, default=0)
    bench.add_argument("--algorithm", default="auto",
                       help="comma-separated families and/or auto, or 'all'")
    bench.add_argument("--against", choices=["mpi"], help="also time mpi4py's native collective")
    bench.add_argument("--ranks", type=int, help="in-process ranks (default: the MPI job)")
    bench.add_argument("--device", default="host", choices=["host", "shared", "cuda"],
                       help="host: numpy arrays; shared: numpy arrays from pycoll.empty; cuda: "
                       "CuPy arrays on the GPU (default host)")
    bench.add_argument("--roofline", action="store_true",
                       help="also report each row as a percentage of the node's memory roofline")
    bench.add_argument("--backend", default=KERNEL_BACKENDS,
                       help="kernels only: comma-separated GPU kernel backends")
    bench.add_argument("--json", metavar="PATH", help="write rows as JSON ('-' for stdout)")
    bench.add_argument("--csv", metavar="PATH", help="write rows as CSV ('-' for stdout)")
    tune = commands.add_parser(
        "tune", help="measure alpha, beta, gamma, delta of each transport here; write a tuning file"
    )
    tune.add_argument("--output", metavar="PATH",
                      help="tuning file (default: $PYCOLL_TUNING, else "
                           "$XDG_CACHE_HOME/pycoll/tuning.json, XDG_CACHE_HOME being ~/.cache "
                           "where unset)")
    tune.add_argument("--repeats", type=int, default=15, help="timed runs per point")
    tune.add_argument("-e", "--max-bytes", default="32M",
                      help="largest message and buffer measured (default 32M)")
    tune.add_argument("--ranks", default="2,4", help="in-process rank counts to tune at")
    compare = commands.add_parser(
        "compare", help="every algorithm and auto side by side against the model: table + PNG"
    )
    compare.add_argument("collective", nargs="?", default="allreduce")
    compare.add_argument("-b", "--min-bytes", default="8")
    compare.add_argument("-e", "--max-bytes", default="32M")
    compare.add_argument("-f", "--step-factor", type=int, default=2)
    compare.add_argument("-n", "--iters", type=int, default=15)
    compare.add_argument("-w", "--warmup", type=int, default=2)
    compare.add_argument("-d", "--dtype", default="float32", type=_dtype_name)
    compare.add_argument("-o", "--op", default="sum")
    compare.add_argument("-r", "--root", type=int, default=0)
    compare.add_argument("--ranks", type=int, help="in-process ranks (default: the MPI job)")
    compare.add_argument("--output", metavar="PREFIX",
                         help="writes PREFIX.md and PREFIX.png (default compare-COLLECTIVE-N)")
    scale = commands.add_parser(
        "model", help="predicted time and busbw per algorithm at scale, on a topology"
    )
    scale.add_argument("collective", nargs="?", default="allreduce")
    scale.add_argument("--ranks", default="8,64,512,4096", help="comma-separated rank counts")
    scale.add_argument("--topology", default="nvlink-ib",
                       help="a built-in name (nvlink-ib, ethernet), 'tuned', or a JSON file")
    scale.add_argument("-b", "--min-bytes", default="8")
    scale.add_argument("-e", "--max-bytes", default="1G")
    scale.add_argument("-f", "--step-factor", type=int, default=16)
    scale.add_argument("-d", "--dtype", default="float32", type=_dtype_name)
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # argparse's: usage said
        if stop.code not in (0, None):
            _stop_every_rank(int(stop.code))
        raise

    if args.command == "model":
        return _model(args)
    if args.command == "compare":
        return _compare(args, argv)
    if args.command == "tune":
        return _tune(args)
    if args.command == "bench":
        return _bench_kernels(args) if args.collective == "kernels" else _bench(args)

    from pycoll import explain as scenes

    try:
        if args.command == "demo":
            ok = scenes.demo()
        else:
            ok = scenes.explain(
                args.collective, args.ranks, args.algorithm, args.root, args.segments
            )
    except ValueError as error:
        print(f"pycoll {args.command}: {error}", file=sys.stderr)
        return 2
    return 0 if ok else 1


def _dtype_name(text: str) -> str:
    from pycoll.bench import dtype_name

    return dtype_name(text)


def _op_name(text: str) -> str:
    """An op's own name, in any case given ('SUM' is 'sum', as ReduceOp.parse reads it);
    a bad one is named by the benchmark's checks."""
    from pycoll.kernels import ReduceOp

    try:
        return ReduceOp.parse(text).value
    except (ValueError, TypeError):
        return text


def _ranks_flag(ranks: int | None) -> None:
    if ranks is None:
        return
    if ranks < 1:
        raise ValueError(f"--ranks={ranks}; allowed: an int >= 1 (in-process ranks)")
    from pycoll.bindings.mpi import launch_size

    # read off the launcher's variables, without starting MPI, which an in-process command
    # does not need (a shell or a child process may hold a launcher's leftover variables)
    size = launch_size()
    if size is not None and size > 1:
        raise ValueError(
            f"--ranks={ranks} runs in-process ranks, but this is one of {size} MPI "
            "processes; allowed: mpiexec (its processes are the ranks) or --ranks, not both "
            "(PYCOLL_MPI=0 where this process is no MPI rank but inherited a launcher's "
            "environment)"
        )


def _stop_every_rank(code: int) -> None:
    """In an MPI job of several ranks, end them all with ``code``: a rank whose command line
    did not parse stops before its peers' first collective, where they would wait for it."""
    from pycoll.bindings.mpi import launched_by_mpi

    if launched_by_mpi():
        from pycoll.comm import abort_job

        try:
            if _mpi_world().Get_size() > 1:
                abort_job(code)
        except Exception:  # noqa: BLE001 - no working MPI: nobody waits for this rank there
            pass


def _rank() -> int:
    """This process's rank in an MPI job, else 0."""
    from pycoll.bindings.mpi import launched_by_mpi

    if not launched_by_mpi():
        return 0
    return _mpi_world().Get_rank()


def _nranks(ranks: int | None) -> int:
    """The rank count a command runs at: --ranks in-process, else the MPI job's (1 alone)."""
    from pycoll.bindings.mpi import launched_by_mpi

    if ranks is not None:
        return ranks
    return _mpi_world().Get_size() if launched_by_mpi() else 1


def _ranks_here(ranks: int | None) -> int:
    """The ranks that share this machine's memory: --ranks in-process, else the MPI job's on
    this node. Collective under MPI: every rank calls it before its checks, not among them
    (a rank that failed an earlier check would skip it, and the others wait)."""
    from pycoll.bindings.mpi import launched_by_mpi, node_of_each_rank

    if ranks is not None or not launched_by_mpi():
        return 1 if ranks is None else max(ranks, 0)
    try:
        world = _mpi_world()
        nodes = node_of_each_rank(world) if world.Get_size() > 1 else [0]
        return nodes.count(nodes[world.Get_rank()])
    except Exception:  # noqa: BLE001 - no working MPI: _command_line_ok says so, rank by rank
        return 1


def _available_memory() -> int | None:
    from pycoll.bindings import shm

    return shm.available_memory()


def _mpi_world():
    """MPI_COMM_WORLD, for the command line's own checks: they make no pycoll communicator
    (collective), which a rank whose settings are bad would never join."""
    from pycoll.bindings.mpi import mpi

    return mpi().COMM_WORLD


def _settings_error() -> ValueError | None:
    """What making a communicator would raise about this rank's PYCOLL_* settings: checked
    with the command line, so that a rank whose environment differs stops every rank."""
    from pycoll import comm

    try:
        comm.check_environment()
    except ValueError as error:
        return error
    return None


def _command_line_ok(command: str, error: Exception | None,
                     args: argparse.Namespace | None = None) -> bool:
    """Whether every rank found its command line good. In an MPI job the ranks compare
    (a path may be writable on one node and not another): rank 0 says each distinct error
    once, naming the ranks when not all had it, and every rank stops, none left waiting.
    Good command lines must also agree: ``args`` (but the output paths, written by rank 0)
    and the PYCOLL_* settings that decide the messages (a rank timing more sizes, or more
    iterations, than its peers would wait for them forever)."""
    from pycoll.bindings.mpi import launch_size, launched_by_mpi
    from pycoll.comm import settings_disagreement, shared_settings

    error = _settings_error() or error  # a bad setting first: the rest may follow from it
    message = None if error is None else str(error)
    options = {} if args is None else {name: value for name, value in vars(args).items()
                                       if name not in _OUTPUT_PATHS}
    mine = (message, shared_settings() if error is None else None, options)
    gathered, rank = [mine], 0
    in_process = getattr(args, "ranks", None) is not None
    if launched_by_mpi() and not (in_process and (launch_size() or 1) == 1):
        try:
            world = _mpi_world()
            rank = world.Get_rank()
            if world.Get_size() > 1:
                gathered = world.allgather(mine)
        except Exception:  # no working MPI: each rank says its own
            gathered, rank = [mine], 0
    messages = [m for m, _, _ in gathered]
    if all(m is None for m in messages):
        differ = (settings_disagreement([settings for _, settings, _ in gathered])
                  or _options_disagreement([options for _, _, options in gathered]))
        messages = [differ] * len(gathered)
    bad = [(r, m) for r, m in enumerate(messages) if m is not None]
    if rank == 0:
        for message in dict.fromkeys(m for _, m in bad):
            ranks = [r for r, m in bad if m == message]
            where = "" if len(ranks) == len(messages) else f" (rank {', '.join(map(str, ranks))})"
            print(f"{command}{where}: {message}", file=sys.stderr)
    return not bad


_OUTPUT_PATHS = ("json", "csv", "output")  # where rank 0 writes: may differ between ranks


def _options_disagreement(tables: list[dict[str, object]]) -> str | None:
    """What differs between ranks' command lines (rank r's options at ``tables[r]``), in
    words; None when nothing does."""
    from pycoll.comm import differences

    parts = differences(tables, lambda name: name if name in ("collective", "command")
                        else "--" + name.replace("_", "-"))
    if not parts:
        return None
    return ("the ranks' command lines differ: " + "; ".join(parts)
            + "; allowed: the same on every rank")


def _writable(path: str | None, flag: str, makes_folders: bool = False,
              stdout: bool = True) -> None:
    """Fail before measuring, not after: ``path`` ('-': stdout, where ``stdout``) must be
    writable (``makes_folders``: the writer creates missing folders, so the nearest existing
    one)."""
    allowed = "a file path, or - for stdout" if stdout else "a file path"
    if path is None or (stdout and path == "-"):
        return
    if not path or path == "-":  # "" would name the current folder
        raise ValueError(f"{flag} {path!r}: not a file; allowed: {allowed}")
    folder = os.path.dirname(os.path.realpath(path))  # a link's target is what is written
    while makes_folders and not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {path}: cannot write a file there")


def _outputs(json_path: str | None, csv_path: str | None) -> tuple[str | None, str | None]:
    """--json's and --csv's paths as ``bench.destination`` reads them (/dev/stdout is -);
    refused where they cannot be written, or name one file (also by another name: ./x and x,
    a link, /dev/stdout and -)."""
    from pycoll import bench

    json_path, csv_path = bench.destination(json_path), bench.destination(csv_path)
    _writable(json_path, "--json")
    _writable(csv_path, "--csv")
    if json_path is None or csv_path is None:
        return json_path, csv_path
    if (json_path == csv_path if "-" in (json_path, csv_path)
            else os.path.realpath(json_path) == os.path.realpath(csv_path)):  # one overwrites
        raise ValueError(f"--json {json_path} --csv {csv_path}: the same destination; "
                         "allowed: different files, or - for one of them")
    return json_path, csv_path


def _bench(args: argparse.Namespace) -> int:
    import pycoll
    from pycoll import bench, model
    from pycoll.algorithms import families_for

    here = _ranks_here(args.ranks)
    try:
        names = list(dict.fromkeys(a.strip() for a in args.algorithm.split(",") if a.strip()))
        if "all" in names and len(names) > 1:
            raise ValueError(f"--algorithm={args.algorithm!r}: 'all' stands alone (it is every "
                             "family and auto)")
        if names == ["all"]:
            collective = bench.COLLECTIVES.get(args.collective)
            names = (families_for(collective) + ["auto"]) if collective else ["auto"]
        options = bench.Options(
            collective=args.collective,
            min_bytes=bench.parse_size(args.min_bytes, "--min-bytes"),
            max_bytes=bench.parse_size(args.max_bytes, "--max-bytes"),
            step_factor=args.step_factor,
            iters=bench.Options.iters if args.iters is None else args.iters,
            warmup=bench.Options.warmup if args.warmup is None else args.warmup,
            check=bool(args.check),
            dtype=args.dtype,
            op=_op_name(args.op),
            root=args.root,
            algorithms=tuple(names),
            against=args.against,
            device=args.device,
            roofline=args.roofline,
            in_place=(bool(args.in_place)
                      and bench.COLLECTIVES.get(args.collective) not in bench.NO_IN_PLACE),
        )
        runs = bench.combinations(options)  # one per (dtype, op) of -d and -o
        if args.backend != KERNEL_BACKENDS:
            raise ValueError(f"--backend={args.backend!r} is for `pycoll bench kernels` only; "
                             f"collective={args.collective!r} runs on --device")
        _ranks_flag(args.ranks)
        # every pair, before any is measured
        bench.check_sweeps(runs, _nranks(args.ranks), here, _available_memory())
        model.load_tuning()  # unreadable: said here, once, not by the first collective
        args.json, args.csv = _outputs(args.json, args.csv)
        if args.ranks is not None and args.against:
            raise ValueError("--against mpi needs MPI ranks: run under mpiexec, not --ranks")
    except (ValueError, TypeError, RuntimeError) as error:
        bad = error
    else:
        bad = None
    if not _command_line_ok("pycoll bench", bad, args):
        return 2
    # Rows are printed (and the files rewritten) on rank 0 as they are measured, so a run
    # stopped by a time limit keeps them; with --json - or --csv -, stdout is the machine's
    # and the table goes to stderr.
    if args.ranks is not None:
        size, where = args.ranks, "in-process"
    else:
        try:
            comm = pycoll.world()
        except ValueError as error:  # a bad setting (PYCOLL_TIMEOUT=x), the same on every rank
            print(f"pycoll bench: {error}", file=sys.stderr)
            return 2
        size, where = comm.size, "MPI" if comm.mpi_comm else "in-process"
    title = (f"pycoll bench {options.collective}: {size} ranks ({where}), "
             f"iters {options.iters}, warmup {options.warmup}, median of the slowest rank")
    stream = bench.RowStream(title, against=options.against is not None,
                             roofline=options.roofline, json_path=args.json,
                             csv_path=args.csv,
                             out=sys.stderr if "-" in (args.json, args.csv) else None,
                             in_place=options.in_place)

    def run_all(comm: pycoll.Communicator) -> list[bench.Row]:
        return [row for each in runs for row in bench.run(each, comm, stream)]

    try:
        if args.ranks is not None:
            rows, rank = pycoll.run_local(args.ranks, lambda: run_all(pycoll.world()))[0], 0
        else:
            rows, rank = run_all(comm), comm.rank
            if options.device == "cuda" and size > 1:
                # every rank unmaps its peers' CUDA IPC memory before any is freed (at exit
                # the interpreter would free it in no order, still mapped); collective, as here
                comm.free_device_buffers()
    except (ValueError, TypeError, RuntimeError, TimeoutError) as error:
        # a collective's timeout too: exit 1 says the run ended with wrong values, no more
        print(f"pycoll bench: {error}", file=sys.stderr)
        if (isinstance(error, (TimeoutError, bench.OutputError)) and args.ranks is None
                and size > 1):
            from pycoll.comm import abort_job

            # a peer may wait where no deadline reaches (a GPU stream), or in the next
            # size's collective for rank 0, which alone writes the files
            abort_job(2)
        return 2
    except MemoryError:
        print(f"pycoll bench: --max-bytes={args.max_bytes}: cannot allocate the buffers",
              file=sys.stderr)
        return 2
    if rank == 0:
        try:
            stream.close(rows)
        except bench.OutputError as error:  # the peers are done: they wait for nothing
            print(f"pycoll bench: {error}", file=sys.stderr)
            return 2
    return 0 if all(not r.all_wrong() for r in rows) else 1  # None: not checked


def _compare(args: argparse.Namespace, argv: list[str] | None) -> int:
    import pycoll
    from pycoll import bench, compare, model

    here = _ranks_here(args.ranks)
    try:
        options = bench.Options(
            collective=args.collective,
            min_bytes=bench.parse_size(args.min_bytes, "--min-bytes"),
            max_bytes=bench.parse_size(args.max_bytes, "--max-bytes"),
            step_factor=args.step_factor,
            iters=args.iters, warmup=args.warmup, dtype=args.dtype, op=_op_name(args.op),
            root=args.root,
        )
        if bench.COLLECTIVES.get(args.collective) in bench.ONE_ALGORITHM:
            raise ValueError(f"collective={args.collective!r} has one algorithm (direct): "
                             "nothing to compare")
        if args.collective not in bench.COLLECTIVES:
            raise ValueError(f"collective={args.collective!r} is unknown; allowed: " + ", ".join(
                name for name, c in bench.COLLECTIVES.items() if c not in bench.ONE_ALGORITHM))
        bench.validate(options)
        _ranks_flag(args.ranks)
        if args.output in ("", "-"):  # "" would name the current folder
            raise ValueError(f"--output {args.output!r}: not a file; allowed: a file path")
        nranks = _nranks(args.ranks)
        bench.check_sweeps([options], nranks, here, _available_memory())
        model.load_tuning()  # unreadable: said here, once, not by the first collective
        for suffix in (".md", ".png"):  # the two files it writes (no --output: here)
            _writable(f"{args.output or f'compare-{args.collective}-{nranks}'}{suffix}",
                      "--output" if args.output else "without --output,", stdout=False)
    except (ValueError, TypeError) as error:
        bad = error
    else:
        bad = None
    if not _command_line_ok("pycoll compare", bad, args):
        return 2
    try:
        if args.ranks is not None:
            result = pycoll.run_local(
                args.ranks, lambda: compare.run(options, pycoll.world())
            )[0]
            rank = 0
        else:
            comm = pycoll.world()
            result, rank = compare.run(options, comm), comm.rank
    except (ValueError, TypeError) as error:
        print(f"pycoll compare: {error}", file=sys.stderr)
        return 2
    except MemoryError:
        print(f"pycoll compare: --max-bytes={args.max_bytes}: cannot allocate the buffers",
              file=sys.stderr)
        return 2
    if rank != 0:
        return 0
    words = ["pycoll", "compare", *(sys.argv[1:] if argv is None else argv)[1:]]
    if result.where == "MPI":
        words = ["mpiexec", "-n", str(result.nranks), *words]
    result.command = " ".join(words)
    prefix = args.output or f"compare-{args.collective}-{nranks}"
    text = result.markdown().replace("# ", "# pycoll compare: ", 1)
    print(text, flush=True)  # a terminal that cannot show µ or ≥ gets ? (see main)
    try:
        try:
            compare.plot(result, f"{prefix}.png")
            link = f"\n![busbw against size]({prefix.rsplit('/', 1)[-1]}.png)\n"
            wrote = f" and {prefix}.png"
        except ImportError:  # matplotlib is an extra: the table stands without its plot
            link, wrote = "", (" (no plot: matplotlib is not installed; pip install "
                               "matplotlib, pycoll's plot extra)")
        with open(f"{prefix}.md", "w", encoding="utf-8") as f:
            f.write(text + "\n" + link)
    except OSError as error:  # the folder changed since it was checked
        print(f"pycoll compare: {error}", file=sys.stderr)
        return 2
    print(f"wrote {prefix}.md{wrote}")
    return 0 if all(sum(p.wrong.values()) == 0 for p in result.points) else 1


# pycoll model's largest rank count: pricing a size there takes about a minute (its time and
# memory grow with the ranks; 10**11 ranks filled memory without a word)
MODEL_MAX_RANKS = 1 << 16


def _model(args: argparse.Namespace) -> int:
    import numpy as np

    from pycoll import bench, scaling
    from pycoll.kernels import check_dtype

    try:
        collective = bench.COLLECTIVES.get(args.collective)
        if collective is None or collective in bench.ONE_ALGORITHM:
            raise ValueError(f"collective={args.collective!r}; allowed: allreduce, "
                             "reduce_scatter, allgather, broadcast, reduce")
        try:
            ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
        except ValueError:
            ranks = []
        if not ranks or any(not 1 <= r <= MODEL_MAX_RANKS for r in ranks):
            raise ValueError(f"--ranks={args.ranks!r}; allowed: comma-separated ints from 1 "
                             f"to {MODEL_MAX_RANKS}")
        topology = scaling.topology_named(args.topology)
        itemsize = np.dtype(check_dtype(args.dtype)).itemsize
        low = bench.parse_size(args.min_bytes, "--min-bytes")
        high = bench.parse_size(args.max_bytes, "--max-bytes")
        swept = bench.sizes(low, high, args.step_factor)
        # whole elements, as bench measures them (1 B of float64 is no element)
        sizes = sorted({s // itemsize * itemsize for s in swept} - {0})
        if not sizes:
            # the sweep's sizes are all below one element: its first size must hold one
            # (the next step may pass --max-bytes, as 1 B x 16 passes 8 B)
            advice = (f"--min-bytes {itemsize}" + (f" to {high}" if high > itemsize else "")
                      if high >= itemsize else f"--min-bytes and --max-bytes {itemsize} or more")
            raise ValueError(f"--min-bytes={args.min_bytes} --max-bytes={args.max_bytes} "
                             f"--step-factor={args.step_factor} sweep no whole element of "
                             f"{args.dtype} ({itemsize} B): they measure "
                             f"{', '.join(map(str, swept))} B only; allowed: {advice}")
        plan = scaling.sweep(collective, ranks, sizes, topology, itemsize=itemsize)
        if not plan.keys():
            raise ValueError(f"--max-bytes={args.max_bytes} holds no whole {args.dtype} row "
                             f"per rank at --ranks={args.ranks} ({collective.value} splits "
                             "evenly, as bench does); allowed: a larger --max-bytes")
    except (ValueError, TypeError) as error:
        print(f"pycoll model: {error}", file=sys.stderr)
        return 2
    # tree against ring at each rank count with rows, where both apply there
    compared = [p for p in ranks if plan.sizes[p] and all(
        scaling.applies(collective, family, p, topology) for family in ("tree", "ring"))]
    compared = compared if {"ring", "tree"} <= set(plan.families) else []
    scanned = {p: scaling.crossover_sizes(collective, p, sizes[0], sizes[-1], itemsize)
               for p in compared}
    workers = scaling.workers_for(collective, ranks, topology)
    try:  # a topology's costs may be read only when priced
        with scaling.Pricer(collective, topology, itemsize, workers) as price:
            price.prefetch(plan.keys() + [(family, p, nbytes) for p in compared
                                          for nbytes in scanned[p] for family in ("tree", "ring")])
            print(scaling.format_header(collective, plan.families, topology), flush=True)
            for row in scaling.rows(plan, price):  # each row as soon as it is priced
                print(scaling.format_row(row), flush=True)
            for p in compared:  # the sizes as measured there (whole rows per rank)
                span = scanned[p] or sizes
                first, last = (bench.size_text(s, flag=False) for s in (span[0], span[-1]))
                size = scaling.crossover(collective, p, topology, "tree", "ring", low=sizes[0],
                                         high=sizes[-1], itemsize=itemsize, price=price)
                where = (f"at no size from {first} to {last}" if size is None else
                         f"up to {bench.size_text(size, flag=False)} at least (scanned {first} "
                         f"to {last})")
                print(f"# {p} ranks: tree predicted faster than ring {where} (sizes x4 apart)")
    except (ValueError, TypeError) as error:
        print(f"pycoll model: {error}", file=sys.stderr)
        return 2
    return 0


def _tune(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pycoll import bench, tune

    try:
        if args.repeats < 1:
            raise ValueError(f"--repeats={args.repeats}; allowed: an int >= 1")
        largest = bench.parse_size(args.max_bytes, "--max-bytes")
        sizes = [b for b in tune.STEP_SIZES if b <= largest]
        # the host's sums and copies at two sizes whatever -e says: fitted through one small
        # point they came out 20x slow (cheap to measure, alone in memory)
        local = [b for b in tune.LOCAL_SIZES if b <= largest]
        local = local if len(local) >= 2 else tune.LOCAL_SIZES[:2]
        try:
            local_ranks = tuple(int(r) for r in args.ranks.split(",") if r.strip())
        except ValueError:
            local_ranks = ()
        if not local_ranks or any(r < 2 for r in local_ranks):
            raise ValueError(f"--ranks={args.ranks!r}; allowed: rank counts >= 2, "
                             "comma-separated")
        if len(sizes) < 2:  # a line (fixed cost and cost per byte) needs two sizes
            raise ValueError(f"--max-bytes={args.max_bytes!r} leaves {len(sizes)} size(s) of "
                             f"{tune.STEP_SIZES[:2]} to fit; allowed: {tune.STEP_SIZES[1]} "
                             "bytes or more")
        from pycoll import model

        # before measuring: where it will write, whether named or not
        named = args.output is not None  # --output '' names no file: refused, not the default
        _writable(args.output if named else str(model.tuning_path()),
                  "--output" if named else f"the tuning file (${model.TUNING_ENV}, else the "
                  "cache folder)", makes_folders=True, stdout=False)
        target = Path(args.output) if named else model.tuning_path()
        if model.holds_one_topology(target):  # it was replaced, the topology lost
            raise ValueError(f"{'--output' if named else model.TUNING_ENV} {target} "
                             f"{model.HOLDS_ONE_TOPOLOGY}; allowed: a tuning file, or a new path")
    except (ValueError, OSError) as error:
        bad = error
    else:
        bad = None
    if not _command_line_ok("pycoll tune", bad, args):  # under mpiexec: every rank stops, or none
        return 2
    if largest < tune.CURVE_FROM and _rank() == 0:
        print(f"pycoll tune: note: --max-bytes={args.max_bytes} measures exchange steps below "
              f"{tune.CURVE_FROM >> 10} KiB only, where a step's time is mostly its fixed "
              "cost: the fitted cost per byte is rough (the default -e 32M reads it)",
              file=sys.stderr)
    try:
        tune.tune(None if args.output is None else Path(args.output), args.repeats, sizes,
                  local_ranks, local_sizes=local)
    except (ValueError, OSError) as error:
        print(f"pycoll tune: {error}", file=sys.stderr)
        return 2
    return 0


def _bench_kernels(args: argparse.Namespace) -> int:
    from pycoll import bench, bench_kernels

    try:
        for flag, name, default in COLLECTIVE_ONLY_FLAGS:
            if getattr(args, name) != default:
                raise ValueError(
                    f"{flag}={getattr(args, name)!r} does not apply to kernels (one process, "
                    "the GPU's kernels alone); allowed: -b -e -f -n -w -d -o --backend --json "
                    "--csv")
        args.json, args.csv = _outputs(args.json, args.csv)
        sizes = bench.sizes(bench.parse_size(args.min_bytes, "--min-bytes"),
                            bench.parse_size(args.max_bytes, "--max-bytes"), args.step_factor)
        dtypes = bench.listed(args.dtype, "--dtype", bench.gpu_dtypes(), bench.dtype_name)
        backends = [b.strip() for b in args.backend.split(",") if b.strip()]
        # Each row is printed (and the JSON rewritten) as measured: a killed run keeps them.
        counts = {"batch": args.iters, "warmup": args.warmup}
        rows = bench_kernels.run(
            sizes, dtypes, backends, args.op,
            **{name: value for name, value in counts.items() if value is not None},
            on_row=bench_kernels.stream_rows(
                args.json, args.csv, out=sys.stderr if "-" in (args.json, args.csv) else None))
    except (ValueError, TypeError, RuntimeError) as error:
        print(f"pycoll bench kernels: {error}", file=sys.stderr)
        return 2
    try:
        bench.write_outputs(bench_kernels.outputs(args.json, args.csv), rows, at_end=True)
    except bench.OutputError as error:
        print(f"pycoll bench kernels: {error}", file=sys.stderr)
        return 2
    failed = sorted({f"{r.kernel}/{r.backend}" for r in rows if r.error is not None})
    if failed:
        print(f"pycoll bench kernels: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
