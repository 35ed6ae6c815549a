"""`pycoll bench`: collective microbenchmarks with nccl-tests' conventions.

* size is the bytes of the whole array (for AllGather the gathered output, for ReduceScatter
  the input), count its elements (per rank for AllGather, ReduceScatter and AllToAll: each
  rank's input, output or piece for each peer, as nccl-tests prints it); algbw = size / time
  with GB = 1e9 bytes; busbw = algbw × 2(n−1)/n for AllReduce, × (n−1)/n for ReduceScatter,
  AllGather and AllToAll, × 1 for Broadcast and Reduce.
* Every iteration runs between barriers and its time is the slowest rank's; the median over
  iterations is reported.
* ``--against mpi`` times mpi4py's native collective on the same buffers in the same run,
  interleaved iteration by iteration with pycoll's, so both see the same machine.
* ``--check`` runs each size once more on integer-valued data and counts the elements that
  differ from the numpy oracle (``#wrong``).
* As nccl-tests, each size is timed and checked out of place, then in place (``--in-place 0``:
  out of place only): AllReduce, Reduce and AllToAll with ``out=x``, AllGather with ``x`` this
  rank's rows of ``out``, ReduceScatter with ``out`` this rank's rows of ``x``; Broadcast has
  one form, in place, timed twice.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import TextIO

import numpy as np

import pycoll
from pycoll import oracle, select
from pycoll.algorithms import families_for
from pycoll.comm import Communicator
from pycoll.kernels import SUPPORTED_DTYPES, ReduceOp, check_dtype, check_op_for_dtype
from pycoll.schedule import REDUCING, ROOTED, SHARDED, Collective

COLLECTIVES = {
    "allreduce": Collective.ALLREDUCE,
    "reduce_scatter": Collective.REDUCE_SCATTER,
    "allgather": Collective.ALLGATHER,
    "broadcast": Collective.BROADCAST,
    "reduce": Collective.REDUCE,
    "alltoall": Collective.ALLTOALL,
    "sendrecv": Collective.SENDRECV,  # nccl-tests' sendrecv_perf: to rank + 1, from rank - 1
}
ONE_ALGORITHM = (Collective.ALLTOALL, Collective.SENDRECV)  # direct, and nothing to select
NO_IN_PLACE = (Collective.SENDRECV,)  # it would receive into what it sends (nccl-tests: unchecked)
CHECK_CHUNK = 1 << 20  # elements of the oracle computed at a time, to bound its memory
DEVICES = ("host", "shared", "cuda")


def bus_factor(collective: Collective, nranks: int) -> float:
    """nccl-tests' busbw / algbw, so that busbw is comparable across rank counts."""
    if collective is Collective.ALLREDUCE:
        return 2 * (nranks - 1) / nranks
    if collective in SHARDED:
        return (nranks - 1) / nranks
    return 1.0


def parse_size(text: str, flag: str = "size") -> int:
    """'8', '64K', '32M', '1G' (powers of 1024, as nccl-tests) into bytes; ``flag`` names
    the value in an error."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"{flag}={text!r} is invalid; allowed: an int with optional K, M or G")
    return int(match.group(1)) * 1024 ** " KMG".index(match.group(2).upper() or " ")


def sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    if min_bytes < 1 or max_bytes < min_bytes:
        raise ValueError(
            f"--min-bytes={min_bytes} --max-bytes={max_bytes}; allowed: 1 <= min <= max"
        )
    if factor < 2:
        raise ValueError(f"--step-factor={factor}; allowed: an int >= 2")
    out, size = [], min_bytes
    while size <= max_bytes:
        out.append(size)
        size *= factor
    return out


@dataclass
class Row:
    collective: str
    nranks: int
    size: int
    count: int
    type: str
    redop: str
    root: int
    algorithm: str
    time_us: float
    algbw: float
    busbw: float
    wrong: int | None  # None: not checked (-c 0), as nccl-tests' N/A
    native_time_us: float | None = None
    native_busbw: float | None = None
    ratio: float | None = None
    roofline_pct: float | None = None  # of the memory roofline (--roofline)
    native_roofline_pct: float | None = None
    # the same call in place (None: --in-place 0), as nccl-tests' second set of columns
    in_place_time_us: float | None = None
    in_place_algbw: float | None = None
    in_place_busbw: float | None = None
    in_place_wrong: int | None = None

    def all_wrong(self) -> int | None:
        """#wrong out of place and in place together (None: not checked)."""
        if self.wrong is None:
            return None
        return self.wrong + (self.in_place_wrong or 0)


@dataclass
class Options:
    collective: str = "allreduce"
    min_bytes: int = 8
    max_bytes: int = 32 << 20
    step_factor: int = 2
    iters: int = 20
    warmup: int = 5
    check: bool = True
    dtype: str = "float32"
    op: str = "sum"
    root: int = 0
    algorithms: tuple[str, ...] = ("auto",)
    against: str | None = None
    # host: numpy arrays; shared: numpy arrays from pycoll.empty (in the node's shared
    # memory, sent without a copy); cuda: CuPy arrays on this rank's GPU
    device: str = "host"
    roofline: bool = False  # also report each row against the node's memory roofline
    in_place: bool = True  # also time and check each call in place, as nccl-tests


# nccl-tests' -d names where numpy reads them otherwise ("float" is float64 to numpy)
NCCL_TESTS_DTYPES = {"float": "float32", "double": "float64", "half": "float16",
                     "int": "int32", "char": "int8"}


