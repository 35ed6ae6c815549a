#!/usr/bin/env bash
# The sweep behind bench/results/cpu-shm.md: AllReduce, float32 sum, 8 B to 128 MiB by factors
# of 4, at 2 and 4 ranks, each row against native MPICH on the same buffers in the same run,
# with the node's memory roofline. Three setups per run:
#   mpi     pycoll over MPI messages (PYCOLL_HOST_TRANSPORT=mpi), auto
#   shm     pycoll over shared memory (the default on one node), auto, two_shot and ring
#   shared  shared memory with the arrays from pycoll.empty (no publish copies), auto, two_shot
# Repeated RUNS times; bench/summarize_shm.py takes medians.
#   bash bench/cpu_shm.sh [RUNS] [OUT_DIR]
set -euo pipefail
runs=${1:-3}
out=${2:-bench/results/raw-shm}
mkdir -p "$out"
sweep() {  # setup ranks run extra-args...
  local setup=$1 ranks=$2 run=$3
  shift 3
  mpiexec -n "$ranks" pycoll bench allreduce -b 8 -e 128M -f 4 -n 10 -w 2 -c 1 --in-place 0 -d float32 \
    -o sum --against mpi --roofline "$@" \
    --json "$out/$setup-$ranks-run$run.json" > "$out/$setup-$ranks-run$run.txt"
  echo "run $run: $setup on $ranks ranks done" >&2
}
for run in $(seq 1 "$runs"); do
  for ranks in 2 4; do
    PYCOLL_HOST_TRANSPORT=mpi sweep mpi "$ranks" "$run" --algorithm auto
    sweep shm "$ranks" "$run" --algorithm auto,two_shot,ring
    sweep shared "$ranks" "$run" --algorithm auto,two_shot --device shared
  done
done
