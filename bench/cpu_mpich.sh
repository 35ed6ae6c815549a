#!/usr/bin/env bash
# The sweep behind bench/results/cpu-mpich.md: AllReduce, ReduceScatter and AllGather, float32
# sum, 8 B to 128 MiB (-e 256M by factors of 4), at 2 and 4 ranks, every pycoll algorithm and auto, each
# against native MPICH in the same run. Repeated RUNS times; bench/summarize.py takes medians.
#   bash bench/cpu_mpich.sh [RUNS] [OUT_DIR]
set -euo pipefail
runs=${1:-3}
out=${2:-bench/results/raw}
mkdir -p "$out"
for run in $(seq 1 "$runs"); do
  for ranks in 2 4; do
    for collective in allreduce reduce_scatter allgather; do
      mpiexec -n "$ranks" pycoll bench "$collective" -b 8 -e 256M -f 4 -n 10 -w 2 -c 1 --in-place 0 \
        -d float32 -o sum --algorithm all --against mpi \
        --json "$out/$collective-$ranks-run$run.json" > "$out/$collective-$ranks-run$run.txt"
      echo "run $run: $collective on $ranks ranks done" >&2
    done
  done
done
