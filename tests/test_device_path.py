"""The device path (the API on device arrays, the executor, and the device transports: peer
memory as CUDA IPC runs it, staged MPI, and routes mixing them) on a stand-in device whose
streams run lazily in a random valid order (tests/fake_device.py), against the oracle.

What CUDA itself does is checked on a GPU (tests/test_kernels_cuda.py, bench/gpu_check.sh);
here it is the protocol: handles, credits and notices, which stream waits on which event,
and reusing an inbox only after its readers ran.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import ALL_DTYPES, exact_input, ops_for
from fake_device import FakeDevice, FakeStream, device_array, host_array

import pycoll
from pycoll import oracle, spaces
from pycoll.algorithms import families_for
from pycoll.bindings import peer_memory, staged
from pycoll.schedule import Collective

MODES = {  # PYCOLL_DEVICE_TRANSPORT, PYCOLL_RANKS_PER_NODE
    "peer-memory": ("auto", ""),
    "staged": ("staged", ""),
    "routed": ("auto", "2"),
}
RANKS = [1, 2, 3, 5]


def sizes(nranks: int) -> list[int]:
    return sorted({0, 1, nranks + 1, 13, 1000})


@pytest.fixture(params=list(MODES))
def device(request, monkeypatch):
    mode, per_node = MODES[request.param]
    monkeypatch.setenv("PYCOLL_DEVICE_TRANSPORT", mode)
    monkeypatch.setenv("PYCOLL_RANKS_PER_NODE", per_node)
    monkeypatch.setattr(staged, "PIECE_BYTES", 1000)  # messages of 1000 elements: pieces
    fake = FakeDevice(seed=hash(request.node.name) % 1000)
    spaces.register(fake)
    yield fake
    spaces.unregister(fake)


def on_device(device, nranks, fn):
    """Run ``fn(rank)`` (returning device arrays or None) on in-process ranks; each rank
    synchronises its stream before the host reads the results."""

    def body():
        rank = pycoll.world().rank
        result = fn(rank)
        device.synchronize()
        return None if result is None else host_array(result)

    return pycoll.run_local(nranks, body)


def cases(collective):
    return [
        (algorithm, n, count)
        for algorithm in families_for(collective)
        for n in RANKS
        for count in sizes(n)
    ]


def pick(index, reducing=True):
    dtype = ALL_DTYPES[index % len(ALL_DTYPES)]
    # complex device arrays reduce as float pairs: sum and avg (prod: test below)
    ops = [op for op in ops_for(dtype) if not (dtype.kind == "c" and op == "prod")]
    return dtype, (ops[(index // len(ALL_DTYPES)) % len(ops)] if reducing else None)


@pytest.mark.parametrize("algorithm,nranks,count", cases(Collective.ALLREDUCE))
def test_allreduce(device, algorithm, nranks, count):
    index = nranks * 7 + count
    dtype, op = pick(index)
    inputs = [exact_input(r, count, dtype, op, index) for r in range(nranks)]
    results = on_device(
        device, nranks,
        lambda r: pycoll.allreduce(device_array(inputs[r]), op, algorithm=algorithm),
    )
    expected = oracle.allreduce(inputs, op)
    for result in results:
        np.testing.assert_array_equal(result, expected)


@pytest.mark.parametrize("algorithm,nranks,count", cases(Collective.REDUCE_SCATTER))
def test_reduce_scatter_with_uneven_counts(device, algorithm, nranks, count):
    index = nranks * 5 + count
    dtype, op = pick(index)
    counts = [count // nranks + (1 if r < count % nranks else 0) for r in range(nranks)]
    inputs = [exact_input(r, count, dtype, op, index) for r in range(nranks)]
    results = on_device(
        device, nranks,
        lambda r: pycoll.reduce_scatter(
            device_array(inputs[r]), op, counts=counts, algorithm=algorithm
        ),
    )
    expected = oracle.reduce_scatter(inputs, op, counts)
    for rank, result in enumerate(results):
        np.testing.assert_array_equal(result, expected[rank])


@pytest.mark.parametrize("algorithm,nranks,count", cases(Collective.ALLGATHER))
def test_allgather(device, algorithm, nranks, count):
    dtype, _ = pick(count, reducing=False)
    inputs = [exact_input(r, count, dtype, "sum") for r in range(nranks)]
    results = on_device(
        device, nranks, lambda r: pycoll.allgather(device_array(inputs[r]), algorithm=algorithm)
    )
    for result in results:
        np.testing.assert_array_equal(result, oracle.allgather(inputs))


@pytest.mark.parametrize("algorithm,nranks,count", cases(Collective.BROADCAST))
def test_broadcast(device, algorithm, nranks, count):
    root = nranks - 1
    inputs = [exact_input(r, count, np.dtype(np.int32), "sum") for r in range(nranks)]
    results = on_device(
        device, nranks,
        lambda r: pycoll.broadcast(device_array(inputs[r]), root, algorithm=algorithm),
    )
    for result in results:
        np.testing.assert_array_equal(result, oracle.broadcast(inputs, root))


@pytest.mark.parametrize("algorithm,nranks,count", cases(Collective.REDUCE))
def test_reduce(device, algorithm, nranks, count):
    root = nranks // 2
    inputs = [exact_input(r, count, np.dtype(np.int64), "max") for r in range(nranks)]
    results = on_device(
        device, nranks,
        lambda r: pycoll.reduce(device_array(inputs[r]), "max", root, algorithm=algorithm),
    )
    np.testing.assert_array_equal(results[root], oracle.reduce(inputs, "max", root))
    assert all(result is None for rank, result in enumerate(results) if rank != root)


@pytest.mark.parametrize("nranks", RANKS)
def test_alltoall_alltoallv_and_send_recv(device, nranks):
    inputs = [np.arange(nranks * 3, dtype=np.float32) + 100 * r for r in range(nranks)]
    sends = [[(r + j) % 3 for j in range(nranks)] for r in range(nranks)]

    def body(rank):
        everyone = pycoll.alltoall(device_array(inputs[rank]))
        varied = pycoll.alltoallv(device_array(inputs[rank][: sum(sends[rank])]), sends[rank])
        into = device_array(np.full(varied.shape, -1, np.float32))  # an out of the caller's
        assert pycoll.alltoallv(device_array(inputs[rank][: sum(sends[rank])]), sends[rank],
                                out=into) is into
        device.synchronize()
        np.testing.assert_array_equal(host_array(into), host_array(varied))
        ring = device_array(np.full(4, -1.0, np.float32))
        mine = device_array(np.full(4, rank, np.float32))
        for turn in (rank % 2, 1 - rank % 2) if nranks > 1 else ():  # sends block: alternate
            if turn == 0:
                pycoll.send(mine, (rank + 1) % nranks, tag=3)
            else:
                pycoll.recv(ring, (rank - 1) % nranks, tag=3)
        device.synchronize()
        return np.concatenate([host_array(a) for a in (everyone, varied, ring)])

    results = pycoll.run_local(nranks, lambda: body(pycoll.world().rank))
    arrivals = oracle.alltoall(inputs)
    pieces = [inputs[r][: sum(sends[r])] for r in range(nranks)]
    varied = oracle.alltoallv(pieces, sends)
    for rank, result in enumerate(results):
        ring = np.full(4, (rank - 1) % nranks if nranks > 1 else -1.0, np.float32)
        np.testing.assert_array_equal(result, np.concatenate([arrivals[rank], varied[rank], ring]))


def test_in_place_and_on_an_explicit_stream(device):
    """out=x in place, on a stream of the caller's: the result is ready when that stream is,
    and the thread's default stream was not used."""
    inputs = [exact_input(r, 50, np.dtype(np.int16), "sum") for r in range(3)]

    def body(rank):
        stream = device.new_stream(f"user-{rank}")
        x = device_array(inputs[rank])
        with device.using(stream):  # the arrays' own uploads are ready at once
            pass
        pycoll.allreduce(x, out=x, algorithm="ring", stream=stream)
        pycoll.allreduce(x, "avg", out=x, algorithm="direct", stream=stream)
        assert device.current_stream().last is None  # nothing went to the default stream
        with device.using(stream):
            device.synchronize()
        return host_array(x)

    results = pycoll.run_local(3, lambda: body(pycoll.world().rank))
    expected = oracle.allreduce([oracle.allreduce(inputs, "sum")] * 3, "avg")
    for result in results:
        np.testing.assert_array_equal(result, expected)


