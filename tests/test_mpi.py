"""Collectives under a real MPI launcher (mpiexec from the mpich wheel the test extra installs)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pycoll.algorithms import families_for
from pycoll.schedule import Collective

HERE = Path(__file__).parent / "mpi"


def mpiexec() -> str:
    """$MPIEXEC if set (bench/gpu_check.sh names the carried MPICH's, which the mpi4py it
    puts first was built for), else the one beside this Python (the test extra's), else PATH's."""
    beside_python = Path(sys.executable).parent / "mpiexec"
    found = os.environ.get("MPIEXEC") or (
        str(beside_python) if beside_python.exists() else shutil.which("mpiexec"))
    if found is None:
        pytest.fail("mpiexec not found: install the test extra (pip install -e '.[test]')")
    return found


def launch(nranks: int, *args: str, timeout: float = 240, **settings: str
           ) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **settings}
    return subprocess.run(
        [mpiexec(), "-n", str(nranks), sys.executable, *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )


@pytest.mark.parametrize("script,summary,nranks", [
    *[("collectives.py", "mpi collectives", n) for n in (1, 2, 3, 4, 5)],
    # device arrays between processes: the staged MPI transport, a stand-in device each
    *[("device.py", "device collectives", n) for n in (1, 2, 3, 5)],
])
def test_every_collective_under_mpiexec(script, summary, nranks):
    done = launch(nranks, "-m", "mpi4py", str(HERE / script))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert f"{summary} on {nranks} ranks:" in output
    assert ", 0 failed" in output


FIRST_STEPS_LATE = """
import numpy as np, pycoll
from mpi4py import MPI

def attempt(name, call):
    if comm.rank == 1:  # never comes
        return
    try:
        call()
        print(f"rank {comm.rank} {name}: returned", flush=True)
    except pycoll.CollectiveTimeout as late:
        print(f"rank {comm.rank} {name}: {late}", flush=True)

def in_step():
    # rank 1 is a timeout ahead of the others (it skipped the call they timed out in), and
    # making a communicator waits for the others only that long too
    MPI.COMM_WORLD.Barrier()
    return pycoll.Communicator()

comm = pycoll.Communicator()
attempt("first", lambda: pycoll.allreduce(np.ones(3), comm=comm))
comm = in_step()
attempt("split", lambda: comm.split(0))
comm = in_step()
pycoll.allreduce(np.ones(3), comm=comm)
attempt("empty", lambda: pycoll.empty(4, comm=comm))
"""


def test_a_rank_missing_from_a_first_step_times_out():
    """The blocking MPI calls of a communicator's first steps (the shared-memory split, which
    shares the tuning file's costs too, a split) and of pycoll.empty wait within the timeout
    too (they waited forever for a rank that never came)."""
    done = launch(3, "-c", FIRST_STEPS_LATE, timeout=60, PYCOLL_TIMEOUT="0.5")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for rank in (0, 2):
        for name, what in [("first", "the first collective (connecting shared memory)"),
                           ("split", "split"),
                           ("empty", "empty")]:
            assert f"rank {rank} {name}: {what}: rank {rank} waited 0.5 s for rank(s) 1" in output


def test_a_rank_missing_from_the_first_call_over_mpi_messages_times_out():
    """Over MPI messages the first collective shares rank 0's tuned costs (a broadcast):
    within the timeout too, though no shared memory is connected."""
    done = launch(3, "-c", FIRST_STEPS_LATE.split("comm = pycoll.Communicator()")[0]
                  + "comm = pycoll.Communicator()\n"
                  + 'attempt("first", lambda: pycoll.allreduce(np.ones(3), comm=comm))\n',
                  timeout=60, PYCOLL_TIMEOUT="0.5", PYCOLL_HOST_TRANSPORT="mpi")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for rank in (0, 2):
        assert (f"rank {rank} first: the first collective (sharing the tuning file's costs): "
                f"rank {rank} waited 0.5 s for rank(s) 1") in output, output


SETUP_CROSSED = """
import sys
import numpy as np, pycoll

comm = pycoll.world()
calls = {"split": lambda: comm.split(0), "first": lambda: pycoll.allreduce(np.ones(3)),
         "empty": lambda: pycoll.empty(4)}
if sys.argv[1] == "warm":
    pycoll.allreduce(np.ones(3))  # the first collective made: split against empty
mine = sys.argv[2] if comm.rank == 1 else sys.argv[3]
try:
    calls[mine]()
    print(f"rank {comm.rank} {mine}: returned", flush=True)
except pycoll.CollectiveMismatch as error:
    print(f"rank {comm.rank} {mine}: {error}", flush=True)
"""


@pytest.mark.parametrize(("warm", "odd", "others", "transport"), [
    ("cold", "first", "split", "auto"),  # a rank whose split raised, in its next call
    ("cold", "first", "split", "mpi"),
    ("warm", "empty", "split", "auto"),
])
def test_ranks_that_come_to_different_setup_calls_all_raise(warm, odd, others, transport):
    """The handshakes before a setup's blocking MPI calls matched each other whichever calls
    they guarded: rank 1 entered its first collective's split and ranks 0 and 2 the program's
    split, and all waited forever, within a timeout. Each now names its call."""
    done = launch(3, "-c", SETUP_CROSSED, warm, odd, others, timeout=60, PYCOLL_TIMEOUT="5",
                  PYCOLL_HOST_TRANSPORT=transport)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    names = {"split": "split", "empty": "empty",
             "first": ("the first collective (sharing the tuning file's costs)"
                       if transport == "mpi" else
                       "the first collective (connecting shared memory)")}
    both = (f"the ranks came to different calls that set up communicators, and none entered "
            f"its own: ranks 0, 2: {names[others]}; rank 1: {names[odd]}")
    for rank in (0, 1, 2):
        mine = odd if rank == 1 else others
        assert f"rank {rank} {mine}: {names[mine]}: {both}" in output, output


SETTINGS_DIFFER = """
import pycoll
from mpi4py import MPI
try:
    pycoll.Communicator()
    print(f"rank {MPI.COMM_WORLD.rank}: made", flush=True)
except ValueError as error:
    print(f"rank {MPI.COMM_WORLD.rank}: {error}", flush=True)
"""


@pytest.mark.parametrize(("setting", "value", "says"), [
    ("PYCOLL_HOST_TRANSPORT", "mpi", "PYCOLL_HOST_TRANSPORT 'auto' on ranks 0, 2, 'mpi' on rank 1"),
    ("PYCOLL_ALGO", "ring", "PYCOLL_ALGO 'unset' on ranks 0, 2, 'ring' on rank 1"),
    ("PYCOLL_SHM_ONE_SHOT_BYTES", "65536", "PYCOLL_SHM_ONE_SHOT_BYTES 2097152 on ranks 0, 2, "
                                           "65536 on rank 1"),
    ("PYCOLL_TIMEOUT", "30", None),  # a rank's own deadline: may differ
])
def test_ranks_whose_settings_differ_all_raise_making_a_communicator(setting, value, says):
    """One rank on shared memory and the others on MPI messages (or forcing another family,
    or another one-shot limit) sent messages no peer expected, and waited forever."""
    done = subprocess.run(
        [mpiexec(), "-n", "1", sys.executable, "-c", SETTINGS_DIFFER,
         ":", "-n", "1", "env", f"{setting}={value}", sys.executable, "-c", SETTINGS_DIFFER,
         ":", "-n", "1", sys.executable, "-c", SETTINGS_DIFFER],
        capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for rank in range(3):
        if says is None:
            assert f"rank {rank}: made" in output, output
        else:
            assert (f"rank {rank}: the ranks' settings differ: {says}; allowed: the same on "
                    "every rank") in output, output


def test_a_rank_that_catches_its_bad_setting_leaves_no_peer_waiting():
    """Rank 1 alone with PYCOLL_SEGMENTS=x, its ValueError caught: its peers waited forever
    in the allgather of the settings, which no deadline covers. Every rank now raises."""
    done = subprocess.run(
        [mpiexec(), "-n", "1", sys.executable, "-c", SETTINGS_DIFFER,
         ":", "-n", "1", "env", "PYCOLL_SEGMENTS=x", sys.executable, "-c", SETTINGS_DIFFER,
         ":", "-n", "1", sys.executable, "-c", SETTINGS_DIFFER],
        capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    bad = "PYCOLL_SEGMENTS='x' is invalid; allowed: an int in 1..1024, or unset"
    assert output.count(f"rank 1: {bad}") == 3, output  # its own, and inside each peer's
    for rank in (0, 2):  # (the processes' lines may run together)
        assert f"rank {rank}: rank 1: {bad}" in output, output


LONE_RANK = """
import numpy as np, pycoll
from mpi4py import MPI
world = MPI.COMM_WORLD
inter = world.Split(world.rank % 2, world.rank).Create_intercomm(0, world, 1 - world.rank % 2, 7)
try:
    pycoll.Communicator(inter)  # its allgather would join the other group: it hung
except TypeError as error:
    print(f"rank {world.rank} intercomm: {error}", flush=True)
comm = pycoll.world()
pycoll.allreduce(np.ones(2))
x = pycoll.empty(4)  # rank 2 is alone on its node: it shares no window, yet takes part
x[:] = 1
print(f"rank {comm.rank} then: {pycoll.allreduce(x).tolist()}", flush=True)
broken = pycoll.Communicator()
broken.broken_by(RuntimeError("a test's reason"))
try:
    broken.split(0)  # it went ahead: MPI_Comm_split over ranks that may have parted
except RuntimeError as error:
    print(f"rank {comm.rank} split: {error}", flush=True)
"""


def test_an_intercommunicator_is_named_and_a_lone_rank_takes_part_in_empty():
    """Communicator(intercomm) hung in its first allgather; pycoll.empty on a rank alone on
    its node skipped the arrival the others made within PYCOLL_TIMEOUT, so their tags parted
    and every later call failed; a broken communicator's split went ahead (in-process it
    raised, through its collective)."""
    done = launch(3, "-c", LONE_RANK, timeout=60, PYCOLL_TIMEOUT="10",
                  PYCOLL_RANKS_PER_NODE="2")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for rank in range(3):
        assert (f"rank {rank} intercomm: mpi_comm=<mpi4py.MPI.Intercomm object" in output
                and "allowed: an mpi4py intracommunicator" in output), output
        assert f"rank {rank} then: [3.0, 3.0, 3.0, 3.0]" in output, output
        assert f"rank {rank} split: " in output and "(a test's reason)" in output, output


DEVICE_ONLY = f"""
import sys
sys.path.insert(0, {str(HERE.parent)!r})
import numpy as np
from fake_device import SharedFileDevice, device_array, host_array
import pycoll
from pycoll import spaces
comm = pycoll.world()
spaces.register(SharedFileDevice(seed=comm.rank))
y = host_array(pycoll.allreduce(device_array(np.arange(8.0) + comm.rank)))
print(f"rank {{comm.rank}}: right {{y.tolist() == (3 * np.arange(8.0) + 3).tolist()}}, host "
      f"transport made {{comm.host_transport_made()}}", flush=True)
