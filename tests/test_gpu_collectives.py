"""Collectives on CuPy arrays on a real GPU: in-process ranks (threads sharing the GPU, each
on a stream of its own) and MPI ranks over CUDA IPC, against the oracle.

These need an NVIDIA GPU and CuPy; without them each test skips with the reason "no CUDA GPU"
(bench/gpu_check.sh runs them on a GPU machine). The same protocol runs here, without a GPU,
on the stand-in device of tests/test_device_path.py.
"""

from __future__ import annotations

import pytest
from conftest import exact_input
from test_mpi import HERE, launch

import pycoll
from pycoll import oracle
from pycoll.algorithms import families_for
from pycoll.bench import COLLECTIVES


def _gpu_count() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy, no driver, no device
        return 0


needs_gpu = pytest.mark.skipif(_gpu_count() == 0, reason="no CUDA GPU")
GPU_LAUNCH = 90  # seconds an mpiexec of these tests may take (a GPU-side wait has no deadline)
DTYPES = ["float32", "int32", "bfloat16", "float16", "int8", "float64"]


def _on_gpu(nranks, fn):
    import cupy

    def body():
        rank = pycoll.world().rank
        stream = cupy.cuda.Stream(non_blocking=True)
        result = fn(rank, stream)
        stream.synchronize()
        return None if result is None else result.get()

    return pycoll.run_local(nranks, body)