@pytest.mark.parametrize("algorithm", families_for(Collective.ALLGATHER))
@pytest.mark.parametrize("nranks", RANKS)
def test_allgather_and_reduce_scatter_in_place(device, algorithm, nranks):
    """NCCL's in place on device arrays: AllGather's x is this rank's rows of out,
    ReduceScatter's out is this rank's rows of x; uneven rows where the count does not
    divide."""
    for count in sizes(nranks):
        _in_place_round(device, algorithm, nranks, count)


def _in_place_round(device, algorithm, nranks, count):
    dtype, op = pick(count + nranks)
    counts = [count // nranks + (r < count % nranks) for r in range(nranks)]
    starts = np.cumsum([0, *counts])
    pieces = [exact_input(r, counts[r], dtype, op, count) for r in range(nranks)]
    inputs = [exact_input(r, count, dtype, op, count) for r in range(nranks)]

    def body(rank):
        gathered = device_array(np.zeros(count, dtype))
        mine = gathered[starts[rank]:starts[rank + 1]]
        mine[...] = device_array(pieces[rank])
        assert pycoll.allgather(mine, counts=counts, out=gathered,
                                algorithm=algorithm) is gathered
        x = device_array(inputs[rank])
        shard = x[starts[rank]:starts[rank + 1]]
        assert pycoll.reduce_scatter(x, op, counts=counts, out=shard,
                                     algorithm=algorithm) is shard
        device.synchronize()
        return device_array(np.concatenate([host_array(gathered), host_array(shard)]))

    expected = oracle.reduce_scatter(inputs, op, counts)
    for rank, result in enumerate(on_device(device, nranks, body)):
        np.testing.assert_array_equal(result[:count], oracle.allgather(pieces))
        np.testing.assert_array_equal(result[count:], expected[rank])


def test_stream_for_numpy_arrays_is_an_error():
    with pytest.raises(ValueError, match="^allreduce: stream=.*numpy arrays; allowed: None"):
        pycoll.allreduce(np.ones(3), stream=object())


@pytest.mark.parametrize("call", ["allgather", "recv"])
def test_what_is_not_a_stream_is_refused_by_the_collectives_name(device, call):
    def body():
        x, peer = device_array(np.ones(3)), 1 - pycoll.world().rank
        with pytest.raises(TypeError, match=f"^{call}: stream='s' is not a FakeStream"):
            if call == "recv":
                pycoll.recv(x, peer, stream="s")
            else:
                pycoll.allgather(x, stream="s")
        return True

    assert pycoll.run_local(2, body) == [True, True]


def test_out_in_another_memory_is_an_error(device):
    def body():
        with pytest.raises(TypeError, match="out is a ndarray but x is a DeviceArray"):
            pycoll.allreduce(device_array(np.ones(3)), out=np.empty(3))
        return True

    assert pycoll.run_local(2, body) == [True, True]


def test_bad_device_transport_names_the_variable(device, monkeypatch):
    monkeypatch.setenv("PYCOLL_DEVICE_TRANSPORT", "nvlink")
    with pytest.raises(ValueError, match="PYCOLL_DEVICE_TRANSPORT='nvlink' is invalid; allowed"):
        pycoll.run_local(2, lambda: pycoll.allreduce(device_array(np.ones(3))))


def test_forcing_peer_memory_across_nodes_is_an_error(device, monkeypatch):
    monkeypatch.setenv("PYCOLL_DEVICE_TRANSPORT", "ipc")
    monkeypatch.setenv("PYCOLL_RANKS_PER_NODE", "1")
    with pytest.raises(ValueError, match="ipc but the ranks span 2 nodes"):
        pycoll.run_local(2, lambda: pycoll.allreduce(device_array(np.ones(3))))


# --- the peer-memory protocol itself ------------------------------------------------------


def _many_allreduces(device, nranks, sizes_in_order, algorithm="ring"):
    inputs = {n: [np.arange(n, dtype=np.int64) * (r + 1) for r in range(nranks)]
              for n in sizes_in_order}

    def body(rank):
        outs = [pycoll.allreduce(device_array(inputs[n][rank]), algorithm=algorithm)
                for n in sizes_in_order]
        device.synchronize()
        return [host_array(o) for o in outs], pycoll.world()

    results = pycoll.run_local(nranks, lambda: body(pycoll.world().rank))
    for i, n in enumerate(sizes_in_order):
        expected = oracle.allreduce(inputs[n], "sum")
        for outs, _ in results:
            np.testing.assert_array_equal(outs[i], expected)
    return [comm for _, comm in results]


@pytest.fixture
def peer_device(monkeypatch):
    monkeypatch.setenv("PYCOLL_DEVICE_TRANSPORT", "auto")
    monkeypatch.delenv("PYCOLL_RANKS_PER_NODE", raising=False)
    fake = FakeDevice(seed=7)
    spaces.register(fake)
    yield fake
    spaces.unregister(fake)


def test_inboxes_grow_and_outgrown_ones_stay_alive(peer_device):
    comms = _many_allreduces(peer_device, 3, [10, 100_000, 20, 300_000, 5])
    for comm in comms:
        transport = comm.device_transport(peer_device)
        sizes_seen = [inbox.capacity for inbox in transport._inboxes]
        assert len(sizes_seen) >= 2 and sizes_seen == sorted(sizes_seen)
        assert not any(inbox.allocation.freed for inbox in transport._inboxes)


def test_handles_are_opened_once_per_inbox_and_closed_on_close(peer_device):
    comms = _many_allreduces(peer_device, 3, [64] * 6)
    for comm in comms:
        transport = comm.device_transport(peer_device)
        # each inbox opened at most once by each of the 2 peers, however many calls used it
        opens = [transport.access.open_count(inbox.allocation) for inbox in transport._inboxes]
        assert 1 <= opens[-1] and all(count <= 2 for count in opens), opens
    for comm in comms:
        comm.device_transport(peer_device).close()
    for comm in comms:
        transport = comm.device_transport(peer_device)
        assert all(transport.access.open_count(i.allocation) == 0 for i in transport._inboxes)


def test_freeing_device_buffers_unmaps_everywhere_before_anyone_frees(peer_device):
    def body():
        comm = pycoll.world()
        for n in (5000, 70):
            pycoll.allreduce(device_array(np.ones(n, np.int32)), algorithm="ring")
        transport = comm.device_transport(peer_device)
        mine = list(transport._inboxes)
        opened_before = [transport.access.open_count(i.allocation) for i in mine]
        pycoll.barrier()  # every rank counted before any unmaps
        comm.free_device_buffers()
        opened_after = [transport.access.open_count(i.allocation) for i in mine]
        again = pycoll.allreduce(device_array(np.ones(9, np.int32)))  # new buffers
        peer_device.synchronize()
        return opened_before, opened_after, transport._inboxes, host_array(again), comm

    results = pycoll.run_local(3, body)
    for before, after, kept, again, comm in results:
        assert sum(before) >= 1 and after == [0] * len(after) and kept == []
        np.testing.assert_array_equal(again, np.full(9, 3))
        assert comm.device_transport(peer_device)._inboxes  # the new endpoint's


def test_a_rank_never_opens_its_own_handle(peer_device):
    comms = _many_allreduces(peer_device, 2, [16])
    transport = comms[0].device_transport(peer_device)
    handle = transport._inboxes[0].handle
    with pytest.raises(RuntimeError, match="cannot open its own handle"):
        transport.access.open(handle, transport._inboxes[0].capacity)


# removed wait -> (the function that waits, the function calling it, or None for any)
WAITS = {
    "data-ready wait": ("_deliver", None),
    "slot-free wait": ("_peer_slot", None),
    "forward's slot-free wait": ("_peer_slot", "_deliver"),  # the ring's reduce-and-forward
}


@pytest.mark.parametrize("removed", list(WAITS))
def test_the_stand_in_catches_a_missing_event_wait(removed, monkeypatch, peer_device):
    """Guard for this file: drop either wait of the protocol and results go wrong."""
    original_wait = peer_device.wait
    waiter, caller = WAITS[removed]

    def wait_unless_called_from(event):
        import inspect

        stack = inspect.stack()
        if stack[1].function != waiter or caller not in (None, stack[2].function):
            original_wait(event)

    monkeypatch.setattr(peer_device, "wait", wait_unless_called_from)
    with pytest.raises(AssertionError):
        for seed in range(5):
            peer_device._rng.seed(seed)
            _many_allreduces(peer_device, 4, [1000, 999, 1000, 37], algorithm="ring")


def test_counts_that_disagree_between_peers_are_reported(peer_device):
    def body():
        rank = pycoll.world().rank
        transport = pycoll.world().device_transport(peer_device)
        data = device_array(np.zeros(4 if rank == 0 else 5, np.int32))
        if rank == 0:
            transport.waitall([transport.isend(data, 1, 9)])
        else:
            transport.waitall([transport.irecv(data, 0, 9)])

    with pytest.raises((ValueError, pycoll.PeerFailed), match="disagree on counts|failed"):
        pycoll.run_local(2, body)


def test_slots_are_16_byte_aligned():
    fake = FakeDevice()
    credits = type("Host", (), {"rank": 0, "size": 1, "waitall": lambda self, requests: None})()
    transport = peer_memory.PeerMemoryTransport(
        fake, peer_memory.SameProcessAccess(), credits, credits
    )
    offsets = [transport._claim(n)[1] for n in (3, 5, 16, 1)]
    assert offsets == [0, 16, 32, 48]


def test_only_peers_in_other_processes_get_an_ipc_event():
    """CUDA IPC events need a /dev/shm shared with the peer: threads of one process take
    plain events, so a machine where IPC events fail still runs them."""
    fake = FakeDevice()
    credits = type("Host", (), {"rank": 0, "size": 1, "waitall": lambda self, requests: None})()
    threads = peer_memory.PeerMemoryTransport(fake, peer_memory.SameProcessAccess(), credits,
                                              credits)
    processes = peer_memory.PeerMemoryTransport(
        fake, fake.peer_access_for({}, 0), credits, credits)
    assert not threads._event.interprocess and processes._event.interprocess
    with pytest.raises(RuntimeError, match="not made for IPC"):
        fake.peer_access_for({}, 0).export_event(fake.new_event(interprocess=False))


def test_stand_in_streams_run_nothing_until_synchronised():
    fake = FakeDevice()
    x = device_array(np.zeros(4))
    fake.copy(x, device_array(np.ones(4)))
    assert x.sum() == 0  # enqueued, not run
    fake.synchronize()
    assert x.sum() == 4
    assert isinstance(fake.new_stream(), FakeStream)


def test_a_deadline_reaches_the_device_transports(device):
    """comm.timeout also bounds device collectives' waits (through the host messages they
    wait on): a rank that never comes is named, not waited for."""
    import threading

    gate = threading.Barrier(3)

    def body():
        comm = pycoll.world()
        comm.timeout = 0.3
        pycoll.allreduce(device_array(np.ones(4, np.float32)))  # the device transport exists
        if comm.rank == 1:
            gate.wait()
            return None
        try:
            pycoll.allreduce(device_array(np.ones(4000, np.float32)), algorithm="ring")
        except pycoll.CollectiveTimeout as error:
            message = str(error)
        gate.wait()
        return message

    results = pycoll.run_local(3, body)
    assert results[2].startswith("allreduce (ring): rank 2 waited 0.3 s")
    assert results[2].endswith("for rank(s) 1")


# --- Send/Recv endpoints, streams, and freeing ----------------------------------------------


@pytest.mark.parametrize("nranks", [3, 5])
def test_send_recv_between_two_ranks_while_the_others_do_not_take_part(device, nranks):
    """Send/Recv's device endpoint is made by the pair alone: ranks outside the call are
    never waited for (they would be, were it made collectively). Ranks 0 and n-1 send there
    and back; at 5 ranks, 1 sends to 2 meanwhile and 3 sits out."""
    last = nranks - 1

    def body(rank):
        got = device_array(np.full(6, -1, np.int64))
        if rank == 0:
            pycoll.send(device_array(np.arange(6, dtype=np.int64)), last, tag=1)
            pycoll.recv(got, last, tag=2)
        elif rank == last:
            pycoll.recv(got, 0, tag=1)
            pycoll.send(got, 0, tag=2)  # what arrived, in stream order
        elif rank == 1 and nranks > 3:
            pycoll.send(device_array(np.full(6, 7, np.int64)), 2, tag=4)
        elif rank == 2 and nranks > 3:
            pycoll.recv(got, 1, tag=4)
        device.synchronize()
        return host_array(got)

    results = pycoll.run_local(nranks, lambda: body(pycoll.world().rank))
    assert results[0].tolist() == results[last].tolist() == list(range(6))
    if nranks > 3:
        assert results[2].tolist() == [7] * 6
        assert results[3].tolist() == [-1] * 6


def _alternating_streams(device, nranks, sizes_in_order):
    """Back-to-back ring AllReduces, each on the other of two streams, no host wait between."""
    inputs = {n: [np.arange(n, dtype=np.int64) * (r + 1) + i for r in range(nranks)]
              for i, n in enumerate(sizes_in_order)}

    def body(rank):
        streams = [device.new_stream(f"rank{rank}-a"), device.new_stream(f"rank{rank}-b")]
        outs = [pycoll.allreduce(device_array(inputs[n][rank]), algorithm="ring",
                                 stream=streams[i % 2]) for i, n in enumerate(sizes_in_order)]
        for stream in streams:
            with device.using(stream):
                device.synchronize()
        return [host_array(o) for o in outs]

    for outs in pycoll.run_local(nranks, lambda: body(pycoll.world().rank)):
        for out, n in zip(outs, sizes_in_order):
            np.testing.assert_array_equal(out, oracle.allreduce(inputs[n], "sum"))


def test_calls_on_alternating_streams_reuse_inbox_slots_safely(peer_device):
    """A call on another stream than the last is ordered after the last one's work: its
    inbox slots are the ones the previous call is still reading."""
    for seed in range(5):
        peer_device._rng.seed(seed)
        _alternating_streams(peer_device, 3, [999, 1000, 998, 1000, 37, 1000])


def test_the_stand_in_catches_calls_on_two_streams_left_unordered(monkeypatch, peer_device):
    """Guard for the test above: without ordering the streams, results go wrong."""
    monkeypatch.setattr(peer_memory.PeerMemoryTransport, "on_current_stream", lambda self: None)
    with pytest.raises(AssertionError):
        for seed in range(5):
            peer_device._rng.seed(seed)
            _alternating_streams(peer_device, 3, [999, 1000, 998, 1000, 37, 1000])


def test_freeing_device_buffers_right_after_a_call_waits_for_its_work(peer_device):
    """free_device_buffers() with the last call's copies still queued: each rank finishes
    its own before unmapping, so no inbox is freed under queued work."""

    def body(rank):
        comm = pycoll.world()
        x = pycoll.allreduce(device_array(np.arange(3000, dtype=np.int64) + rank),
                             algorithm="ring")
        comm.free_device_buffers()  # no synchronisation before
        peer_device.synchronize()
        return host_array(x)

    for seed in range(3):
        peer_device._rng.seed(seed)
        for out in pycoll.run_local(3, lambda: body(pycoll.world().rank)):
            np.testing.assert_array_equal(out, np.arange(3000) * 3 + 3)


def test_the_stand_in_catches_a_free_under_queued_work(monkeypatch, peer_device):
    """Guard: if close() did not wait for this rank's queued work, work would run on freed
    inboxes."""
    monkeypatch.setattr(peer_device, "synchronize", lambda: None, raising=True)

    def body(rank):
        x = pycoll.allreduce(device_array(np.arange(3000, dtype=np.int64) + rank),
                             algorithm="ring")
        pycoll.world().free_device_buffers()
        return x

    pycoll.run_local(3, lambda: body(pycoll.world().rank))
    with pytest.raises(RuntimeError, match="touches freed memory"):
        peer_device.synchronize_all()  # once every rank has freed


def test_the_stand_in_refuses_to_free_memory_a_peer_still_maps(peer_device):
    def body():
        pycoll.allreduce(device_array(np.ones(100, np.int32)), algorithm="ring")
        peer_device.synchronize()
        pycoll.barrier()
        transport = pycoll.world().device_transport(peer_device)
        inbox = transport._inboxes[0].allocation
        opened = transport.access.open_count(inbox)
        pycoll.barrier()
        if opened:
            with pytest.raises(RuntimeError, match="peer mapping"):
                peer_device.free(inbox)
        pycoll.barrier()
        pycoll.world().free_device_buffers()
        return opened, inbox.freed

    results = pycoll.run_local(3, body)
    assert all(opened >= 1 and freed for opened, freed in results)


def test_send_recv_errors_name_the_communicators_ranks(peer_device):
    """A pair's endpoint numbers its two ranks 0 and 1 inside; what it reports names them
    as the communicator does: a timeout waits for rank 3, a count mismatch is rank 0's."""
    import threading

    gate = threading.Barrier(4)

    def body():
        comm = pycoll.world()
        comm.timeout = 0.3
        message = None
        if comm.rank == 0:
            pycoll.send(device_array(np.ones(4, np.float32)), 3, tag=1)
            try:
                pycoll.send(device_array(np.ones(4, np.float32)), 3, tag=2)  # never received
            except pycoll.CollectiveTimeout as error:
                message = str(error)
        elif comm.rank == 3:
            pycoll.recv(device_array(np.zeros(4, np.float32)), 0, tag=1)
        gate.wait()
        return message

    assert "for rank(s) 3" in pycoll.run_local(4, body)[0]

    def mismatch():
        rank = pycoll.world().rank
        if rank == 0:
            pycoll.send(device_array(np.ones(4, np.float32)), 3, tag=1)
        elif rank == 3:
            pycoll.recv(device_array(np.zeros(5, np.float32)), 0, tag=1)

    with pytest.raises(ValueError, match="rank 0 sends 16 bytes to rank 3, which expects 20"):
        pycoll.run_local(4, mismatch)

    def receiver_told():  # the receiver raises too, rather than wait for data never sent
        try:
            mismatch()
        except ValueError as error:
            return str(error)

    assert pycoll.run_local(4, receiver_told)[3] == (
        "rank 3 expects 20 bytes from rank 0 (tag 1), which sends another count; the ranks "
        "disagree on counts")


@pytest.fixture(params=[(mode, per_thread) for per_thread in (False, True) for mode in MODES],
                ids=lambda p: p[0] + ("-per-thread-default" if p[1] else ""))
def any_default_device(request, monkeypatch):
    """The stand-in, also with CUDA's per-thread default stream current in every thread."""
    mode, per_node = MODES[request.param[0]]
    monkeypatch.setenv("PYCOLL_DEVICE_TRANSPORT", mode)
    monkeypatch.setenv("PYCOLL_RANKS_PER_NODE", per_node)
    fake = FakeDevice(seed=hash(request.node.name) % 1000, per_thread_default=request.param[1])
    spaces.register(fake)
    yield fake
    spaces.unregister(fake)


@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_async_calls_on_device_arrays_run_on_the_callers_stream(any_default_device, nranks):
    """async_op=True without stream=: the call is ordered on the caller's current stream (as
    a blocking call is), not the async worker's: it sees the work queued before it, and the
    caller's stream completes it. Under CUDA's per-thread default stream, whose handle names
    the worker's own stream there, it runs after the caller's work too, and after ``wait()``
    the caller's stream runs after it."""
    device = any_default_device
    inputs = [np.arange(100, dtype=np.int64) * (r + 2) for r in range(nranks)]

    def body(rank):
        x = device.empty(100, np.int64)  # poisoned until the copy below runs
        device.copy(x, device_array(inputs[rank]))  # queued on this thread's stream
        out = pycoll.allreduce(x, algorithm="ring", async_op=True).wait()
        after = device.empty(100, np.int64)
        device.copy(after, out)  # the caller's stream, after wait()
        got = device_array(np.zeros(6, np.int64))
        if nranks > 1:  # a Send/Recv too, between the first and last rank
            if rank == 0:
                pycoll.send(x[:6], nranks - 1, tag=7, async_op=True).wait()
            elif rank == nranks - 1:
                pycoll.recv(got, 0, tag=7, async_op=True).wait()
        device.synchronize()  # this thread's stream only
        return host_array(after), host_array(got)

    results = pycoll.run_local(nranks, lambda: body(pycoll.world().rank))
    for rank, (after, got) in enumerate(results):
        np.testing.assert_array_equal(after, oracle.allreduce(inputs, "sum"))
        if nranks > 1 and rank == nranks - 1:
            np.testing.assert_array_equal(got, inputs[0][:6])


def test_an_async_call_that_writes_x_follows_one_still_reading_it(any_default_device):
    """reduce_scatter(x) then broadcast(x) in place, both async, waited after: the second
    call is ordered after the first's reads of x on every route. Under the per-thread
    default stream each runs on a stream of its own; across simulated nodes the broadcast's
    staged delivery wrote x before the reduce_scatter's peer-memory reads had run (ranks 2
    and 3 summed root 0's data in rank 2's place, every seed)."""
    device, nranks = any_default_device, 5
    inputs = [np.arange(10, dtype=np.int64) * (r + 1) for r in range(nranks)]

    def body(rank):
        x = device_array(inputs[rank])
        scattered = pycoll.reduce_scatter(x, counts=[2] * nranks, async_op=True)
        written = pycoll.broadcast(x, 0, async_op=True)
        mine = scattered.wait()
        written.wait()
        kept = device.empty(mine.shape, mine.dtype)
        device.copy(kept, mine)  # this thread's stream, after wait()
        device.synchronize()
        return host_array(kept), host_array(x)

    for seed in range(3):
        device._rng.seed(seed)
        results = pycoll.run_local(nranks, lambda: body(pycoll.world().rank))
        for (mine, x), want in zip(results, oracle.reduce_scatter(inputs, "sum", [2] * nranks)):
            np.testing.assert_array_equal(mine, want)
            np.testing.assert_array_equal(x, inputs[0])


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_complex_device_arrays_reduce_as_float_pairs(device, dtype):
    """No GPU kernel takes complex data: sum and avg reduce the (real, imaginary) pairs with
    the float kernels; prod is refused on every rank, naming what is allowed."""
    inputs = [(np.arange(7) + 1j * (np.arange(7) - r)).astype(dtype) for r in range(3)]
    for op in ("sum", "avg"):
        results = on_device(device, 3, lambda r, op=op: pycoll.allreduce(
            device_array(inputs[r]), op, algorithm="ring"))
        for result in results:
            np.testing.assert_array_equal(result, oracle.allreduce(inputs, op))

    def product():
        with pytest.raises(TypeError, match="op='prod' on complex.* device arrays has no GPU "
                                            "kernel; allowed for complex device arrays: sum, avg"):
            pycoll.allreduce(device_array(inputs[pycoll.world().rank]), "prod")
        return True

    assert pycoll.run_local(3, product) == [True] * 3


def test_freeing_waits_for_async_calls_still_queued(peer_device):
    """free_device_buffers() and free() first finish the async calls queued before them,
    which use the endpoints they free (torch.distributed lets a group be destroyed so)."""
    for free in ("free_device_buffers", "free"):
        def body(free=free):
            comm = pycoll.world()
            x = device_array(np.arange(3000, dtype=np.int64) + comm.rank)
            pycoll.allreduce(x, algorithm="ring")  # the endpoint exists
            work = pycoll.allreduce(x, algorithm="ring", async_op=True)
            getattr(comm, free)()  # no wait() before
            out = work.wait()
            peer_device.synchronize()
            return host_array(out)

        for seed in range(4):
            peer_device._rng.seed(seed)
            for out in pycoll.run_local(3, body):
                np.testing.assert_array_equal(out, np.arange(3000) * 3 + 3)


def test_free_is_collective_where_only_a_pair_has_device_endpoints(device):
    """After a device Send/Recv between ranks 1 and 2 only, every rank's free() takes the
    same collective steps (rank 0 has no device endpoint to free)."""

    def body():
        comm = pycoll.world()
        pycoll.allreduce(np.ones(4))
        got = device_array(np.zeros(4, np.float32))
        if comm.rank == 1:
            pycoll.send(device_array(np.ones(4, np.float32)), 2)
        elif comm.rank == 2:
            pycoll.recv(got, 1)
        device.synchronize()
        comm.free()
        return host_array(got)

    results = pycoll.run_local(3, body)
    assert results[2].tolist() == [1.0] * 4 and results[0].tolist() == [0.0] * 4


def test_async_calls_run_on_the_callers_device(device, monkeypatch):
    """CUDA's current device is per thread: the async worker takes the caller's for each
    call, so a rank on GPU 1 is not served on GPU 0."""
    seen = []
    copy = device.copy

    def copy_noting_the_device(dst, src):
        seen.append(device.current_device())
        copy(dst, src)

    monkeypatch.setattr(device, "copy", copy_noting_the_device)

    def body():
        with device.on_device(1):
            x = device_array(np.ones(50, np.int32))
            out = pycoll.allreduce(x, algorithm="ring", async_op=True).wait()
        device.synchronize()
        return host_array(out)

    for out in pycoll.run_local(2, body):
        assert out.tolist() == [2] * 50
    assert seen and set(seen) == {1}


@pytest.mark.parametrize("nranks", [3, 4, 7, 17])
@pytest.mark.parametrize("collective,algorithm", [("allreduce", "direct"),
                                                  ("allreduce", "two_shot"),
                                                  ("reduce_scatter", "direct")])
def test_every_ranks_piece_is_folded_in_one_pass_in_rank_order(peer_device, collective,
                                                               algorithm, nranks):
    """Where a step reduces several ranks' pieces into one range (the direct schedules), peer
    memory folds them with one n-ary reduce after the step's messages are in, in the order
    one-by-one reductions take: the bits are the host path's (non-integer floats, where the
    order shows). Beyond one launch's 16 sources (17 ranks) it reduces one by one."""
    folded = _same_bits_as_the_host(peer_device, collective, algorithm, nranks,
                                    16 * nranks + 3)["n_ary_reductions"]
    assert folded == (0 if nranks > 16 else nranks), folded  # one per rank: its own piece


LAUNCH_COUNTERS = ("n_ary_reductions", "reduce_copies", "copy_pairs")


def _same_bits_as_the_host(device, collective, algorithm, nranks, count):
    """Sum (or gather) non-integer floats (where the order of additions shows) on the
    stand-in and on the host, uneven counts; assert the same bits; return how many of each
    of the stand-in's counted launches (LAUNCH_COUNTERS) the collective made."""
    rng = np.random.default_rng(nranks)
    inputs = [rng.standard_normal(count).astype(np.float32) for _ in range(nranks)]
    counts = [count // nranks + (r < count % nranks) for r in range(nranks)]

    def call(x):
        if collective == "allreduce":
            return pycoll.allreduce(x, "sum", algorithm=algorithm)
        if collective == "allgather":
            return pycoll.allgather(x, algorithm=algorithm)
        return pycoll.reduce_scatter(x, "sum", counts=counts, algorithm=algorithm)

    before = {name: getattr(device, name) for name in LAUNCH_COUNTERS}
    results = on_device(device, nranks, lambda r: call(device_array(inputs[r])))
    grew = {name: getattr(device, name) - before[name] for name in LAUNCH_COUNTERS}
    host = pycoll.run_local(nranks, lambda: call(inputs[pycoll.world().rank]))
    for got, want in zip(results, host, strict=True):
        np.testing.assert_array_equal(got, want)
    return grew


@pytest.mark.parametrize("nranks", [2, 3, 4, 7])
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather"])
def test_the_ring_writes_each_chunk_to_the_next_rank_as_it_lands(peer_device, collective,
                                                                  nranks):
    """Over peer memory, a chunk the ring receives in one step and sends in the next is
    written into the next rank's inbox by the reduction (reduce_copy) or copy (copy_pair)
    that puts it in place, with no copy of its own. Per rank: AllReduce n - 1 reductions
    (the last feeds AllGather's first step) and n - 2 copies, ReduceScatter n - 2
    reductions, AllGather n - 2 copies. The bits are the host path's (non-integer floats,
    uneven counts)."""
    reductions, copies = {"allreduce": (nranks - 1, nranks - 2),
                          "reduce_scatter": (nranks - 2, 0),
                          "allgather": (0, nranks - 2)}[collective]
    launched = _same_bits_as_the_host(peer_device, collective, "ring", nranks, 40 * nranks + 3)
    assert launched["reduce_copies"] == nranks * reductions
    assert launched["copy_pairs"] == nranks * copies


@pytest.mark.parametrize("nranks,count", [(4, 100_000), (8, 80_001), (3, 30_001)])
def test_posting_receives_a_step_ahead_keeps_the_inbox_near_two_chunks(peer_device, nranks,
                                                                       count):
    """Forwarding posts each step's receives during the previous one, so two steps' slots
    are held at once: the inbox is reserved for that once per call and each step's slots are
    packed from the other end than the last's, so uneven chunks (which alternate in size)
    still fit: about two chunks in all, in one inbox, not one that grows step by step."""
    comms = _many_allreduces(peer_device, nranks, [count, count, count])
    chunk = -(-count // nranks) * 8
    for comm in comms:
        inboxes = comm.device_transport(peer_device)._inboxes
        assert sum(i.capacity for i in inboxes) <= 2 * chunk + 4096 + 32, [
            i.capacity for i in inboxes]


def test_a_step_of_many_receives_reserves_its_inbox_at_once(peer_device):
    """The direct AllReduce receives every peer's piece in one step: one inbox that holds
    them all, rather than one per doubling (each outgrown inbox is kept until close)."""
    comms = _many_allreduces(peer_device, 5, [50_000], algorithm="direct")
    for comm in comms:
        (inbox,) = comm.device_transport(peer_device)._inboxes
        assert inbox.capacity >= 4 * 50_000 * 8


def test_a_forwarded_send_is_made_by_its_receive(peer_device):
    def body():
        rank = pycoll.world().rank
        transport = pycoll.world().device_transport(peer_device)
        data = device_array(np.zeros(4, np.int32))
        if rank == 0:
            plain = transport.irecv(data, 1, 5)  # no combine: nothing to forward
            with pytest.raises(ValueError, match="produced_by must be a receive with a combine"):
                transport.isend(data, 1, 6, produced_by=plain)
            transport.waitall([plain])
        else:
            transport.waitall([transport.isend(data, 0, 5)])

    pycoll.run_local(2, body)


def test_where_kernels_cannot_reach_the_next_ranks_inbox_the_ring_reduces_then_copies(
        peer_device, monkeypatch):
    """Threads of one process on two GPUs without peer access: a kernel here cannot write
    the other device's inbox, so the reduction (or copy) writes WORK only and the slot is
    copied (as a plain send would); the results do not change."""
    monkeypatch.setattr(peer_device, "kernels_reach", lambda slot: False, raising=False)
    before = peer_device.reduce_copies, peer_device.copy_pairs
    _many_allreduces(peer_device, 4, [1000, 37], algorithm="ring")
    assert (peer_device.reduce_copies, peer_device.copy_pairs) == before


def test_forwarding_can_be_turned_off_on_any_ranks(peer_device, monkeypatch):
    """``PYCOLL_FORWARD=0`` reduces, then sends; every rank still posts ahead, so ranks that
    differ in the setting still meet (here rank 1 forwards, the others do not)."""
    from pycoll import api

    monkeypatch.setenv("PYCOLL_FORWARD", "0")
    before = peer_device.reduce_copies, peer_device.copy_pairs
    _many_allreduces(peer_device, 3, [100, 7])
    assert (peer_device.reduce_copies, peer_device.copy_pairs) == before
    setting = api._forwarding
    monkeypatch.setattr(api, "_forwarding", lambda: pycoll.world().rank == 1)
    _many_allreduces(peer_device, 3, [100, 7])
    # rank 1's 2 reductions and 1 copy, in 2 calls
    assert (peer_device.reduce_copies, peer_device.copy_pairs) == (before[0] + 4, before[1] + 2)
    monkeypatch.setattr(api, "_forwarding", setting)
    monkeypatch.setenv("PYCOLL_FORWARD", "yes")
    with pytest.raises(ValueError, match="PYCOLL_FORWARD='yes' is invalid; allowed: 0 or 1"):
        _many_allreduces(peer_device, 2, [5])


def test_a_rank_that_receives_nothing_allocates_no_inbox(peer_device):
    def body():
        comm = pycoll.world()
        x = device_array(np.arange(6, dtype=np.int32) * (comm.rank == 0))
        out = pycoll.broadcast(x, 0, algorithm="ring")
        peer_device.synchronize()
        return host_array(out), comm.device_transport(peer_device)._inboxes

    results = pycoll.run_local(4, body)
    for out, _ in results:
        np.testing.assert_array_equal(out, np.arange(6))
    assert results[0][1] == [] and all(inboxes for _, inboxes in results[1:])


@pytest.mark.parametrize("nranks,segments", [(4, None), (5, 3)])
def test_the_ring_broadcast_passes_each_piece_on_as_it_copies_it(peer_device, monkeypatch,
                                                                  nranks, segments):
    """Every rank between the root and the last copies each piece into place and into the
    next rank's inbox in one pass (segments: the pipelined pieces)."""
    from pycoll import select

    monkeypatch.setattr(select, "FORCED_SEGMENTS", segments)
    data = np.arange(1001, dtype=np.int64)
    before = peer_device.copy_pairs
    results = on_device(peer_device, nranks, lambda r: pycoll.broadcast(
        device_array(data if r == 1 else np.zeros_like(data)), 1, algorithm="ring"))
    for got in results:
        np.testing.assert_array_equal(got, data)
    assert peer_device.copy_pairs - before == (nranks - 2) * (segments or 1)


def test_a_schedule_that_never_forwards_holds_one_step_of_inbox(peer_device):
    """Halving-doubling's AllGather receives what it has gathered so far and sends twice
    that next: nothing to forward, so no rank posts ahead, and the inbox holds its largest
    step (half the result), not two steps."""
    count = 100_000
    before = peer_device.copy_pairs

    def body():
        x = device_array(np.full(count, pycoll.world().rank, np.float32))
        out = pycoll.allgather(x, algorithm="halving_doubling")
        peer_device.synchronize()
        inboxes = pycoll.world().device_transport(peer_device)._inboxes
        return host_array(out), sum(i.capacity for i in inboxes)

    for out, held in pycoll.run_local(4, body):
        np.testing.assert_array_equal(out, np.repeat(np.arange(4, dtype=np.float32), count))
        assert held <= 2 * count * 4 + 4096 + 64, held
    assert peer_device.copy_pairs == before


def test_async_device_send_and_recv_run_on_a_worker_per_direction_and_peer(device):
    """A pair's device endpoint takes one receive at a time: device Send/Recv of any tag to
    one peer share a worker, in call order (host ones are posted, and use none)."""

    def body(rank):
        comm = pycoll.world()
        peer = 1 - rank
        if rank == 0:
            works = [pycoll.send(device_array(np.full(3, float(t))), peer, tag=t, async_op=True)
                     for t in (5, 6)]
        else:
            got = [device_array(np.empty(3)) for _ in range(2)]
            works = [pycoll.recv(got[i], peer, tag=t, async_op=True)
                     for i, t in enumerate((5, 6))]
        for work in works:
            work.wait()
        device.synchronize()
        return sorted(comm.lanes), None if rank == 0 else [host_array(g)[0] for g in got]

    (sent_lanes, _), (received_lanes, got) = pycoll.run_local(
        2, lambda: body(pycoll.world().rank))
    assert sent_lanes == [("send", 1)] and received_lanes == [("recv", 0)]
    assert got == [5.0, 6.0]


@pytest.mark.parametrize("seed", range(4))
def test_a_pairs_sends_and_receives_on_two_streams_do_not_race(seed):
    """Async device Send and Recv between one pair, on two streams and two workers: each
    route has its endpoint (one endpoint, with one event and one stream, let the receiving
    worker's record stand for the sending one's, and a peer overwrote a slot still read)."""
    device = FakeDevice(seed=seed)
    spaces.register(device)

    def body():
        rank = pycoll.world().rank
        if rank == 0:
            first, second = device.new_stream("A"), device.new_stream("B")
            got = [device_array(np.zeros(64, np.float32)) for _ in range(2)]
            works = [pycoll.send(device_array(np.full(64, 5.0, np.float32)), 1, tag=5,
                                 stream=first, async_op=True),
                     pycoll.recv(got[0], 1, tag=1, stream=second, async_op=True),
                     pycoll.recv(got[1], 1, tag=2, stream=second, async_op=True)]
            for work in works:
                work.wait()
            device.synchronize_all()
            return [host_array(g)[0] for g in got]
        pycoll.send(device_array(np.full(64, 1.0, np.float32)), 0, tag=1)
        time.sleep(0.2)  # rank 0's receiving worker delivers tag 1 and posts tag 2 meanwhile
        got = pycoll.recv(device_array(np.zeros(64, np.float32)), 0, tag=5)
        pycoll.send(device_array(np.full(64, 2.0, np.float32)), 0, tag=2)
        device.synchronize()
        return [host_array(got)[0]]

    try:
        assert pycoll.run_local(2, body) == [[1.0, 2.0], [5.0]]
    finally:
        spaces.unregister(device)


@pytest.mark.parametrize("collective", ["allreduce", "allgather"])
def test_a_device_array_is_not_taken_for_host_memory_by_the_one_shot(device, monkeypatch,
                                                                       collective):
    """The stand-in's arrays subclass numpy's; the shared-memory one-shot, which serves host
    arrays of any ndarray type, must leave them to their device (it read their memory before
    the stream had filled it, and returned a host array)."""
    monkeypatch.setenv("PYCOLL_HOST_TRANSPORT", "shm")
    inputs = [np.arange(5, dtype=np.float32) + 10 * r for r in range(2)]

    def call(rank):
        y = device.empty((5,), np.float32)
        device.copy(y, device_array(inputs[rank]))  # y is right once the stream has run
        assert pycoll.world().one_shot_for(Collective.ALLREDUCE) is not None
        result = getattr(pycoll, collective)(y)
        assert type(result) is type(y)
        return result

    expected = (oracle.allreduce(inputs, "sum") if collective == "allreduce"
                else oracle.allgather(inputs))
    for got in on_device(device, 2, call):
        np.testing.assert_array_equal(got, expected)


def test_cuda_aware_mpi_is_read_from_the_communicators_memory_kinds(monkeypatch):
    """MPI 4.1 lists the memory kinds a library supports in a communicator's info; the
    same key of MPI_INFO_ENV, read before, holds those the user asked for (unset by MPICH 5),
    so a CUDA-aware MPICH went unnoticed."""
    from pycoll.bindings.staged import cuda_aware_mpi

    class Info:
        def __init__(self, kinds):
            self.kinds, self.freed = kinds, False

        def Get(self, key):
            return self.kinds if key == "mpi_memory_alloc_kinds" else None

        def Free(self):
            self.freed = True

    class Comm:
        def __init__(self, kinds):
            self.info = Info(kinds)

        def Get_info(self):
            return self.info

    monkeypatch.delenv("PYCOLL_CUDA_AWARE_MPI", raising=False)
    for kinds, aware in [("mpi,system", False), ("mpi,system,cuda:device", True),
                         ("mpi,cuda", True), ("mpi, cuda:host:device", True),
                         ("mpi,cuda:host", False), ("mpi,cudax", False), (None, False)]:
        comm = Comm(kinds)
        assert cuda_aware_mpi(comm) is aware, kinds
        assert comm.info.freed
    assert cuda_aware_mpi(object()) is False  # no Get_info: an MPI before 4.1
    monkeypatch.setenv("PYCOLL_CUDA_AWARE_MPI", "1")
    assert cuda_aware_mpi(Comm("mpi")) is True
    from mpi4py import MPI

    monkeypatch.delenv("PYCOLL_CUDA_AWARE_MPI")
    assert cuda_aware_mpi(MPI.COMM_SELF) is False  # the mpich wheel: no CUDA


def test_peer_access_already_enabled_counts_as_reach():
    """Threads of one process on several GPUs: enabling peer access that CuPy's own copies
    enabled before raises cudaErrorPeerAccessAlreadyEnabled, which still means reach; any
    other error means none (told by CUDA's error number, as CuPy tells it)."""
    import types

    class CUDARuntimeError(Exception):
        def __init__(self, status):
            super().__init__(f"error {status}")
            self.status = status

    def space_raising(status):
        def enable(device):
            raise CUDARuntimeError(status)

        runtime = types.SimpleNamespace(
            CUDARuntimeError=CUDARuntimeError, errorPeerAccessAlreadyEnabled=704,
            deviceCanAccessPeer=lambda a, b: 1, deviceEnablePeerAccess=enable, getDevice=lambda: 0)

        class Space(spaces.CudaSpace):
            _cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))

        return Space()

    on_gpu_1 = types.SimpleNamespace(data=types.SimpleNamespace(device_id=1))
    assert space_raising(704).kernels_reach(on_gpu_1) is True
    assert space_raising(217).kernels_reach(on_gpu_1) is False  # cudaErrorPeerAccessUnsupported
    on_gpu_0 = types.SimpleNamespace(data=types.SimpleNamespace(device_id=0))
    assert space_raising(217).kernels_reach(on_gpu_0) is True  # its own device: no question