"""


def test_a_device_only_program_makes_no_host_transport():
    """Device arrays' first call shares the tuned costs alone: no shared memory for host
    arrays (tens of MiB of /dev/shm per rank), which it never uses."""
    done = launch(3, "-c", DEVICE_ONLY, timeout=60)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for rank in range(3):
        assert f"rank {rank}: right True, host transport made False" in output, output



REMADE_DEVICE_ENDPOINTS = f"""
import sys
sys.path.insert(0, {str(HERE.parent)!r})
import numpy as np
from fake_device import SharedFileDevice, device_array, host_array
import pycoll
from pycoll import spaces
comm = pycoll.world()
spaces.register(SharedFileDevice(seed=comm.rank))
wrong = 0
for i in range(1200):  # MPICH has 2048 context ids: two leaked per making ran out at ~1020
    y = host_array(pycoll.allreduce(device_array(np.full(3, i + comm.rank, np.int64))))
    wrong += int((y != 3 * i + 3).sum())
    comm.free_device_buffers()
print(f"rank {{comm.rank}}: 1200 makings, {{wrong}} wrong", flush=True)
"""


def test_a_rank_alone_on_its_node_leaks_no_communicators():
    """From a helper's hunt: with nodes [0, 0, 1] rank 2 duplicated MPI communicators for a
    peer-memory endpoint (duplicating is collective) that it never used or freed, two per
    making, until every rank's MPI_Comm_dup failed (no context id left)."""
    done = launch(3, "-c", REMADE_DEVICE_ENDPOINTS, PYCOLL_RANKS_PER_NODE="2")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    for rank in range(3):
        assert f"rank {rank}: 1200 makings, 0 wrong" in output, output[-3000:]