def dtype_name(text: str) -> str:
    """``-d``'s name as nccl-tests reads it (float: float32, int: int32, half, double, char),
    else numpy's."""
    return NCCL_TESTS_DTYPES.get(text.strip().lower(), text.strip())


def validate(options: Options) -> Collective:
    if options.collective not in COLLECTIVES:
        raise ValueError(
            f"collective={options.collective!r} is unknown; allowed: {', '.join(COLLECTIVES)}"
        )
    collective = COLLECTIVES[options.collective]
    for flag, text in (("--dtype", options.dtype), ("--op", options.op)):
        if "," in str(text) or str(text).strip().lower() == ALL:  # (numpy would read a
            # structured dtype): combinations() gives each of a list its own Options
            raise ValueError(f"{flag}={text!r}: one per run; allowed: one name (`pycoll "
                             "bench` takes a comma-separated list or all)")
    check_dtype(options.dtype)
    ReduceOp.parse(options.op)
    if options.iters < 1 or options.warmup < 0:
        raise ValueError(f"--iters={options.iters} --warmup={options.warmup}; "
                         "allowed: iters >= 1, warmup >= 0")
    allowed = families_for(collective) if collective not in ONE_ALGORITHM else ["direct"]
    if not options.algorithms:
        raise ValueError("--algorithm names no algorithm; allowed: a comma-separated list of "
                         "auto, " + ", ".join(allowed) + ", or all")
    for algorithm in options.algorithms:
        if algorithm != "auto" and algorithm not in allowed:
            raise ValueError(
                f"--algorithm {algorithm!r} has no {collective.value} schedule; allowed: auto, "
                + ", ".join(allowed)
            )
    if options.device not in DEVICES:
        raise ValueError(f"--device={options.device!r}; allowed: {', '.join(DEVICES)}")
    if options.roofline and options.device == "cuda":
        raise ValueError("--roofline measures host memory; allowed with --device host or shared")
    if options.against == "mpi" and options.device == "cuda":
        raise ValueError("--against mpi times host arrays only; allowed with --device host or "
                         "shared")
    if options.against not in (None, "mpi"):
        raise ValueError(f"--against={options.against!r}; allowed: mpi")
    problem = pair_error(options, collective, options.dtype, options.op)
    if problem:
        raise ValueError(problem)
    if "auto" in options.algorithms and collective not in ONE_ALGORITHM:
        select.check_forced(collective)  # PYCOLL_ALGO's family must serve auto's calls
    return collective


def pair_error(options: Options, collective: Collective | None, dtype: str, op: str
               ) -> str | None:
    """Why ``options`` cannot run this (dtype, op) pair (both valid names), or None. Only a
    reducing collective reads the op."""
    if collective not in REDUCING:
        return None
    parsed, name = ReduceOp.parse(op), np.dtype(check_dtype(dtype)).name
    try:
        check_op_for_dtype(parsed, name)
    except ValueError as error:
        return str(error)
    if options.against == "mpi" and (parsed is ReduceOp.AVG or name in ("float16", "bfloat16")):
        return (f"--against mpi cannot run {parsed.value} on {name}: MPI has no avg and no "
                "half-precision reductions; use sum/prod/min/max on an MPI type")
    return None


ALL = "all"  # -d all, -o all: as nccl-tests


def combinations(options: Options) -> list[Options]:
    """nccl-tests' ``-d`` and ``-o``: one name, a comma-separated list, or 'all'; one Options
    per (dtype, op), dtypes outer, as nccl-tests loops (``-o`` only where the collective
    reduces). 'all' takes every dtype of the device and every op, leaving out the pairs these
    options cannot run (min and max of complex; --against mpi: avg, half precision), though a
    name given beside it must keep one; a pair of two lists that cannot run is ``validate``'s
    error. Names are checked whatever the other flag says."""
    every_dtype = gpu_dtypes() if options.device == "cuda" else [d.name for d in SUPPORTED_DTYPES]
    # each name as numpy reads it ('f4', 'single': float32), so an alias is not swept twice
    dtypes = dict.fromkeys(np.dtype(check_dtype(name)).name for name in
                           listed(options.dtype, "--dtype", every_dtype, dtype_name))
    collective = COLLECTIVES.get(options.collective)
    ops = dict.fromkeys(ReduceOp.parse(name).value for name in
                        listed(options.op, "--op", [op.value for op in ReduceOp], str.lower))
    if collective not in REDUCING:  # as nccl-tests: -o is not read (its names still checked)
        ops = {"sum": None}
    pairs = [(dtype, op) for dtype in dtypes for op in ops]
    every_given = tuple(str(text).strip().lower() == ALL for text in (options.dtype, options.op))
    if any(every_given):
        # 'all' means all that these options can run: pairs they cannot run are left out,
        # but a name given in a list keeps one pair at least (or its first pair's error)
        kept = [pair for pair in pairs if pair_error(options, collective, *pair) is None]
        for side, named in enumerate((dtypes, ops)):
            for name in [] if every_given[side] else named:
                if not any(pair[side] == name for pair in kept):
                    first = next(pair for pair in pairs if pair[side] == name)
                    raise ValueError(pair_error(options, collective, *first))
        pairs = kept
    return [replace(options, dtype=dtype, op=op) for dtype, op in pairs]


