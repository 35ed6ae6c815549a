#!/usr/bin/env bash
# Everything pycoll checks on an NVIDIA GPU, in one call of well under 8 minutes, on a machine
# that may have no network: AllReduce, ReduceScatter and AllGather at 2 and 4 MPI ranks sharing
# the GPU through CUDA IPC, every algorithm, with --check, Send/Recv at 2, and the ring
# AllReduce without forwarding (PYCOLL_FORWARD=0); the kernels' bandwidth; the GPU tests;
# AllReduce at 4 ranks under MPS where the machine has it.
# Results go to $OUT (the device tool's folder) or bench/results/gpu-raw.
#   bash bench/fetch_wheels.sh   # here, with network: mpi4py, mpich, numpy wheels into .whl/
#   bash bench/gpu_check.sh      # there (device run: carry .whl, timeout_s = GPU_CHECK_SECONDS + 60)
# Steps run in order of what issue 4's bars need most: the IPC collectives (#wrong = 0), the
# kernels' bandwidth, then the collectives' GPU tests and the kernels' (the Numba kernels' full
# op x dtype matrix last), which take whatever time is left. Before the first step and after
# each, $OUT holds an up-to-date gpu-summary.md, so a run cut short still says what it measured.
# Wheels that the machine lacks travel with the tree in .whl/ (see the device notes).
# The device tool brings back at most 8 files from $OUT, so $OUT gets 7: environment.txt,
# gpu-tests.txt, kernels.txt, kernels.json, collectives.txt, collectives.tar.gz (the
# per-run JSON) and gpu-summary.md; the rest is written to a scratch folder.
set -uo pipefail
out=${OUT:-bench/results/gpu-raw}
mkdir -p "$out"
work=$(mktemp -d)
python=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# One deadline for the whole script: each step's timeout is its own cap or what is left,
# whichever is smaller, so a hanging step cannot push the later ones past 8 minutes.
deadline=$((SECONDS + ${GPU_CHECK_SECONDS:-480}))
within() { local left=$((deadline - SECONDS)); echo $(( left < $1 ? (left > 1 ? left : 1) : $1 )); }
# A step begun with under 5 s left would be cut at once and read as a hang (exit 124): it is
# skipped instead, with exit 125, as the IPC runs after one that failed are.
no_time_left() { [ $((deadline - SECONDS)) -lt 5 ]; }
# What a step cut at its cap may leave behind (an mpiexec a test started, its ranks
# busy-polling and holding GPU contexts) must not run on beside the next step. Only this
# script's own: every process it starts inherits GPU_CHECK_RUN, and other processes of the
# machine (another job's mpiexec) do not have it.
export GPU_CHECK_RUN="$$-$RANDOM"
reap() {
  local pid
  for pid in $(grep -lzxF "GPU_CHECK_RUN=$GPU_CHECK_RUN" /proc/[0-9]*/environ 2>/dev/null \
      | cut -d/ -f3); do
    [ "$pid" = "$$" ] || [ "$pid" = "$BASHPID" ] || kill -KILL "$pid" 2>/dev/null
  done
  return 0
}

{
  echo "# gpu_check $(date -u +%Y-%m-%dT%H:%MZ)"
  # compute_mode: EXCLUSIVE_PROCESS would refuse the second rank's context
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem,compute_mode \
    --format=csv 2>&1
  echo "kernel $(uname -r)"  # 4.4.0: gVisor, where CUDA IPC has not been seen working
  "$python" --version
  "$python" -m pip list 2>/dev/null | grep -iE \
    "^(cupy[a-z0-9-]*|numba|numba-cuda|numpy|ml.dtypes|mpi4py|cuda-bindings|cuda-pathfinder|nvidia-cuda-(nvrtc|runtime)[a-z0-9-]*|nvidia-nvvm[a-z0-9-]*|pytest) "
} | tee "$out/environment.txt"