UNMAPPABLE_DEVICE = f"""
import sys
sys.path.insert(0, {str(HERE.parent)!r})
import numpy as np
from fake_device import FakeDevice, device_array
import pycoll
from pycoll import spaces
comm = pycoll.world()
spaces.register(FakeDevice(seed=comm.rank))  # its memory no other process can map
try:
    pycoll.allreduce(device_array(np.ones(3)))
    print(f"rank {{comm.rank}} went through MPI", flush=True)
except ValueError as error:
    print(f"rank {{comm.rank}}: {{error}}", flush=True)
print(f"rank {{comm.rank}} then {{pycoll.allreduce(np.ones(2)).tolist()}}", flush=True)
"""


def test_forcing_peer_memory_on_a_device_no_process_can_map_is_an_error():
    """docs/gpu.md: PYCOLL_DEVICE_TRANSPORT=ipc insists on peer memory; on a device whose
    memory another process cannot map it went through MPI instead, without a word."""
    done = launch(2, "-c", UNMAPPABLE_DEVICE, timeout=60, PYCOLL_DEVICE_TRANSPORT="ipc")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for rank in range(2):
        assert (f"rank {rank}: PYCOLL_DEVICE_TRANSPORT=ipc but fake memory cannot be mapped by "
                "another process (allowed here: auto or staged)") in output, output
        assert f"rank {rank} then [2.0, 2.0]" in output, output
    assert "went through MPI" not in output, output

COUNTS_DISAGREE = """
import numpy as np, pycoll
rank = pycoll.world().rank
try:
    pycoll.allreduce(np.arange(9 if rank == 1 else 8, dtype=np.int64))
    print(f"rank {rank} returned", flush=True)
except ValueError as error:
    print(f"rank {rank}: {error}", flush=True)
"""


@pytest.mark.parametrize("deadline", ["", "30"])  # one Sendrecv; posts and a wait
def test_ranks_that_disagree_on_counts_over_mpi_messages_both_raise(deadline):
    """Over MPI messages a count that differs between ranks is a ValueError on both: the
    longer message's receiver was given MPI's "See the MPI_ERROR field", the shorter one's
    returned data never reduced."""
    done = launch(2, "-c", COUNTS_DISAGREE, timeout=60, PYCOLL_HOST_TRANSPORT="mpi",
                  PYCOLL_TIMEOUT=deadline, PYCOLL_CHECK="0")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    # (the tag: 2 under a timeout, whose first steps take one)
    assert re.search(r"rank 0: rank 0 expects 64 bytes from rank 1 \(tag \d\) and the message "
                     r"is longer; the ranks disagree on counts", output), output
    assert re.search(r"rank 1: rank 1 expects 72 bytes from rank 0 \(tag \d\) and received 64; "
                     r"the ranks disagree on counts", output), output
    assert "returned" not in output


@pytest.mark.parametrize("nranks,per_node", [(2, ""), (3, ""), (5, ""), (5, "2"), (3, "1")])
def test_peer_memory_between_processes(nranks, per_node):
    """The peer-memory transport between MPI processes, as over CUDA IPC (a stand-in device
    whose inboxes are files the processes map): handles, credits and notices over MPI; with
    simulated nodes, routed: peer memory within them, staged MPI between."""
    before = {p.name for p in Path("/dev/shm").glob("pycoll-fake-*")}
    done = launch(nranks, "-m", "mpi4py", str(HERE / "device.py"), "shared",
                  PYCOLL_RANKS_PER_NODE=per_node)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert f"device collectives on {nranks} ranks:" in output and ", 0 failed" in output
    assert {p.name for p in Path("/dev/shm").glob("pycoll-fake-*")} <= before  # none left


# the host transport: shared memory (the default on one node), messages only, and shared
# memory within simulated nodes of two ranks with messages between them (small rings, so long
# messages wrap)
ROUTED = {"PYCOLL_RANKS_PER_NODE": "2", "PYCOLL_SHM_RING_BYTES": "16384"}


@pytest.mark.parametrize("nranks,settings", [
    (3, {"PYCOLL_HOST_TRANSPORT": "mpi"}), (3, ROUTED), (5, ROUTED),
    # simulated nodes of equal size: the hierarchical family runs its two-level schedules
    (4, {"PYCOLL_RANKS_PER_NODE": "2"}), (6, {"PYCOLL_RANKS_PER_NODE": "3"}),
])
def test_every_collective_over_each_host_transport(nranks, settings):
    done = launch(nranks, "-m", "mpi4py", str(HERE / "collectives.py"), **settings)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert f"mpi collectives on {nranks} ranks:" in output
    assert ", 0 failed" in output


