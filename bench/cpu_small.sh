#!/usr/bin/env bash
# Small messages, where pycoll's own Python time per call decides: AllReduce, ReduceScatter,
# AllGather, Broadcast and Reduce, float32 sum, 8 B to 8 KiB by factors of 4, 2 ranks, auto,
# each against native MPICH in the same run, over MPI messages (PYCOLL_HOST_TRANSPORT=mpi) and
# over shared memory (the default on one node). With OLD set to a folder holding another
# tree's importable `pycoll` package, every run does that tree too, alternating with this one,
# so that both meet the same machine.
#   bash bench/cpu_small.sh [RUNS] [OUT_DIR]        (OLD=/path/to/layout optional)
set -euo pipefail
runs=${1:-3}
out=${2:-bench/results/raw-small}
mkdir -p "$out"
trees=(new)
[[ -n "${OLD:-}" ]] && trees=(old new)
for run in $(seq 1 "$runs"); do
  for transport in mpi shm; do
    for collective in allreduce reduce_scatter allgather broadcast reduce; do
      for tree in "${trees[@]}"; do
        path=$([[ $tree == old ]] && echo "$OLD" || echo "")
        name="$out/$tree-$transport-$collective-run$run"
        PYTHONPATH=$path PYCOLL_HOST_TRANSPORT=$transport mpiexec -n 2 python -P -m pycoll \
          bench "$collective" -b 8 -e 8K -f 4 -n 50 -w 5 -c 1 -d float32 -o sum \
          --algorithm auto --against mpi --json "$name.json" > "$name.txt"
      done
    done
    echo "run $run: $transport done" >&2
  done
done