def check_sweeps(runs: list[Options], nranks: int, here: int = 0,
                 available: int | None = None) -> None:
    """Refuse, before any is measured, runs of which one sweeps no whole element (-d all -e 3
    measured the 1- and 2-byte dtypes, then stopped at int32), has a root that is no rank,
    or (given the ``available`` bytes of memory that ``here`` of the ranks share) needs
    more memory than that at its largest sizes."""
    for each in runs:
        collective = validate(each)
        if collective in ROOTED and not 0 <= each.root < nranks:  # others ignore it
            raise ValueError(f"--root={each.root} is not a rank; allowed: 0..{nranks - 1}")
        _check_peers(collective, nranks)
        dtype = np.dtype(check_dtype(each.dtype))
        swept = distinct_sizes(each, collective, dtype, nranks)
        if available is not None and here > 0:
            _check_memory(each, collective, dtype, nranks, swept, here, available)


# A rank's memory beyond its buffers, as a multiple of the whole array: messages in flight
# and the schedules' scratch. Measured (peak RSS, 2 and 4 in-process ranks, 32 and 64 MiB):
# within it for every collective and family but direct AllReduce, which receives every
# peer's whole array: nranks + 1 (4 ranks at 64 MiB: 383 MiB a rank; 6 at 32 MiB: 271).
WORKING_FACTOR = 2


def _check_peers(collective: Collective, nranks: int) -> None:
    if collective is Collective.SENDRECV and nranks < 2:  # pycoll sends to no rank itself
        raise ValueError(f"sendrecv on {nranks} rank: each rank sends to the next and receives "
                         "from the one before, never itself; allowed: 2 ranks or more "
                         "(--ranks, or mpiexec -n)")


def _working_factor(options: Options, collective: Collective, nranks: int) -> int:
    if collective is Collective.ALLREDUCE and "direct" in options.algorithms:
        return max(WORKING_FACTOR, nranks + 1)
    return WORKING_FACTOR


def _buffer_bytes(collective: Collective, itemsize: int, size: int, nranks: int) -> int:
    """A rank's buffers at a swept size as ``_Case`` makes them: x and out (the in-place
    case, made after they are freed, holds one array of the whole)."""
    count = element_count(collective, itemsize, size, nranks)
    in_count = count // nranks if collective is Collective.ALLGATHER else count
    out_count = count // nranks if collective is Collective.REDUCE_SCATTER else count
    return (in_count + out_count) * itemsize


def memory_needed(options: Options, collective: Collective, dtype: np.dtype, nranks: int,
                  swept: list[int]) -> int:
    """About the bytes of host memory one rank takes to measure the sizes ``swept``: its
    buffers at the last, and a working factor times its whole array; 0 with --device cuda
    (the buffers are in the GPU's memory)."""
    if options.device == "cuda":
        return 0
    size, itemsize = swept[-1], dtype.itemsize
    buffers = _buffer_bytes(collective, itemsize, size, nranks)
    if options.device == "shared":  # every size's buffers are kept, as long as the comm
        buffers = sum(_buffer_bytes(collective, itemsize, s, nranks)
                      + element_count(collective, itemsize, s, nranks) * itemsize
                      for s in swept)
    whole = element_count(collective, itemsize, size, nranks) * itemsize
    return buffers + _working_factor(options, collective, nranks) * whole