@pytest.mark.parametrize("transport,nranks,per_node", [
    ("auto", 3, ""), ("mpi", 3, ""),
    ("auto", 6, "2"),  # 3 simulated nodes: shared memory within, messages between
])
def test_every_process_gets_the_same_bits(transport, nranks, per_node):
    done = launch(nranks, str(HERE / "determinism.py"), PYCOLL_HOST_TRANSPORT=transport,
                  PYCOLL_RANKS_PER_NODE=per_node)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    cases = 2 * (len(families_for(Collective.ALLREDUCE)) + 1)  # 2 sizes x (families, auto)
    assert f"determinism on {nranks} ranks: {cases} checked, 0 failed" in output, output


@pytest.mark.parametrize("nranks,per_node", [(4, 2), (6, 2), (8, 4)])
def test_inter_node_bytes_equal_the_model_between_processes(nranks, per_node):
    done = launch(nranks, str(HERE / "traffic.py"), PYCOLL_RANKS_PER_NODE=str(per_node))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert (f"traffic on {nranks} ranks in {nranks // per_node} nodes: {nranks} of {nranks} "
            "equal the model") in output, output


def test_a_disagreement_is_named_on_every_process():
    done = launch(3, str(HERE / "agree.py"), PYCOLL_CHECK="1")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "agreement on 3 ranks: 3 of 3 named the mismatch" in output


CHANNELS_CROSS = """
import sys, numpy as np, pycoll
rank = pycoll.world().rank
kind = sys.argv[1]
# a communicator's first call: some ranks take the one-shot, the others a schedule
if kind == "sizes":
    x, algorithm = np.ones((1 << 20) if rank == 1 else 1), "auto"
else:
    x, algorithm = np.ones(4), "tree" if rank == 1 else "auto"
try:
    pycoll.allreduce(x, algorithm=algorithm)
    print(f"rank {rank} returned", flush=True)
except ValueError as error:
    print(f"rank {rank} raised {type(error).__name__}", flush=True)
"""


@pytest.mark.parametrize("kind", ["sizes", "algorithm"])
def test_ranks_whose_first_calls_take_different_channels_all_raise(kind):
    """Sizes on both sides of the one-shot limit, or a family forced on one rank, in a
    communicator's first call: the schedule's ranks waited forever in the broadcast of the
    tuned costs (the one-shot's never came to it); then a rank the one who raised sent
    nothing to waited forever for its one-shot flag."""
    done = launch(3, "-c", CHANNELS_CROSS, kind, timeout=60)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for rank in range(3):
        assert f"rank {rank} raised ChannelsCrossed" in output, output


@pytest.mark.parametrize("transport", ["auto", "mpi"])
@pytest.mark.parametrize("count", [3, 30000])
def test_a_timeout_names_the_missing_rank_on_every_process(transport, count):
    before = shm_files()
    done = launch(3, str(HERE / "timeout.py"), str(count), timeout=60, PYCOLL_TIMEOUT="1",
                  PYCOLL_HOST_TRANSPORT=transport)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output  # the job ends normally after the timeouts
    assert "timeouts on 3 ranks: 3 of 3 named a peer" in output, output
    assert left_in_dev_shm(before) == set()


@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_verification_between_processes(nranks):
    """PYCOLL_VERIFY=1 over MPI and shared memory: right results pass; one wrong element on
    rank 1 raises VerificationError naming it on every rank, and the job goes on."""
    done = launch(nranks, "-m", "mpi4py", str(HERE / "verify.py"), PYCOLL_VERIFY="1")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    named = nranks if nranks > 1 else 0
    assert (f"verify on {nranks} ranks: {4 * nranks} passed, 0 failed, {named} ranks named "
            "rank 1") in output, output


@pytest.mark.parametrize("collective,nranks", [("allreduce", 3), ("reduce_scatter", 2),
                                               ("allgather", 3)])
def test_the_gpu_check_collective_bench_between_processes(collective, nranks):
    """bench/gpu_check.sh's third step, with stand-ins for CuPy and the GPU: the benchmark's
    --device cuda code and the peer-memory transport between processes, every algorithm."""
    done = launch(nranks, "-m", "mpi4py", str(HERE / "device_bench.py"), collective)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "# out of bounds values: 0 OK" in output and "ring" in output, output
    assert output.count("device buffers freed before exit") == nranks, output


@pytest.mark.parametrize("count", [3, 30000])  # the one-shot's agreement, and a schedule's
def test_a_timeout_in_the_agreement_check_is_a_collective_timeout(count):
    done = launch(3, str(HERE / "timeout.py"), str(count), timeout=60, PYCOLL_TIMEOUT="1",
                  PYCOLL_CHECK="1")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "timeouts on 3 ranks: 3 of 3 named a peer" in output, output
    assert "allreduce (agreement check)" in output, output


def test_a_first_device_send_to_a_rank_that_never_receives_times_out():
    """Connecting a Send/Recv pair is bounded by the deadline too (MPI_Comm_create_group,
    which nothing can interrupt, starts only once the peer has answered)."""
    done = launch(3, str(HERE / "timeout.py"), "3", "device-send", timeout=60,
                  PYCOLL_TIMEOUT="1")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "send to rank 2 (tag 5) (connecting): rank 0 waited 1 s for rank(s) 2" in output, output
    assert "timeouts on 3 ranks: 3 of 3 named a peer" in output, output


@pytest.mark.parametrize("transport", ["auto", "mpi"])
def test_async_collectives_overlap_between_processes(transport):
    done = launch(3, str(HERE / "asynchronous.py"), PYCOLL_HOST_TRANSPORT=transport)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "async on 3 ranks: 27 of 27 right" in output


