#!/usr/bin/env bash
# Everything pycoll checks on an NVIDIA GPU, in one call of well under 8 minutes, on a machine
# that may have no network: the GPU tests, the kernels' bandwidth, then AllReduce,
# ReduceScatter and AllGather at 2 and 4 MPI ranks sharing the GPU through CUDA IPC, every
# algorithm, with --check, and the ring AllReduce without forwarding (PYCOLL_FORWARD=0).
# Results go to $OUT (the device tool's folder) or bench/results/gpu-raw.
#   bash bench/fetch_wheels.sh   # here, with network: mpi4py, mpich, numpy wheels into .whl/
#   bash bench/gpu_check.sh      # there
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
deadline=$((SECONDS + ${GPU_CHECK_SECONDS:-450}))
within() { local left=$((deadline - SECONDS)); echo $(( left < $1 ? (left > 1 ? left : 1) : $1 )); }

{
  echo "# gpu_check $(date -u +%Y-%m-%dT%H:%MZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem \
    --format=csv 2>&1
  "$python" --version
  "$python" -m pip list 2>/dev/null | grep -iE "^(cupy|numba|numba-cuda|numpy|ml.dtypes|mpi4py) "
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
[ "${#wheels_here[@]}" -eq 0 ] || install_wheels "$prefix" "${wheels_here[@]}"
# pycoll laid out as pyproject.toml maps it (kernels/ and bindings/ inside the package), by
# copying: no build backend (setuptools, wheel) is needed there.
cp -r pycoll "$site/" && cp -r kernels "$site/pycoll/kernels" && cp -r bindings "$site/pycoll/bindings" \
  || { echo "could not lay out pycoll in $site" | tee -a "$out/environment.txt"; exit 1; }
wheels=$("$python" -c "import sysconfig; print(sysconfig.get_path('purelib', \
  vars={'base': '$prefix', 'platbase': '$prefix'}))")
export PYTHONPATH="$site:$wheels${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$prefix/bin:$PATH"  # mpiexec from the mpich wheel
export LD_LIBRARY_PATH="$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONSAFEPATH=1  # every python, MPI ranks too: the source tree must not shadow pycoll
{ command -v mpiexec; "$python" -c "from mpi4py import MPI; print(MPI.Get_library_version()[:40])"; \
  } 2>&1 | tee -a "$out/environment.txt"

# numba-cuda 0.30 cannot compile under numpy 2.5 (np.row_stack is gone; NVIDIA/numba-cuda#907,
# not to be fixed): where the machine's pair fails, the numpy 2.4 wheel from .whl goes first
# on the path (CuPy works with it), so that the Numba kernels are measured too.
numba_compiles() {
  timeout "$(within 60)" "$python" -P -c "
from numba import cuda
def one(x):
    x[0] = 1
cuda.compile_ptx(one, 'void(float32[:])', cc=(9, 0))" >/dev/null 2>&1
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
  echo "$said" | tee -a "$out/environment.txt"
fi

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

# 1. The GPU tests (they skip only where no GPU is found; here none should skip). The
# collectives first. The compile-only checks (nvcc, NVRTC for sm_80, Numba PTX, the
# simulator, the CUDA C built for the CPU) run in CI without a GPU: left out here, they
# would take over a minute of the 200 s.
timeout "$(within 200)" "$python" -P -m pytest -q -rs -p no:cacheprovider \
  -k "not nvcc and not nvrtc_compiles and not compile_to_ptx and not simulator_suite and not on-host" \
  tests/test_gpu_collectives.py tests/test_kernels_cuda.py 2>&1 | tee "$out/gpu-tests.txt"
tests_status=${PIPESTATUS[0]}

# 2. Each kernel's bandwidth (bytes read + written) against device copy and CuPy's add.
timeout "$(within 150)" "$python" -P -m pycoll bench kernels -b 1M -e 1G -f 4 -d float32,bfloat16 \
  --backend cupy,numba --json "$out/kernels.json" 2>&1 | tee "$out/kernels.txt"
bench_status=${PIPESTATUS[0]}

# 3. Collectives between MPI ranks sharing the GPU over CUDA IPC, every algorithm, checked.
collectives_status=0
: > "$out/collectives.txt"
for ranks in 2 4; do
  for collective in allreduce reduce_scatter allgather; do
    timeout "$(within 45)" mpiexec -n "$ranks" "$python" -P -m pycoll bench "$collective" --device cuda \
      --algorithm all -b 64K -e 64M -f 4 -n 10 -w 3 --check 1 \
      --json "$work/$collective-$ranks.json" 2>&1 | tee -a "$out/collectives.txt"
    status=${PIPESTATUS[0]}
    echo "# $collective on $ranks ranks: exit $status" | tee -a "$out/collectives.txt"
    [ "$status" -eq 0 ] || collectives_status=$status
  done
done

# 4. The ring's forwarding (reduce or copy and send in one pass) against two passes:
# PYCOLL_FORWARD=0, the same run as allreduce-4's ring rows otherwise.
timeout "$(within 45)" env PYCOLL_FORWARD=0 mpiexec -n 4 "$python" -P -m pycoll bench allreduce \
  --device cuda --algorithm ring -b 64K -e 64M -f 4 -n 10 -w 3 --check 1 \
  --json "$work/unforwarded-allreduce-4.json" 2>&1 | tee -a "$out/collectives.txt"
status=${PIPESTATUS[0]}
echo "# allreduce on 4 ranks, ring, PYCOLL_FORWARD=0: exit $status" | tee -a "$out/collectives.txt"
[ "$status" -eq 0 ] || collectives_status=$status

echo "gpu tests exit $tests_status, kernel bench exit $bench_status," \
  "collectives exit $collectives_status" | tee "$work/summary.txt"
# One page with issue 4's bars checked: commit it as bench/results/gpu-<device>.md.
cp "$out"/*.txt "$out"/kernels.json "$work"/ 2>/dev/null
"$python" bench/summarize_gpu.py "$work" > "$out/gpu-summary.md" 2>&1
if ls "$work"/*-[0-9]*.json >/dev/null 2>&1; then
  # shellcheck disable=SC2046  # the names are ours: no spaces
  tar -czf "$out/collectives.tar.gz" -C "$work" $(cd "$work" && ls -- *-[0-9]*.json)
fi
[ "$tests_status" -eq 0 ] && [ "$bench_status" -eq 0 ] && [ "$collectives_status" -eq 0 ]