@needs_gpu
@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather"])
def test_in_process_collectives_on_cupy_arrays(collective, nranks):
    import cupy
    import numpy as np

    kind = COLLECTIVES[collective]
    for index, count in enumerate([0, 1, nranks + 1, 1000, 1 << 20]):
        dtype = np.dtype(pycoll.kernels.check_dtype(DTYPES[index % len(DTYPES)]))
        op = ["sum", "max", "min", "avg", "prod"][index % 5] if collective != "allgather" else None
        inputs = [exact_input(r, count, dtype, op or "sum", index) for r in range(nranks)]
        counts = [count // nranks + (r < count % nranks) for r in range(nranks)]
        for algorithm in families_for(kind):
            def call(rank, stream, algorithm=algorithm, inputs=inputs, op=op, counts=counts):
                with stream:  # the upload, ordered before the collective on the same stream
                    x = cupy.asarray(inputs[rank])
                if collective == "allreduce":
                    return pycoll.allreduce(x, op, algorithm=algorithm, stream=stream)
                if collective == "reduce_scatter":
                    return pycoll.reduce_scatter(
                        x, op, counts=counts, algorithm=algorithm, stream=stream
                    )
                return pycoll.allgather(x, algorithm=algorithm, stream=stream)

            results = _on_gpu(nranks, call)
            for rank, got in enumerate(results):
                if collective == "allreduce":
                    want = oracle.allreduce(inputs, op)
                elif collective == "reduce_scatter":
                    want = oracle.reduce_scatter(inputs, op, counts)[rank]
                else:
                    want = oracle.allgather(inputs)
                np.testing.assert_array_equal(got, want, err_msg=f"{algorithm} {count} {dtype}")


@needs_gpu
@pytest.mark.parametrize("nranks", [2, 3])
def test_allgather_and_reduce_scatter_in_place_on_cupy_arrays(nranks):
    """NCCL's in place: AllGather's x is this rank's rows of out, ReduceScatter's out this
    rank's rows of x (the copy of a block onto itself is skipped: CUDA's memcpy takes no
    overlap)."""
    import cupy
    import numpy as np

    for count in [1, nranks + 1, 1000, 1 << 20]:
        counts = [count // nranks + (r < count % nranks) for r in range(nranks)]
        starts = np.cumsum([0, *counts])
        inputs = [exact_input(r, count, np.dtype(np.float32), "sum", count)
                  for r in range(nranks)]
        for algorithm in families_for(COLLECTIVES["allgather"]):
            def call(rank, stream, algorithm=algorithm, inputs=inputs, counts=counts,
                     starts=starts, count=count):
                with stream:
                    gathered = cupy.zeros(count, np.float32)
                    gathered[starts[rank]:starts[rank + 1]] = cupy.asarray(
                        inputs[rank][starts[rank]:starts[rank + 1]])
                    x = cupy.asarray(inputs[rank])
                mine = gathered[starts[rank]:starts[rank + 1]]
                pycoll.allgather(mine, counts=counts, out=gathered, algorithm=algorithm,
                                 stream=stream)
                shard = x[starts[rank]:starts[rank + 1]]
                pycoll.reduce_scatter(x, counts=counts, out=shard, algorithm=algorithm,
                                      stream=stream)
                with stream:
                    return cupy.concatenate([gathered, shard])

            pieces = [inputs[r][starts[r]:starts[r + 1]] for r in range(nranks)]
            sums = oracle.reduce_scatter(inputs, "sum", counts)
            for rank, got in enumerate(_on_gpu(nranks, call)):
                np.testing.assert_array_equal(got[:count], oracle.allgather(pieces),
                                              err_msg=f"allgather {algorithm} {count}")
                np.testing.assert_array_equal(got[count:], sums[rank],
                                              err_msg=f"reduce_scatter {algorithm} {count}")


@needs_gpu
def test_calls_alternating_between_two_streams_without_host_waits():
    """Each rank's calls alternate between two streams and nobody synchronises between
    them: a call is ordered after the previous one's reads of its inbox slots."""
    import cupy
    import numpy as np

    sizes = [999, 1 << 16, 1000, 1 << 16, 37] * 20
    inputs = [[np.arange(n, dtype=np.int64) * (r + 1) + i for i, n in enumerate(sizes)]
              for r in range(3)]

    def body():
        rank = pycoll.world().rank
        streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
        outs = []
        for i, x in enumerate(inputs[rank]):
            with streams[i % 2]:
                outs.append(pycoll.allreduce(cupy.asarray(x), algorithm="ring",
                                             stream=streams[i % 2]))
        for stream in streams:
            stream.synchronize()
        return [o.get() for o in outs]

    results = pycoll.run_local(3, body)
    for i in range(len(sizes)):
        want = oracle.allreduce([inputs[r][i] for r in range(3)], "sum")
        for outs in results:
            np.testing.assert_array_equal(outs[i], want, err_msg=f"call {i}")


@needs_gpu
def test_async_calls_run_on_the_callers_stream():
    """async_op=True without stream=: ordered on the caller's current stream, which the
    async worker thread does not share; the caller's stream completes the call."""
    import cupy
    import numpy as np

    inputs = [np.arange(1 << 16, dtype=np.int64) * (r + 2) for r in range(3)]

    def body():
        rank = pycoll.world().rank
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            x = cupy.asarray(inputs[rank]) * 1  # queued on stream, before the call
            out = pycoll.allreduce(x, algorithm="ring", async_op=True).wait()
        stream.synchronize()
        return out.get()

    for got in pycoll.run_local(3, body):
        np.testing.assert_array_equal(got, oracle.allreduce(inputs, "sum"))


@needs_gpu
def test_async_calls_on_the_per_thread_default_stream():
    """On CUDA's per-thread default stream (whose handle names the worker's own stream there)
    the call runs after the caller's work queued before it, and after wait() the caller's
    per-thread stream runs after the call."""
    import cupy
    import numpy as np

    inputs = [np.arange(1 << 16, dtype=np.int64) * (r + 2) for r in range(3)]

    def body():
        rank = pycoll.world().rank
        with cupy.cuda.Stream.ptds:
            x = cupy.asarray(inputs[rank]) * 1  # queued on this thread's stream
            out = pycoll.allreduce(x, algorithm="ring", async_op=True).wait()
            after = out + 0  # this thread's stream, after wait()
            cupy.cuda.Stream.ptds.synchronize()
        return after.get()

    for got in pycoll.run_local(3, body):
        np.testing.assert_array_equal(got, oracle.allreduce(inputs, "sum"))


@needs_gpu
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_complex_cupy_arrays_reduce_as_float_pairs(op):
    import cupy
    import numpy as np

    inputs = [(np.arange(1000) + 1j * (np.arange(1000) - r)).astype(np.complex64)
              for r in range(3)]

    def call(rank, stream):
        with stream:
            return pycoll.allreduce(cupy.asarray(inputs[rank]), op, stream=stream)

    for got in _on_gpu(3, call):
        np.testing.assert_array_equal(got, oracle.allreduce(inputs, op))


@needs_gpu
def test_verification_reads_device_results_on_their_stream(monkeypatch):
    """PYCOLL_VERIFY=1 on CuPy arrays: the input is copied to the host before the call and the
    result after it, on the call's stream; right results pass (float sums in ring order)."""
    import cupy
    import numpy as np

    monkeypatch.setenv("PYCOLL_VERIFY", "1")
    inputs = [np.random.default_rng(r).normal(size=100_003).astype(np.float32)
              for r in range(3)]

    def call(rank, stream):
        with stream:
            x = cupy.asarray(inputs[rank])
        total = pycoll.allreduce(x, algorithm="ring", stream=stream)
        pycoll.broadcast(x, root=2, stream=stream)
        return pycoll.allgather(total[:10], stream=stream)

    want = np.tile(oracle.allreduce(inputs, "sum")[:10], 3)
    for got in _on_gpu(3, call):  # each call above raised nothing: verified
        np.testing.assert_allclose(got, want, rtol=1e-5)



# Between MPI processes last: bench/gpu_check.sh runs this file under a time cap, and a
# launch that hangs on the GPU must not cost the tests above.
@needs_gpu
@pytest.mark.parametrize("nranks", [2, 3])
def test_mpi_ranks_over_cuda_ipc(nranks):
    done = launch(nranks, "-m", "mpi4py", str(HERE / "device.py"), "cuda", timeout=GPU_LAUNCH)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert f"device collectives on {nranks} ranks:" in output, output  # not singletons
    assert ", 0 failed" in output


@needs_gpu
def test_mpi_ranks_staged_through_the_host(monkeypatch):
    monkeypatch.setenv("PYCOLL_DEVICE_TRANSPORT", "staged")
    done = launch(2, "-m", "mpi4py", str(HERE / "device.py"), "cuda", timeout=GPU_LAUNCH)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "device collectives on 2 ranks:" in output, output
    assert ", 0 failed" in output


@needs_gpu
def test_a_rank_killed_with_its_inbox_mapped_ends_the_job():
    """A rank dies after the first CuPy collective (peers have its inbox and event open):
    the others, waiting in the next one, are ended by the launcher, not left hanging."""
    import time

    started = time.monotonic()
    done = launch(3, str(HERE / "faults.py"), "kill-cuda", timeout=GPU_LAUNCH)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "finished, which it must not" not in output
    assert time.monotonic() - started < 60, output