@pytest.mark.parametrize("nranks,transport", [(2, "mpi"), (3, "auto")])
def test_threads_and_async_work_beside_collective_setup(nranks, transport):
    """tests/mpi/threads.py: two threads' first calls make one world; split waits for the
    async collectives queued before it; a failed async receive leaves the others alone."""
    done = launch(nranks, str(HERE / "threads.py"), PYCOLL_HOST_TRANSPORT=transport)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert f"threads on {nranks} ranks: {nranks * 3 + 2} of {nranks * 3 + 2} right" in output


def test_a_short_soak_is_right_and_flat():
    """bench/soak.py's short version: mixed collectives, each against the oracle; the resident
    set flat after a warm-up (bench/results/soak.md has the 10 000-call run)."""
    done = launch(3, str(HERE.parent.parent / "bench" / "soak.py"), "600", "--warmup", "600")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    line = next(line for line in output.splitlines() if line.startswith("soak:"))
    assert "600 collectives on 3 ranks" in line and ", 0 wrong," in line
    growth = float(line.split("growth ")[1].split("%")[0])
    assert growth < 5, line


@pytest.mark.parametrize("nranks,transport", [(2, "auto"), (3, "auto"), (5, "auto"),
                                               (3, "mpi")])
def test_hypothesis_under_mpiexec(nranks, transport):
    """tests/mpi/fuzz.py: the same hypothesis draws on every process (the agreement check on,
    so a rank drawing differently would be named, not hang), each against the oracle."""
    done = launch(nranks, str(HERE / "fuzz.py"), "150", PYCOLL_CHECK="1",
                  PYCOLL_HOST_TRANSPORT=transport)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert f"fuzz on {nranks} ranks: 150 examples, 0 failed" in output