# pycoll itself, without touching the network or the machine's own packages; python -P
# keeps the source folder from shadowing the installed package (kernels/ maps to pycoll.kernels).
site=$(mktemp -d)
prefix=$(mktemp -d)  # wheels go to a prefix: the mpich wheel's libmpi lands in $prefix/lib
numpy_prefix=$(mktemp -d)
trap 'rm -rf "$site" "$prefix" "$numpy_prefix" "$work"' EXIT
install_wheels() {  # PREFIX WHEEL...
  "$python" -m pip install -q --no-index --no-deps --no-compile --ignore-installed \
    --prefix "$@"
}
mapfile -t wheels_here < <(ls .whl/*.whl 2>/dev/null | grep -v '/numpy-')
if [ "${#wheels_here[@]}" -eq 0 ]; then  # said first: every MPI step below fails without them
  echo "no wheels in .whl/ (bash bench/fetch_wheels.sh before the run, and carry .whl):" \
    "mpiexec and mpi4py only as the machine has them" | tee -a "$out/environment.txt"
else
  install_wheels "$prefix" "${wheels_here[@]}"
fi
# pycoll laid out as pyproject.toml maps it (kernels/ and bindings/ inside the package), by
# copying: no build backend (setuptools, wheel) is needed there.
cp -r pycoll "$site/" && cp -r kernels "$site/pycoll/kernels" && cp -r bindings "$site/pycoll/bindings" \
  || { echo "could not lay out pycoll in $site" | tee -a "$out/environment.txt"; exit 1; }
wheels=$("$python" -c "import sysconfig; print(sysconfig.get_path('purelib', \
  vars={'base': '$prefix', 'platbase': '$prefix'}))")
export PYTHONPATH="$site:$wheels${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$prefix/bin:$PATH"  # mpiexec from the mpich wheel
# the tests' launcher too (tests/test_mpi.py would take one beside the machine's python first)
[ -x "$prefix/bin/mpiexec" ] && export MPIEXEC="$prefix/bin/mpiexec"
export LD_LIBRARY_PATH="$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONSAFEPATH=1  # every python, MPI ranks too: the source tree must not shadow pycoll
{ command -v mpiexec; "$python" -c "from mpi4py import MPI; print(MPI.Get_library_version()[:40])"; \
  } 2>&1 | tee -a "$out/environment.txt"

# numba-cuda 0.30 cannot compile under numpy 2.5 (np.row_stack is gone; NVIDIA/numba-cuda#907,
# not to be fixed): where the machine's pair fails, the numpy 2.4 wheel from .whl goes first
# on the path (CuPy works with it), so that the Numba kernels are measured too.
# numba-cuda finds libnvvm in wheels, then CUDA_HOME/CUDA_PATH: the image's toolkit, if unset.
[ -z "${CUDA_HOME:-}${CUDA_PATH:-}" ] && [ -d /usr/local/cuda/nvvm ] && export CUDA_HOME=/usr/local/cuda
numba_compiles() {
  timeout "$(within 60)" "$python" -P -c "
from numba import cuda
def one(x):
    x[0] = 1
cuda.compile_ptx(one, 'void(float32[:])', cc=(9, 0))" >/dev/null 2>"$work/numba-compile.txt"
}
numpy_version() { "$python" -P -c "import numpy; print(numpy.__version__)" 2>/dev/null || echo "(none)"; }
if ! numba_compiles; then
  numpy_here=$(numpy_version)
  # a prefix of its own, put on the path only if it helps
  numpy_site=$("$python" -c "import sysconfig; print(sysconfig.get_path('platlib', \
    vars={'base': '$numpy_prefix', 'platbase': '$numpy_prefix'}))")
  if ls .whl/numpy-*.whl >/dev/null 2>&1 \
    && install_wheels "$numpy_prefix" .whl/numpy-*.whl \
    && PYTHONPATH="$numpy_site:$PYTHONPATH" numba_compiles; then
    export PYTHONPATH="$numpy_site:$PYTHONPATH"
    said="numba-cuda cannot compile under numpy $numpy_here: numpy $(numpy_version) from .whl"
    said+=" put first"
  else
    said="numba-cuda cannot compile under numpy $numpy_here, with or without .whl's numpy:"
    said+=" the Numba kernels will fail"
  fi
  { echo "$said"; echo "numba-cuda's last words:"; tail -n 5 "$work/numba-compile.txt"; } \
    | tee -a "$out/environment.txt"
fi
# `python -m mpi4py SCRIPT` (the GPU tests' launcher) puts SCRIPT's folder in the place of
# sys.path[0], which under PYTHONSAFEPATH is PYTHONPATH's first entry: pycoll's (or numpy
# 2.4's) folder, and every rank then failed with "No module named 'pycoll'" (seen under
# Python 3.12 with this layout). An empty folder first takes that place.
spare=$(mktemp -d)
trap 'rm -rf "$site" "$prefix" "$numpy_prefix" "$work" "$spare"' EXIT
export PYTHONPATH="$spare:$PYTHONPATH"

# 0. Preflight, for reading a failed run: what CuPy and Numba see, and one tiny kernel each.
timeout "$(within 60)" "$python" -P -c "
import cupy, numba.cuda, numpy
cupy.show_config()
print('cupy sum of arange(5):', int(cupy.arange(5).sum()))
numba.cuda.detect()
@numba.cuda.jit
def twice(x):
    i = numba.cuda.grid(1)
    if i < x.size:
        x[i] *= 2
x = numba.cuda.to_device(numpy.arange(4.0))
twice[1, 4](x)
print('numba twice(arange(4)):', x.copy_to_host().tolist())
" 2>&1 | tee -a "$out/environment.txt"

# The launcher and the MPI library agree: two ranks of one world, not two worlds of one.
# CUDA IPC itself, with CuPy alone: export, open, event wait, read and write between two
# processes; where it fails, the step and error say so beside the collectives' own errors.
if no_time_left; then
  echo "# mpiexec and IPC smoke test skipped, no time left" | tee -a "$out/environment.txt"
  ipc_smoke_status=125
else
  timeout "$(within 30)" mpiexec -n 2 "$python" -P -c "
from mpi4py import MPI
print('mpiexec -n 2: rank', MPI.COMM_WORLD.rank, 'of', MPI.COMM_WORLD.size)" 2>&1 \
    | tee -a "$out/environment.txt"
  timeout -k 5 "$(within 40)" mpiexec -n 2 "$python" -P bench/ipc_smoke.py 2>&1 \
    | tee -a "$out/environment.txt"
  ipc_smoke_status=${PIPESTATUS[0]}
  reap
fi
echo "# bench/ipc_smoke.py: exit $ipc_smoke_status" | tee -a "$out/environment.txt"

# Every host wait of a collective from here on, in the tests as in the benchmarks, raises
# within 30 s naming its step and the rank awaited (GPU-side waits have no such deadline).
export PYCOLL_TIMEOUT=30

# $OUT's page and the collectives' JSON, brought up to date after every step (and once
# before the first: a run that dies at once still brings back its environment).
report() {
  echo "ipc smoke exit ${ipc_smoke_status:--}," \
    "gpu tests exit ${collective_tests_status:--} (collectives)," \
    "${kernel_tests_status:--} (kernels), kernel bench exit ${bench_status:--}," \
    "collectives exit ${collectives_status:--}" > "$work/summary.txt"
  cp "$out"/*.txt "$out"/kernels.json "$work"/ 2>/dev/null
  "$python" bench/summarize_gpu.py "$work" > "$out/gpu-summary.md" 2>&1
  if ls "$work"/*-[0-9]*.json >/dev/null 2>&1; then
    # shellcheck disable=SC2046  # the names are ours: no spaces
    tar -czf "$out/collectives.tar.gz" -C "$work" $(cd "$work" && ls -- *-[0-9]*.json)
  fi
}
report

# 1. Collectives between MPI ranks sharing the GPU over CUDA IPC, every algorithm, checked:
# issue 4's #wrong = 0 bar first.
collectives_status=0
: > "$out/collectives.txt"
# A run that hangs on the GPU (a cross-process event wait that never completes, where CUDA IPC
# half works) is cut at 40 s and names nothing (PYCOLL_TIMEOUT bounds host waits only); one
# that fails otherwise (a CUDA error on one rank: exit 2 or an abort, not 1, which is #wrong
# > 0) would fail alike in every run. After either, the other IPC runs are skipped (exit 125),
# and the time goes to the staged run, the kernels and the tests.
ipc_failed=""
bench_collective() {  # LABEL JSON_NAME RANKS COLLECTIVE [ARGS...]
  local label=$1 name=$2 ranks=$3 collective=$4
  shift 4
  local skip=""
  if no_time_left; then
    skip="no time left"
  elif [ -n "$ipc_failed" ] && [ "${PYCOLL_DEVICE_TRANSPORT:-}" != staged ]; then
    skip="after $ipc_failed"
  fi
  if [ -n "$skip" ]; then
    printf '%s\n' "# skipped, $skip:" \
      "# $collective on $ranks ranks$label: exit 125" | tee -a "$out/collectives.txt"
    return 125
  fi
  # -k: mpiexec waits for ranks that ignore SIGTERM (one stuck in a driver call). Out of
  # place only (--in-place 0), within the 40 s cap sized for it; tests/mpi/device.py checks
  # the in-place calls over CUDA IPC in the GPU tests below.
  timeout -k 5 "$(within 40)" mpiexec -n "$ranks" "$python" -P -m pycoll bench "$collective" \
    --device cuda -b 64K -e 64M -f 4 -n 10 -w 3 --check 1 --in-place 0 \
    --json "$work/$name.json" "$@" 2>&1 \
    | tee -a "$out/collectives.txt"
  local status=${PIPESTATUS[0]}
  echo "# $collective on $ranks ranks$label: exit $status" | tee -a "$out/collectives.txt"
  if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
    ipc_failed="$collective on $ranks ranks$label timed out"
  elif [ "$status" -ne 0 ] && [ "$status" -ne 1 ]; then
    ipc_failed="$collective on $ranks ranks$label failed (exit $status)"
  fi
  reap
  return "$status"
}
for ranks in 2 4; do
  for collective in allreduce reduce_scatter allgather; do
    bench_collective "" "$collective-$ranks" "$ranks" "$collective" --algorithm all \
      || collectives_status=$?
  done
done
# Send/Recv over the same IPC endpoints (each rank to rank + 1, from rank - 1), checked
bench_collective "" sendrecv-2 2 sendrecv || collectives_status=$?
# The ring's forwarding (reduce or copy and send in one pass) against two passes:
# PYCOLL_FORWARD=0, the same run as allreduce-4's ring rows otherwise.
PYCOLL_FORWARD=0 bench_collective ", ring, PYCOLL_FORWARD=0" unforwarded-allreduce-4 4 \
  allreduce --algorithm ring || collectives_status=$?
# Where IPC failed, the same collective staged through the host (no peer access): tells a
# machine that refuses CUDA IPC (gVisor?) from a wrong schedule. Not part of the IPC bar.
if [ "$collectives_status" -ne 0 ]; then
  PYCOLL_DEVICE_TRANSPORT=staged bench_collective ", PYCOLL_DEVICE_TRANSPORT=staged" \
    staged-allreduce-2 2 allreduce --algorithm all
fi
report

# 2. Each kernel's bandwidth (bytes read + written) against device copy and CuPy's add.
if no_time_left; then
  echo "# skipped, no time left: exit 125" | tee "$out/kernels.txt"
  bench_status=125
else
  timeout -s INT -k 10 "$(within 120)" "$python" -P -m pycoll bench kernels -b 1M -e 1G -f 4 \
    -d float32,bfloat16 --backend cupy,numba --json "$out/kernels.json" 2>&1 \
    | tee "$out/kernels.txt"
  bench_status=${PIPESTATUS[0]}
fi
report

# pytest on FILE with at most CAP seconds: SIGINT at the cap, so pytest still prints its
# failures and counts; a test stuck in CUDA gets its stack dumped at 60 s, and is killed 20 s
# after the cap. Each run in a process of its own: a GPU fault poisons the process's context.
# The compile-only checks (nvcc, NVRTC for sm_80, Numba PTX, the simulator, the CUDA C built
# for the CPU) run in CI without a GPU and are left out. Here no test may skip for want of a
# GPU: a run where CuPy sees none would otherwise pass with everything skipped.
gpu_tests() {  # CAP FILE [LABEL [SELECTION]]
  local label=${3:-$2} selection=${4:+ and ($4)}
  if no_time_left; then
    printf '%s\n' "# skipped, no time left" "# $label: exit 125" | tee -a "$out/gpu-tests.txt"
    return 125
  fi
  timeout -s INT -k 20 "$(within "$1")" "$python" -P -m pytest -q -rs -p no:cacheprovider \
    -o faulthandler_timeout=60 \
    -k "not nvcc and not nvrtc_compiles and not compile_to_ptx and not simulator_suite and not on-host$selection" \
    "$2" 2>&1 | tee "$work/pytest.txt" | tee -a "$out/gpu-tests.txt"
  local status=${PIPESTATUS[0]}
  reap
  if [ "$status" -eq 0 ] && grep -q "no CUDA GPU" "$work/pytest.txt"; then
    echo "# tests skipped for want of a GPU on a GPU machine: counted as failed" \
      | tee -a "$out/gpu-tests.txt"
    status=3
  fi
  echo "# $label: exit $status" | tee -a "$out/gpu-tests.txt"
  return "$status"
}
: > "$out/gpu-tests.txt"

# 3. The collectives' GPU tests (in-process ranks first; those between MPI processes last).
gpu_tests 150 tests/test_gpu_collectives.py
collective_tests_status=$?
report

# 4. The kernels' GPU tests, in what is left: first all but the Numba kernels' full op x
# dtype matrix (which compiles some 6 kernels per case), so that the CuPy matrix, the
# alignment, float-semantics and large-size tests run whatever time the Numba matrix lacks.
numba_matrix="every_kernel_matches_host and numba"
gpu_tests 300 tests/test_kernels_cuda.py "" "not ($numba_matrix)"
kernel_tests_status=$?
gpu_tests 300 tests/test_kernels_cuda.py "tests/test_kernels_cuda.py::numba-matrix" "$numba_matrix"
numba_matrix_status=$?
[ "$kernel_tests_status" -eq 0 ] && kernel_tests_status=$numba_matrix_status
report

# 5. Where the machine has MPS, AllReduce at 4 ranks again with the ranks' kernels sharing the
# GPU at once instead of taking turns: without MPS each step's handoff waits for the GPU to
# switch contexts (H200, 2026-12: about 0.5 ms per step at 2 ranks, 1 ms at 4). Its #wrong
# counts toward the bar; its timing and a failure to run do not. GPU_CHECK_MPS_CONTROL names
# the program (empty: no MPS run).
mps_control=${GPU_CHECK_MPS_CONTROL-$(command -v nvidia-cuda-mps-control)}
if [ -z "$mps_control" ]; then
  echo "# no nvidia-cuda-mps-control: no run under MPS" | tee -a "$out/collectives.txt"
elif ! no_time_left; then
  export CUDA_MPS_PIPE_DIRECTORY="$work/mps-pipe" CUDA_MPS_LOG_DIRECTORY="$work/mps-log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  # Without GPU_CHECK_RUN: reap, after the run, must not kill the daemon before it is quit.
  # To a file, not a pipe: the daemon may keep what it inherits open, and tee would wait.
  # -d returns once the daemon has forked: whether the ranks ran under it, its logs say.
  if env -u GPU_CHECK_RUN timeout 10 "$mps_control" -d < /dev/null >> "$out/collectives.txt" 2>&1; then
    bench_collective ", under MPS" mps-allreduce-4 4 allreduce --algorithm all
    { echo "# MPS servers after the run (the daemon starts one for its first client: none, the ranks ran without MPS):"
      echo get_server_list | timeout 10 "$mps_control"
      echo quit | timeout 10 "$mps_control" || echo "# MPS quit failed: exit $?"
      echo "# MPS logs, last lines:"
      tail -n 15 "$CUDA_MPS_LOG_DIRECTORY"/*.log
    } >> "$out/collectives.txt" 2>&1
  else
    echo "# nvidia-cuda-mps-control -d failed: no run under MPS" | tee -a "$out/collectives.txt"
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
fi
report

[ "$collective_tests_status" -eq 0 ] && [ "$kernel_tests_status" -eq 0 ] \
  && [ "$bench_status" -eq 0 ] && [ "$collectives_status" -eq 0 ]