def size_text(nbytes: int, flag: bool = True) -> str:
    """A whole number of bytes as -b and -e read them (2G, 64M, 8K, else a plain count), or
    for a page (``flag=False``: 2 GiB, 64 MiB, 8 KiB, else 100 B)."""
    for suffix, unit in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}" if flag else f"{nbytes // unit} {suffix}iB"
    return str(nbytes) if flag else f"{nbytes} B"


def _check_memory(options: Options, collective: Collective, dtype: np.dtype, nranks: int,
                  swept: list[int], here: int, available: int) -> None:
    """Refuse a sweep whose sizes from some size on need more than ``available`` bytes for
    the ``here`` ranks that share this machine's memory: numpy's allocations succeed lazily,
    so a size too large for the memory was not refused but killed by the system mid-run."""
    for i, size in enumerate(swept):
        need = here * memory_needed(options, collective, dtype, nranks, swept[:i + 1])
        if need <= available:
            continue
        allowed = (f"--max-bytes {size_text(swept[i - 1])} or less" if i else
                   f"--min-bytes and --max-bytes below {size_text(size)}")
        raise ValueError(
            f"--max-bytes={size_text(options.max_bytes)}: {options.collective} of "
            f"{size_text(size)} ({dtype.name}) on {here} rank(s) of this machine needs about "
            f"{_memory_text(need)} of memory, more than the {_memory_text(available)} "
            f"available; allowed: {allowed}")


def _memory_text(nbytes: int) -> str:
    return (f"{nbytes / (1 << 30):.1f} GiB" if nbytes >= 1 << 30
            else f"{nbytes / (1 << 20):.1f} MiB")


def gpu_dtypes() -> list[str]:
    """The names of every dtype the GPU kernels reduce (``-d all`` on a GPU)."""
    from pycoll.kernels import table

    return [row.dtype.name for row in table.GPU_DTYPES]


def listed(text: str, flag: str, every: list[str], name: Callable[[str], str]) -> list[str]:
    """A flag's comma-separated names (each read by ``name``), or ``every`` for 'all'."""
    names = [name(part.strip()) for part in str(text).split(",") if part.strip()]
    if ALL in (n.lower() for n in names):
        if len(names) > 1:
            raise ValueError(f"{flag}={text!r}: 'all' stands alone")
        return every
    if not names:
        raise ValueError(f"{flag}={text!r} names nothing; allowed: a name, a comma-separated "
                         "list, or all")
    return list(dict.fromkeys(names))


def run(options: Options, comm: Communicator, on_row: Callable[[Row], None] | None = None
        ) -> list[Row]:
    """Benchmark every size and algorithm on ``comm``; every rank gets the same rows.

    ``on_row`` is called on rank 0 with each row as soon as it is measured.
    """
    collective = validate(options)
    dtype = np.dtype(check_dtype(options.dtype))
    native = comm.mpi_comm if options.against == "mpi" else None
    if options.against == "mpi" and native is None:
        raise ValueError("--against mpi needs MPI ranks: run under mpiexec (in-process ranks "
                         "have no native MPI to time)")
    if collective in ROOTED and not 0 <= options.root < comm.size:  # others ignore it
        raise ValueError(f"--root={options.root} is not a rank; allowed: 0..{comm.size - 1}")
    _check_peers(collective, comm.size)
    all_sizes = distinct_sizes(options, collective, dtype, comm.size)
    rows: list[Row] = []
    bandwidth = node_copy_bandwidth(comm) if options.roofline else None
    for size in all_sizes:
        for algorithm in options.algorithms:
            row = _measure(options, collective, dtype, size, algorithm, comm, native)
            if bandwidth is not None:
                floor_us = min_memory_traffic(collective, row.size, comm.size) / bandwidth * 1e6
                row.roofline_pct = 100 * floor_us / row.time_us if row.time_us > 0 else None
                if row.native_time_us:
                    row.native_roofline_pct = 100 * floor_us / row.native_time_us
            rows.append(row)
            if on_row is not None and comm.rank == 0:
                on_row(row)
    return rows


ROOFLINE_BYTES = 64 << 20  # per rank: well beyond the caches


def node_copy_bandwidth(comm: Communicator, nbytes: int = ROOFLINE_BYTES, repeats: int = 5
                        ) -> float:
    """The node's aggregate memory bandwidth, bytes read plus written per second, with every
    rank copying ``nbytes`` at once (the median of ``repeats``, each timed by the slowest
    rank); what a collective on one node can at best move through memory."""
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    np.copyto(dst, src)  # touch the pages first
    samples = []
    for _ in range(repeats):
        pycoll.barrier(comm)
        started = time.perf_counter()
        np.copyto(dst, src)
        samples.append(time.perf_counter() - started)
    slowest = pycoll.allreduce(np.array(samples), "max", comm=comm)
    return 2 * nbytes * comm.size / float(np.median(slowest))


def min_memory_traffic(collective: Collective, nbytes: int, nranks: int) -> int:
    """Bytes that any algorithm must read plus write in the node's memory for a collective
    of ``nbytes`` (nccl-tests' size: the whole array; AllGather's output, ReduceScatter's
    input), when ranks may read each other's memory in place (docs/performance.md): every
    input byte read once, every output byte written once, nothing else."""
    p, n = nranks, nbytes
    if collective in (Collective.ALLREDUCE, Collective.ALLTOALL, Collective.SENDRECV):
        return 2 * p * n  # p inputs read, p outputs written
    if collective in (Collective.REDUCE_SCATTER, Collective.REDUCE):
        return p * n + n  # p inputs read; p shards of n/p (or one result of n) written
    if collective is Collective.ALLGATHER:
        return n + p * n  # p shards of n/p read; p outputs of n written
    return n + (p - 1) * n  # Broadcast: the root's array read, p-1 copies written


def element_count(collective: Collective, itemsize: int, size: int, nranks: int) -> int:
    """Elements of the whole array for a swept size of ``size`` bytes."""
    count = max(size // itemsize, 0)
    if collective in SHARDED:
        count -= count % nranks  # nccl-tests: the whole array splits evenly
    return count


def distinct_sizes(options: Options, collective: Collective, dtype: np.dtype, nranks: int
                   ) -> list[int]:
    """The swept sizes, less those whose element count the one before has (1 B and 2 B of
    float32 are both 0 elements: one row, not two); an error if none holds an element."""
    kept, last = [], None
    for size in sizes(options.min_bytes, options.max_bytes, options.step_factor):
        count = element_count(collective, dtype.itemsize, size, nranks)
        if count != last:
            kept.append(size)
        last = count
    _check_some_element(options, collective, dtype, nranks, kept)
    return kept


def _check_some_element(options: Options, collective: Collective, dtype: np.dtype,
                        nranks: int, swept: list[int]) -> None:
    """Refuse a sweep of sizes that all round down to no element: every row would time an
    empty call."""
    if swept and not element_count(collective, dtype.itemsize, swept[-1], nranks):
        sharded = collective in SHARDED
        whole = (f"{nranks} {dtype.name} elements (one per rank: {collective.value} splits "
                 "evenly)" if sharded else f"one {dtype.name} element")
        need = dtype.itemsize * (nranks if sharded else 1)
        raise ValueError(f"--max-bytes={options.max_bytes} holds no whole element: the sweep "
                         f"needs {whole}, {need} B; allowed: --max-bytes {need} or more")


class _Case:
    """The buffers and calls for one (collective, size): pycoll's and the native one."""

    def __init__(self, options: Options, collective: Collective, dtype: np.dtype, size: int,
                 comm: Communicator, in_place: bool = False):
        p = comm.size
        self.collective, self.dtype, self.comm = collective, dtype, comm
        self.op, self.root = options.op, options.root
        self.count = count = element_count(collective, dtype.itemsize, size, p)
        in_count = count // p if collective is Collective.ALLGATHER else count
        out_count = count // p if collective is Collective.REDUCE_SCATTER else count
        self.memory = _Memory(options.device, comm)
        if not in_place:
            self.x = self.memory.zeros(in_count, dtype, "x")
            self.out = self.memory.zeros(out_count, dtype, "out")
            return
        # one array: x and out alike, or the smaller this rank's block of the larger
        whole = self.memory.zeros(count, dtype, "in place")
        block = whole[comm.rank * (count // p):(comm.rank + 1) * (count // p)]
        self.x = block if collective is Collective.ALLGATHER else whole
        self.out = block if collective is Collective.REDUCE_SCATTER else whole

    def fill_for_check(self) -> None:
        # a chunk at a time, as the oracle is: the whole at once took several int64 and
        # float64 arrays of x's length (32 bytes an element of int8), beyond its buffers
        with self.memory.on_stream():
            # never a right answer (the check values are >= 1): a call that leaves out as it
            # was passed where the last algorithm checked left the right result (compare)
            self.out[...] = 0
            for start in range(0, self.x.size, CHECK_CHUNK):
                stop = min(start + CHECK_CHUNK, self.x.size)
                values = _check_values(self.comm.rank, self.comm.size, start, stop, self.op,
                                       self.dtype, self.collective, self.count // self.comm.size)
                self.x[start:stop] = self.memory.upload(values)
        self.memory.synchronize()

    def call(self, algorithm: str) -> None:
        """One collective, complete: on a device, until this rank's stream has run it."""
        with self.memory.on_stream():
            self._call(algorithm)
        self.memory.synchronize()

    def _call(self, algorithm: str) -> None:
        c, x, out, kw = self.collective, self.x, self.out, {"algorithm": algorithm}
        if c is Collective.ALLREDUCE:
            pycoll.allreduce(x, self.op, out=out, comm=self.comm, **kw)
        elif c is Collective.REDUCE_SCATTER:
            pycoll.reduce_scatter(x, self.op, out=out, comm=self.comm, **kw)
        elif c is Collective.ALLGATHER:
            pycoll.allgather(x, out=out, comm=self.comm, **kw)
        elif c is Collective.BROADCAST:
            pycoll.broadcast(x, self.root, comm=self.comm, **kw)
        elif c is Collective.REDUCE:
            pycoll.reduce(x, self.op, self.root, out=out, comm=self.comm, **kw)
        elif c is Collective.SENDRECV:  # both posted, then waited: as nccl-tests' group
            p, rank = self.comm.size, self.comm.rank
            received = pycoll.recv(out, (rank - 1) % p, comm=self.comm, async_op=True)
            sent = pycoll.send(x, (rank + 1) % p, comm=self.comm, async_op=True)
            sent.wait()
            received.wait()
        else:
            pycoll.alltoall(x, out=out, comm=self.comm)

    def call_native(self, native) -> None:
        from mpi4py import MPI

        c, x, out = self.collective, self.x, self.out
        if c not in REDUCING:  # moved as bytes: any dtype (mpi4py has no bfloat16)
            x, out = x.view(np.uint8), out.view(np.uint8)
        op = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}[self.op]
        if c is Collective.ALLREDUCE:
            native.Allreduce(x, out, op=op)
        elif c is Collective.REDUCE_SCATTER:
            native.Reduce_scatter_block(x, out, op=op)
        elif c is Collective.ALLGATHER:
            native.Allgather(x, out)
        elif c is Collective.BROADCAST:
            native.Bcast(x, root=self.root)
        elif c is Collective.REDUCE:
            native.Reduce(x, out, op=op, root=self.root)
        elif c is Collective.SENDRECV:
            p, rank = self.comm.size, self.comm.rank
            native.Sendrecv(x, (rank + 1) % p, recvbuf=out, source=(rank - 1) % p)
        else:
            native.Alltoall(x, out)

    def wrong(self) -> int:
        """Elements of this rank's result that differ from the oracle."""
        p, rank, c = self.comm.size, self.comm.rank, self.collective
        if c is Collective.BROADCAST:
            result, total = self.x, self.count
        elif c is Collective.REDUCE and rank != self.root:
            return 0
        else:
            result, total = self.out, self.out.size
        wrong = 0
        for start in range(0, total, CHECK_CHUNK):
            stop = min(start + CHECK_CHUNK, total)
            want = self._expected(start, stop, p, rank)
            wrong += int(np.count_nonzero(self.memory.download(result[start:stop]) != want))
        return wrong

    def _expected(self, start: int, stop: int, p: int, rank: int) -> np.ndarray:
        c, op, dtype = self.collective, self.op, self.dtype

        def values(r: int, lo: int, hi: int) -> np.ndarray:
            return _check_values(r, p, lo, hi, op, dtype, c, self.count // p)

        if c is Collective.REDUCE_SCATTER:
            base = rank * self.out.size
            return oracle.allreduce([values(r, base + start, base + stop) for r in range(p)], op)
        if c in (Collective.ALLREDUCE, Collective.REDUCE):
            return oracle.allreduce([values(r, start, stop) for r in range(p)], op)
        if c is Collective.BROADCAST:
            return values(self.root, start, stop)
        if c is Collective.SENDRECV:
            return values((rank - 1) % p, start, stop)
        # AllGather and AllToAll: element i comes from source i // shard, at offset i % shard
        # of the source's piece (its own shard, or the piece addressed to this rank).
        shard = self.count // p
        parts = []
        for source in range(start // shard, (stop - 1) // shard + 1) if stop > start else []:
            lo, hi = max(start, source * shard), min(stop, (source + 1) * shard)
            base = rank * shard if c is Collective.ALLTOALL else 0
            parts.append(values(source, base + lo - source * shard, base + hi - source * shard))
        return np.concatenate(parts) if parts else np.zeros(0, dtype)


_SHARED_ARRAYS: dict[tuple, np.ndarray] = {}


class _Memory:
    """Where a benchmark's buffers live: numpy, or CuPy on the GPU of this rank's node-local
    index (ranks beyond the GPU count share GPUs), each rank with a stream of its own."""

    def __init__(self, device: str, comm: Communicator):
        self.device, self.comm = device, comm
        self.on_host = device != "cuda"
        if self.on_host:
            return
        try:
            import cupy

            devices = cupy.cuda.runtime.getDeviceCount()
        except Exception as error:  # noqa: BLE001 - ImportError, or CUDA's own errors
            raise RuntimeError(
                f"--device cuda needs CuPy and an NVIDIA GPU (pip install cupy-cuda13x, pycoll's "
                f"gpu extra): {error}"
            ) from error
        self.cupy = cupy
        local = 0
        if comm.mpi_comm is not None:
            from mpi4py import MPI

            node = comm.mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
            local = node.Get_rank()
            node.Free()
        cupy.cuda.Device(local % devices).use()
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def zeros(self, count: int, dtype: np.dtype, role: str):
        if self.device == "shared":  # kept per shape: windows live as long as the comm
            key = (id(self.comm), role, count, dtype)
            kept = _SHARED_ARRAYS.get(key)
            if kept is None:
                kept = _SHARED_ARRAYS[key] = pycoll.empty(count, dtype, comm=self.comm)
            kept[...] = 0
            return kept
        if self.device == "host":
            return np.zeros(count, dtype)
        with self.stream:
            return self.cupy.zeros(count, dtype)

    def upload(self, values: np.ndarray):
        if self.on_host:
            return values
        with self.stream:
            return self.cupy.asarray(values)

    def download(self, x) -> np.ndarray:
        if self.on_host:
            return x
        self.stream.synchronize()
        return x.get()

    def on_stream(self):
        return contextlib.nullcontext() if self.on_host else self.stream

    def synchronize(self) -> None:
        if not self.on_host:
            self.stream.synchronize()


_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing's multiplier (2**64 / golden ratio)


def _mixed(index: np.ndarray, modulus: int) -> np.ndarray:
    """Position i scrambled into 0..modulus-1 with no short period (i mod 3 and 11i mod 101
    repeat every 3 and 101 positions: a block moved by such an offset read as right)."""
    return (((index.astype(np.uint64) * _MIX) >> np.uint64(40)) % np.uint64(modulus)).astype(
        np.int64)


def _check_values(rank: int, nranks: int, start: int, stop: int, op: str, dtype: np.dtype,
                  collective: Collective, piece: int = 0) -> np.ndarray:
    """Position i of rank r: small integers, so that every algorithm's result is exact, which
    tell ranks and positions apart in the result (m(i) below: i scrambled, ``_mixed``, so
    that a block moved by any offset shows). Moved data: 1 + (37r + m(i)) mod 101; for
    AllToAll, whose pieces of ``piece`` elements go one to each rank d, position k of piece d
    holds 1 + (37(rn + d) + m(k)) mod 101, so that no two pieces' values are alike at any
    position up to 10 ranks, whatever the piece's length (with 37r + 11i, every piece of a
    rank was alike where the length was a multiple of 101, and a piece sent to the wrong peer
    passed). Reduced data: rank 0 holds 1 + m(i) mod 3; rank r > 0 holds 1, and 2 where
    i mod p = r, so a contribution lost or doubled shows, for sum, avg, prod and max; min
    takes 4 minus that."""
    index = np.arange(start, stop, dtype=np.int64)
    if collective is Collective.ALLTOALL and piece > 0:
        values = 1 + (37 * (rank * nranks + index // piece) + _mixed(index % piece, 101)) % 101
    elif collective in (Collective.BROADCAST, Collective.ALLGATHER, Collective.ALLTOALL,
                        Collective.SENDRECV):
        values = 1 + (37 * rank + _mixed(index, 101)) % 101
    else:
        if rank == 0:
            values = 1 + _mixed(index, 3)
        else:
            values = 1 + (index % nranks == rank)
        if op == "min":
            values = 4 - values
    return values.astype(np.float64).astype(dtype)


def barrier_of(comm: Communicator) -> Callable[[], None]:
    """The cheapest barrier over ``comm``'s ranks: MPI's own under MPI, else pycoll's."""
    if comm.mpi_comm is not None:
        return comm.mpi_comm.Barrier
    return lambda: pycoll.barrier(comm)


def _measure(options, collective, dtype, size, algorithm, comm, native) -> Row:
    case = _Case(options, collective, dtype, size, comm)
    barrier = native.Barrier if native is not None else barrier_of(comm)
    time_us, native_us = _time(case, algorithm, options, barrier, native)
    wrong = _count_wrong(case, algorithm) if options.check else None
    nbytes = case.count * dtype.itemsize
    factor = bus_factor(collective, comm.size)
    algbw = _algbw(nbytes, time_us)
    # as nccl-tests prints them: redop "none" and root -1 where the collective has none
    # count as nccl-tests': per rank where the array splits over the ranks
    row = Row(options.collective, comm.size, nbytes,
              case.count // comm.size if collective in SHARDED else case.count, dtype.name,
              options.op if collective in REDUCING else "none",
              options.root if collective in ROOTED else -1, algorithm, time_us, algbw,
              algbw * factor, wrong)
    if native_us is not None:
        row.native_time_us = native_us
        row.native_busbw = _algbw(nbytes, native_us) * factor
        row.ratio = native_us / time_us if time_us > 0 else None
    del case  # its buffers, before the in-place case's (a sweep's largest size)
    if options.in_place and collective not in NO_IN_PLACE:
        in_place = _Case(options, collective, dtype, size, comm, in_place=True)
        row.in_place_time_us = _time(in_place, algorithm, options, barrier, None)[0]
        row.in_place_algbw = _algbw(nbytes, row.in_place_time_us)
        row.in_place_busbw = row.in_place_algbw * factor
        row.in_place_wrong = _count_wrong(in_place, algorithm) if options.check else None
    return row


def _algbw(nbytes: int, time_us: float) -> float:
    return nbytes / (time_us * 1e-6) / 1e9 if time_us > 0 else 0.0


def _time(case: _Case, algorithm: str, options: Options, barrier: Callable[[], None],
          native) -> tuple[float, float | None]:
    """pycoll's median time in microseconds, and the native collective's (None without one),
    interleaved iteration by iteration; each iteration's time is the slowest rank's."""

    def timed(call) -> float:
        barrier()
        started = time.perf_counter()
        call()
        return time.perf_counter() - started

    ours, theirs = [], []
    for iteration in range(options.warmup + options.iters):
        mine = timed(lambda: case.call(algorithm))
        other = timed(lambda: case.call_native(native)) if native is not None else 0.0
        if iteration >= options.warmup:
            ours.append(mine)
            theirs.append(other)
    # every rank's last call ends before any goes on: a thread rank preparing the gather's
    # new shape held the GIL through its peers' last timed call (10x the first size's)
    barrier()
    slowest = pycoll.allreduce(np.array(ours + theirs), "max", comm=case.comm)
    time_us = float(np.median(slowest[: options.iters])) * 1e6
    native_us = float(np.median(slowest[options.iters:])) * 1e6 if native is not None else None
    return time_us, native_us


def _count_wrong(case: _Case, algorithm: str) -> int:
    """One more call on the check data; elements wrong, summed over the ranks."""
    case.fill_for_check()
    case.call(algorithm)
    return int(pycoll.allreduce(np.array([case.wrong()]), comm=case.comm)[0])


# The table's columns: (name, width, the Row field, format); the in-place ones unless
# --in-place 0, the native MPI ones with --against, the roofline ones with --roofline (a
# missing value prints as 0).
_COLUMNS = [("size(B)", 12, "size", ""), ("count", 11, "count", ""), ("type", 8, "type", ""),
            ("redop", 5, "redop", ""), ("root", 4, "root", ""),
            ("algorithm", 17, "algorithm", "")]
_OUT_OF_PLACE = [("time(us)", 10, "time_us", ".1f"), ("algbw(GB/s)", 11, "algbw", ".3f"),
                 ("busbw(GB/s)", 11, "busbw", ".3f"), ("#wrong", 6, "wrong", "")]
_IN_PLACE = [(name, width, f"in_place_{field}", spec) for name, width, field, spec in
             _OUT_OF_PLACE]
_AGAINST = [("mpi(us)", 10, "native_time_us", ".1f"), ("mpi busbw", 9, "native_busbw", ".3f"),
            ("ratio", 6, "ratio", ".2f")]
_ROOFLINE = [("roofline%", 9, "roofline_pct", ".1f")]
_ROOFLINE_AGAINST = [("mpi roof%", 9, "native_roofline_pct", ".1f")]


def _columns(against: bool, roofline: bool, in_place: bool = False
             ) -> list[tuple[str, int, str, str]]:
    return (_COLUMNS + _OUT_OF_PLACE + (_IN_PLACE if in_place else [])
            + (_AGAINST if against else []) + (_ROOFLINE if roofline else [])
            + (_ROOFLINE_AGAINST if roofline and against else []))


def format_header(title: str, against: bool, roofline: bool, in_place: bool = False) -> str:
    """The table's title and column names (``against``: the native MPI columns; ``in_place``:
    the in-place ones, under a line naming each set as nccl-tests does)."""
    columns = _columns(against, roofline, in_place)
    head = " ".join(f"{name:>{width}}" for name, width, _, _ in columns)
    if not in_place:
        return f"# {title}\n#{head[1:]}"

    def span(group: list) -> int:  # the set's columns and the spaces between them
        return sum(width + 1 for _, width, _, _ in group) - 1

    lead = span(_COLUMNS) + 1
    sets = (f"{'out-of-place':^{span(_OUT_OF_PLACE)}} {'in-place':^{span(_IN_PLACE)}}")
    return f"# {title}\n#{' ' * (lead - 1)}{sets}".rstrip() + f"\n#{head[1:]}"


def format_row(r: Row, against: bool, roofline: bool, in_place: bool = False) -> str:
    return " ".join(f"{_shown(r, field):>{width}{spec}}"
                    for _, width, field, spec in _columns(against, roofline, in_place))


def _shown(r: Row, field: str) -> object:
    value = getattr(r, field)
    if value is None:
        return "N/A" if field.endswith("wrong") else 0  # not checked; not measured
    return value


def format_footer(rows: list[Row]) -> str:
    """#wrong over every row, and the mean busbw over every row and set (nccl-tests' 'Avg bus
    bandwidth', which scripts read)."""
    checked = [r.all_wrong() for r in rows if r.wrong is not None]
    if not checked:
        lines = ["# out of bounds values: not checked (-c 0)"]
    else:
        wrong = sum(checked)
        lines = [f"# out of bounds values: {wrong} {'OK' if wrong == 0 else 'FAILED'}"]
    busbw = [r.busbw for r in rows] + [r.in_place_busbw for r in rows
                                       if r.in_place_busbw is not None]
    if busbw:
        lines.append(f"# Avg bus bandwidth    : {sum(busbw) / len(busbw):g}")
    return "\n".join(lines)


def write_json(rows: list[Row], path: str) -> None:
    text = json.dumps([asdict(r) for r in rows], indent=1)
    _write(text, path)


def write_csv(rows: list[Row], path: str) -> None:
    write_records_csv([field.name for field in fields(Row)], [asdict(r) for r in rows], path)


def write_records_csv(names: list[str], records: list[dict], path: str) -> None:
    """Records as CSV with a header of ``names`` ('-': stdout); None and missing keys are
    empty."""
    text = io.StringIO()
    writer = csv.DictWriter(text, names, lineterminator="\n")
    writer.writeheader()
    writer.writerows(records)
    write_whole(text.getvalue(), path)


def _write(text: str, path: str) -> None:
    write_whole(text + "\n", path)


def write_whole(text: str, path: str) -> None:
    """``text`` into the file ``path`` ('-': stdout), through a symbolic link to where it
    points. A regular file is written then renamed, so that a run killed mid-write leaves the
    previous complete file; anything else (/dev/stdout, a pipe) is written to directly."""
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    if os.path.exists(path) and not os.path.isfile(path):  # both follow links
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return
    target = os.path.realpath(path)
    tmp = f"{target}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, target)


class OutputError(ValueError):
    """A --json or --csv file that could not be written (on rank 0 alone)."""


def destination(path: str | None) -> str | None:
    """'-' for a path that is this process's stdout (/dev/stdout, or the file stdout was sent
    to), else ``path``: written as a file, it replaced stdout's file under the table."""
    if path in (None, "-"):
        return path
    try:
        return "-" if os.path.samestat(os.stat(path), os.fstat(sys.stdout.fileno())) else path
    except (OSError, ValueError, AttributeError):  # no such file yet; stdout with no file
        return path


def rewritten(path: str | None) -> bool:
    """Whether ``path`` is rewritten with every row: a regular file (or none yet). A pipe or
    a device is written once, after the run, as '-' is: it took each rewrite in turn (three
    JSON arrays one after another)."""
    return path not in (None, "-") and (os.path.isfile(path) or not os.path.exists(path))


def write_output(write: Callable[[list, str], None], rows: list, path: str, flag: str) -> None:
    """``write(rows, path)``, an OSError named by its flag (the folder checked before the run
    may refuse the file: a dangling link, /proc)."""
    try:
        write(rows, path)
    except OSError as error:
        raise OutputError(f"{flag} {path}: cannot write it ({error.strerror or error})"
                          ) from None


def write_outputs(outputs: list[tuple[Callable[[list, str], None], str | None, str]],
                  rows: list, at_end: bool) -> None:
    """Each (write, path, flag) of ``outputs`` that is written now: with every row (a file,
    ``rewritten``), or once, after the run (``at_end``: '-', a pipe, a device)."""
    for write, path, flag in outputs:
        if path is not None and rewritten(path) != at_end:
            write_output(write, rows, path, flag)


class RowStream:
    """``run``'s ``on_row`` for the command line, as nccl-tests prints: the header before the
    first row, each row as it is measured, and the JSON and CSV files rewritten with every
    row so far, so that a run killed by a time limit keeps what it measured ('-', stdout, a
    pipe or a device is written once, by ``close``). ``close`` prints the footer."""

    def __init__(self, title: str, against: bool, roofline: bool, json_path: str | None = None,
                 csv_path: str | None = None, out: TextIO | None = None,
                 in_place: bool = False) -> None:
        self.title = title
        self.columns = (against, roofline, in_place)
        self.json_path, self.csv_path, self.out = json_path, csv_path, out
        self.rows: list[Row] = []

    def _print(self, text: str) -> None:
        print(text, file=sys.stdout if self.out is None else self.out, flush=True)

    def __call__(self, row: Row) -> None:
        if not self.rows:
            self._print(format_header(self.title, *self.columns))
        self.rows.append(row)
        self._print(format_row(row, *self.columns))
        write_outputs(self._outputs(), self.rows, at_end=False)

    def close(self, rows: list[Row]) -> None:
        """After the run: the footer, and what is written once ('-', a pipe, a device)."""
        if not self.rows:
            self._print(format_header(self.title, *self.columns))
        self._print(format_footer(rows))
        write_outputs(self._outputs(), rows, at_end=True)

    def _outputs(self) -> list[tuple[Callable[[list, str], None], str | None, str]]:
        return [(write_json, self.json_path, "--json"), (write_csv, self.csv_path, "--csv")]