def shm_files() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def left_in_dev_shm(before: set[str], patience: float = 5.0) -> set[str]:
    """Files in /dev/shm since ``before`` that stay: another MPI job on the machine (a
    test's own helper, a parallel run) may hold one of its own for a moment, which goes."""
    deadline = time.monotonic() + patience
    while (left := shm_files() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_shared_memory_leaves_nothing_in_dev_shm():
    before = shm_files()
    done = launch(3, "-m", "mpi4py", str(HERE / "collectives.py"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert left_in_dev_shm(before) == set()


@pytest.mark.parametrize("mode", ["kill", "kill-device"])
def test_a_killed_rank_ends_the_job_and_shared_memory_adds_no_leftovers(mode):
    """MPICH itself leaves its own segment behind when a rank is killed (a plain mpi4py
    program does too); the shared-memory transport must add nothing to that. ``kill-device``:
    the others wait in a collective on (stand-in) device arrays."""
    left = {}
    for transport in ("mpi", "auto"):
        before = shm_files()
        started = time.monotonic()
        done = launch(3, str(HERE / "faults.py"), mode, timeout=120,
                      PYCOLL_HOST_TRANSPORT=transport)
        assert done.returncode != 0
        assert "finished, which it must not" not in done.stdout + done.stderr
        assert time.monotonic() - started < 60
        left[transport] = shm_files() - before
        for name in left[transport]:  # MPICH's leftovers: not ours to keep
            Path("/dev/shm", name).unlink(missing_ok=True)
    assert len(left["auto"]) <= len(left["mpi"]), left


@pytest.mark.parametrize("setting,allowed", [("PYCOLL_SEGMENTS=x", "an int in 1..1024, or unset"),
                                             ("PYCOLL_FORWARD=yes", "0 or 1")])
def test_a_rank_with_a_bad_setting_ends_the_job_instead_of_leaving_its_peers(setting, allowed):
    """Rank 0 alone started with PYCOLL_SEGMENTS=x: it raised in making the world, before the
    hook that ends the job on an uncaught error was installed, and exited; the others waited
    in making the world until killed. PYCOLL_FORWARD=yes went unnoticed (read by device
    calls only): the job finished."""
    started = time.monotonic()
    before = shm_files()
    # printed as "all returned" (Python 3.13 shows a -c program's source in its traceback)
    program = ["-c", "import numpy, pycoll; pycoll.allreduce(numpy.ones(2)); "
               "print('all', 'returned')"]
    done = subprocess.run(
        [mpiexec(), "-n", "1", "env", setting, sys.executable, *program, ":",
         "-n", "2", sys.executable, *program], capture_output=True, text=True, timeout=120)
    for name in shm_files() - before:  # MPICH's own segment, left by MPI_Abort: not ours
        Path("/dev/shm", name).unlink(missing_ok=True)
    output = done.stdout + done.stderr
    name, value = setting.split("=")
    assert done.returncode != 0 and "all returned" not in output, output
    # every rank raises it (the peers as "rank 0: ..."): whichever ends the job first says so
    assert re.search(rf"pycoll: rank \d raised ValueError: (rank 0: )?{name}='{value}' is "
                     rf"invalid; allowed: {re.escape(allowed)}; aborting the job", output), output
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("mode", ["raise", "raise-own", "raise-thread", "bad-input"])
def test_a_failing_rank_ends_the_job_quickly(mode):
    started = time.monotonic()
    before = shm_files()
    done = launch(3, str(HERE / "faults.py"), mode, timeout=120)
    for name in shm_files() - before:  # MPICH's own segment, left by MPI_Abort: not ours
        Path("/dev/shm", name).unlink(missing_ok=True)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "finished, which it must not" not in output
    expected = (
        "pycoll: rank 1 raised RuntimeError: rank 1 fails on purpose; aborting the job"
        if mode.startswith("raise")
        else "out.dtype=float64"
    )
    assert expected in output
    assert time.monotonic() - started < 60


FORKED_HELPER = """
import multiprocessing, os, threading, numpy as np, pycoll
def helper():  # a forked worker (a DataLoader's): no rank, though it inherits the hooks
    failing = threading.Thread(target=lambda: 1 / 0)
    failing.start()
    failing.join()
    print("helper carried on", flush=True)
if __name__ == "__main__":
    rank = pycoll.world().rank
    pycoll.allreduce(np.ones(4))  # the world made: the hook that ends the job installed
    if rank == 0:
        child = multiprocessing.get_context("fork").Process(target=helper)
        child.start()
        child.join()
        print(f"helper exit {child.exitcode}", flush=True)
    print(f"rank {rank} after {pycoll.allreduce(np.ones(4)).tolist()}", flush=True)
"""


def test_a_forked_helpers_failing_thread_does_not_end_the_job(tmp_path):
    """A thread of a process that a rank forks raised: the child inherited the hook that ends
    the job on an uncaught error, and ended it, blaming the rank. Python prints the traceback
    and goes on, and so must the job: nobody waits for a helper."""
    program = tmp_path / "forked_helper.py"
    program.write_text(FORKED_HELPER)
    done = launch(2, str(program), timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "aborting the job" not in output and "ZeroDivisionError" in output, output
    assert output.count("helper carried on") == 1 and "helper exit 0" in output, output
    assert output.count("after [2.0, 2.0, 2.0, 2.0]") == 2, output


MPI4PY_SETTINGS = """
import sys, threading, mpi4py
mode = sys.argv[1]
if mode == "serialized":
    mpi4py.rc.thread_level = "serialized"
if mode == "no-init":
    mpi4py.rc.initialize = False
from mpi4py import MPI
import numpy as np, pycoll
if mode == "serialized":
    rank = pycoll.world().rank
    try:
        pycoll.allreduce(np.ones(2), async_op=True)
    except RuntimeError as error:
        print(f"async collective: {error}", flush=True)
    if rank == 0:
        pycoll.send(np.arange(5.0), 1, tag=3)
        pycoll.send(np.arange(5.0) + 1, 1, tag=4)
    else:
        posted = pycoll.recv(np.zeros(5), 0, tag=3, async_op=True)
        said = []
        def elsewhere():
            try:
                posted.wait()
            except RuntimeError as error:
                said.append(str(error))
        helper = threading.Thread(target=elsewhere)
        helper.start()
        helper.join()
        print(f"other thread: {' '.join(said)}", flush=True)
        print(f"posting thread: {posted.wait().tolist()}", flush=True)
        print(f"blocking: {pycoll.recv(np.zeros(5), 0, tag=4).tolist()}", flush=True)
    print(f"serialized total {pycoll.allreduce(np.arange(3.0)).tolist()}", flush=True)
elif mode == "no-init":
    try:
        pycoll.allreduce(np.ones(2))
    except RuntimeError as error:
        print(f"not initialized: {error}", flush=True)
    MPI.Init()
    print(f"after Init {pycoll.allreduce(np.ones(2)).tolist()}", flush=True)
elif mode == "freed":
    mine = MPI.COMM_WORLD.Dup()
    wrapped = pycoll.Communicator(mine)
    mine.Free()  # pycoll's duplicates go on
    half = wrapped.split(color=0)
    print(f"freed split {pycoll.allreduce(np.ones(2), comm=half).tolist()}", flush=True)
    from pycoll.tune import tune_comm
    tune_comm(wrapped, wrapped.host_kind(), repeats=1, sizes=[8], local_sizes=[1024])
    print("freed tuned", flush=True)
    # device arrays between the ranks (staged): MPI's CUDA-awareness is read from an info
    # that must not be the freed handle's
    sys.path.insert(0, sys.argv[2])
    from fake_device import FakeDevice, device_array, host_array
    from pycoll import spaces
    from pycoll.bindings import staged
    spaces.register(FakeDevice(seed=wrapped.rank))
    staged.cuda_aware_mpi = lambda c: print(f"info of the freed handle: {c == MPI.COMM_NULL}",
                                            flush=True) or False
    total = host_array(pycoll.allreduce(device_array(np.ones(3)), comm=wrapped))
    print(f"freed device {total.tolist()}", flush=True)
elif mode == "finalized":
    rank = pycoll.world().rank
    MPI.Finalize()
    # each rank's own file: two ranks' tracebacks on one stderr interleave mid-line
    sys.stderr = open(f"{sys.argv[2]}/stderr.{rank}", "w", buffering=1)
    raise RuntimeError("the program's own error, after MPI.Finalize")
"""


@pytest.mark.parametrize("mode,says", [
    ("serialized", ["async collective: async_op=True needs MPI initialised with "
                    "MPI_THREAD_MULTIPLE (mpi4py.rc.thread_level = 'multiple', mpi4py's "
                    "default, or MPI.Init_thread(MPI.THREAD_MULTIPLE)); this process has "
                    "MPI_THREAD_SERIALIZED",
                    "other thread: recv from rank 0 (tag 3): wait() from a thread other than "
                    "the one that posted it needs MPI_THREAD_MULTIPLE",
                    "posting thread: [0.0, 1.0, 2.0, 3.0, 4.0]",
                    "blocking: [1.0, 2.0, 3.0, 4.0, 5.0]"]),
    ("no-init", ["not initialized: MPI is not initialized (mpi4py.rc.initialize = False): "
                 "call MPI.Init_thread(MPI.THREAD_MULTIPLE)", "after Init [2.0, 2.0]"]),
    ("freed", ["freed split [2.0, 2.0]", "freed tuned", "info of the freed handle: False",
               "freed device [2.0, 2.0, 2.0]"]),  # (one print per line: lines interleave)
])
def test_mpi4py_settings_and_the_users_own_communicators(tmp_path, mode, says):
    """From a helper's hunt: below MPI_THREAD_MULTIPLE a posted Recv waited on another thread
    crashed MPICH (its MPI_Wait beside the main thread's calls); with mpi4py.rc.initialize
    False a first call killed the process in MPI with no Python error; split failed on a
    wrapped communicator the user had freed (it split the user's handle, not pycoll's)."""
    program = tmp_path / "settings.py"
    program.write_text(MPI4PY_SETTINGS)
    done = launch(2, str(program), mode, str(Path(__file__).parent), timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for said in says:
        assert said in output, output
    went_on = {"serialized": "serialized total [0.0, 2.0, 4.0]",
               "freed": "freed device [2.0, 2.0, 2.0]"}
    if mode in went_on:
        assert output.count(went_on[mode]) == 2, output  # both ranks went on
    if mode == "freed":  # neither rank read the freed handle's info
        assert output.count("info of the freed handle: False") == 2, output


def test_an_error_after_mpi_finalize_is_said_as_python_says_it(tmp_path):
    """The hook that ends the job asked the finalized MPI for the rank first: MPICH killed
    the process, and the program's own error and traceback were never printed."""
    program = tmp_path / "settings.py"
    program.write_text(MPI4PY_SETTINGS)
    done = launch(2, str(program), "finalized", str(tmp_path), timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    for rank in (0, 1):
        said = (tmp_path / f"stderr.{rank}").read_text()
        assert "RuntimeError: the program's own error, after MPI.Finalize" in said, (said, output)
        assert "Traceback" in said and "after finalizing" not in said + output, (said, output)


INTERRUPTED = """
import signal, sys, threading, time, numpy as np, pycoll
n = int(sys.argv[1])
rank = pycoll.world().rank
pycoll.allreduce(np.ones(n))
if rank == 1:  # Ctrl-C while it waits for rank 0 in the second call, caught, then go on
    main = threading.main_thread().ident
    threading.Timer(0.5, lambda: signal.pthread_kill(main, signal.SIGINT)).start()
    try:
        pycoll.allreduce(np.full(n, 10.0))
    except KeyboardInterrupt:
        print("rank 1 interrupted", flush=True)
    try:
        pycoll.allreduce(np.full(n, 1000.0))
        print("rank 1 went on", flush=True)
    except RuntimeError as error:
        print(f"rank 1 then: {error}", flush=True)
else:
    time.sleep(4)  # well after rank 1's Ctrl-C, at 0.5 s
    try:  # what rank 1 published before Ctrl-C, or an error where it is gone: never 1020
        got = pycoll.allreduce(np.full(n, 20.0))
        print(f"rank 0 second call: {sorted(set(got.tolist()))}", flush=True)
    except Exception as error:
        print(f"rank 0 second call failed: {type(error).__name__}", flush=True)
"""


@pytest.mark.parametrize("n,settings", [
    (4, {}),  # the shared-memory one-shot
    (300_000, {}),  # the shared-memory rings
    (4, {"PYCOLL_HOST_TRANSPORT": "mpi", "PYCOLL_TIMEOUT": "60"}),  # polled MPI waits
])
def test_a_call_interrupted_midway_breaks_the_communicator(tmp_path, n, settings):
    """A rank that caught KeyboardInterrupt in a collective its peer had yet to join went on
    to the next call, which the late peer paired with the first: both got 1020 for 30 and
    1100, silently (from a helper's hunt). Now the interrupted rank's communicator is broken,
    as after a timeout, and says why."""
    program = tmp_path / "interrupted.py"
    program.write_text(INTERRUPTED)
    done = launch(2, str(program), str(n), timeout=120, **settings)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "rank 1 interrupted" in output and "rank 1 went on" not in output, output
    assert ("is broken (allreduce" in output and "was interrupted by KeyboardInterrupt midway, "
            "and the other ranks may still be in it); make a new communicator" in output), output
    if n == 4:  # rank 1's input was all in the one-shot's slot, or sent, before Ctrl-C
        assert "rank 0 second call: [30.0]" in output, output
    else:  # rank 1 has left the rings' steps it had yet to take
        assert ("rank 0 second call: [30.0]" in output
                or "rank 0 second call failed: PeerFailed" in output), output


MANY_WINDOWS = """
import numpy as np, pycoll
from pycoll.bindings import shm
shm.MAX_WINDOWS = 5  # MPICH segfaulted in its 2045th window
kept = []
try:
    for step in range(10):
        kept.append(pycoll.empty(16, np.float32) if pycoll.world().rank else
                    pycoll.empty(1, np.int8))  # shapes may differ
except ValueError as error:
    print(f"rank {pycoll.world().rank} at {step}: {error}", flush=True)
print(f"rank {pycoll.world().rank} then: {pycoll.allreduce(np.ones(2)).tolist()}", flush=True)
"""


def test_shared_windows_past_the_limit_are_refused_on_every_rank():
    """About 2040 pycoll.empty arrays (windows live as long as their communicator) crashed
    every rank with SIGSEGV inside MPI_Win_allocate_shared: MPI ran out of context ids."""
    done = launch(2, "-c", MANY_WINDOWS, PYCOLL_HOST_TRANSPORT="shm")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for rank in (0, 1):
        assert (f"rank {rank} at 4: empty: a rank holds 5 shared windows (each array of "
                "pycoll.empty lives as long as its communicator); allowed: at most 5") in output
        assert f"rank {rank} then: [2.0, 2.0]" in output, output


def test_an_mpi_transfer_that_fails_names_the_peer():
    """A peer that had caught its CollectiveTimeout and ended: the late rank's collective
    raised a bare mpi4py.MPI.Exception ("See the MPI_ERROR field in MPI_Status"), naming no
    rank, no reason. Its transfers' failure is a PeerFailed naming the peer and MPI's why."""
    import numpy as np
    from mpi4py import MPI

    from pycoll import PeerFailed
    from pycoll.bindings.mpi import MPITransport

    class FailingRequests:
        @staticmethod
        def Waitall(requests, statuses):
            MPI.Request.Waitall(requests)  # done: nothing left posted
            for status in statuses:
                status.Set_error(MPI.ERR_OTHER)
            raise MPI.Exception(MPI.ERR_IN_STATUS)

    class FailingMPI:
        Request = FailingRequests

        def __getattr__(self, name):
            return getattr(MPI, name)

    comm = MPI.COMM_SELF.Dup()
    transport = MPITransport(comm)
    transport._MPI = FailingMPI()
    into, out = np.zeros(4, np.uint8), np.ones(4, np.uint8)
    with pytest.raises(PeerFailed, match=r"^rank 0: MPI failed a transfer with rank\(s\) 0 "
                                         r"\(.+\): has that rank ended or failed\?$") as failed:
        transport.waitall([transport.irecv(into, 0, 5), transport.isend(out, 0, 5)])
    assert "MPI_ERROR field" not in str(failed.value)  # the failed status's own words
    comm.Free()


SHORT_OF_SHARED_MEMORY = """
import sys
import numpy as np, pycoll
from pycoll.bindings import shm
rank = pycoll.world().rank
# rank 1's node (all one node here) has 1 MiB of /dev/shm free, as a container's may;
# touching a window past it killed every rank with SIGBUS
if sys.argv[1] == "transport":
    shm.shared_memory_free = lambda folder=shm.SHARED_MEMORY_FOLDER: (
        (1 << 20) if rank == 1 else None)
try:
    total = pycoll.allreduce(np.arange(100_000.0) + rank)
    ok = (total == 3 * np.arange(100_000.0) + 3).all()
    made = type(pycoll.world().host_transport()).__name__
    print(f"rank {rank}: {pycoll.world().host_kind()} {made} {ok}", flush=True)
except MemoryError as error:
    print(f"rank {rank} raised: {error}", flush=True)
if sys.argv[1] == "empty":
    shm.shared_memory_free = lambda folder=shm.SHARED_MEMORY_FOLDER: (
        (1 << 20) if rank == 2 else None)
    try:
        pycoll.empty(1 << 20, np.float32)
    except MemoryError as error:
        print(f"rank {rank} empty raised: {error}", flush=True)
    print(f"rank {rank} then: {pycoll.allreduce(np.ones(2)).tolist()}", flush=True)
"""


@pytest.mark.parametrize("transport", ["auto", "shm"])
def test_a_node_short_of_shared_memory_is_seen_alike_by_every_rank(transport):
    """In a container's 64 MiB /dev/shm, four ranks' windows (112 MiB) killed every rank with
    SIGBUS at the first collective. Where any rank's node lacks the room, every rank takes MPI
    messages (said once), or, with PYCOLL_HOST_TRANSPORT=shm, every rank raises."""
    done = launch(3, "-c", SHORT_OF_SHARED_MEMORY, "transport", PYCOLL_HOST_TRANSPORT=transport)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    needs = ("shared memory for host arrays needs 60.0 MiB on node 0, where /dev/shm has 1.0 "
             "MiB free: give the node more (docker run --shm-size), or lower "
             "PYCOLL_SHM_RING_BYTES (now 8388608 bytes per peer)")
    for rank in range(3):
        if transport == "auto":
            assert f"rank {rank}: mpi MPITransport True" in output, output
        else:
            assert (f"rank {rank} raised: PYCOLL_HOST_TRANSPORT='shm': {needs}; allowed: "
                    "PYCOLL_HOST_TRANSPORT=auto or mpi, which take messages") in output, output
    assert output.count(needs) == (1 if transport == "auto" else 3), output
    assert output.count("host arrays take MPI messages instead") == (transport == "auto")


def test_a_shared_array_that_does_not_fit_is_refused_on_every_rank():
    """pycoll.empty past the node's free shared memory (here rank 2's): MemoryError on every
    rank, none left in the window's allocation, and the communicator goes on."""
    done = launch(3, "-c", SHORT_OF_SHARED_MEMORY, "empty", PYCOLL_HOST_TRANSPORT="auto")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for rank in range(3):
        assert f"rank {rank}: shm SharedMemoryTransport True" in output, output
        assert (f"rank {rank} empty raised: empty(shape=(1048576,), dtype=float32): the "
                "array's window needs 12.0 MiB on node 0, where /dev/shm has 1.0 MiB free; "
                "allowed: an array that fits, or a node with more shared memory (docker run "
                "--shm-size)") in output, output
        assert f"rank {rank} then: [3.0, 3.0]" in output, output


A_RANK_FAILS_BEFORE_PYCOLL = """
import sys
import numpy as np
from mpi4py import MPI
if MPI.COMM_WORLD.rank == 1:
    sys.exit(3)  # fails before its first pycoll call: never makes the world
import pycoll
pycoll.allreduce(np.ones(2))
"""


def test_a_rank_that_never_makes_the_world_is_a_timeout_that_ends_the_job():
    """With PYCOLL_TIMEOUT, the others waited forever in the first blocking MPI call of making
    the world (the settings' allgather): as torch's init_process_group, they wait within it,
    and the uncaught CollectiveTimeout ends the job."""
    started = time.monotonic()
    done = launch(3, "-c", A_RANK_FAILS_BEFORE_PYCOLL, timeout=120, PYCOLL_TIMEOUT="1")
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert re.search(r"CollectiveTimeout: making a communicator: rank [02] waited 1 s for the "
                     r"other ranks of 3 \(making one is collective: every rank calls "
                     r"pycoll\.world\(\) or Communicator\(\) alike; has a rank failed or "
                     r"ended before its first pycoll call\?\)", output), output
    assert time.monotonic() - started < 60, output
