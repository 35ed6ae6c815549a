"""The agreement check: before a collective runs, every rank learns every rank's view of it.

The seed's contract is that all members of a collective agree on the group, the root, the
reduction, the data type and the layout, and call collectives in the same order. A rank that
breaks it gets, from most libraries, a wrong result or a hang that names nobody. With the
check on (``PYCOLL_CHECK=1``, or ``comm.check = True``), each collective first exchanges two
checksums of a short signature (collective, algorithm, op, dtype, memory, count, counts, root,
sequence number, row, and whether the result is verified: PYCOLL_VERIFY): through the
shared-memory one-shot's slots where every rank shares a node, else with a small direct
AllGather. Only where they differ are the readable signatures exchanged, and every rank raises
the same :class:`CollectiveMismatch`, naming the fields that differ and which ranks hold which
value. A rank that skipped a collective shows up as a difference in the sequence number (or the
collective), not as a hang.

The cost is one small exchange per collective (measured in docs/reliability.md).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from pycoll.settings import switch

SIGNATURE_BYTES = 512  # one rank's signature, JSON padded with zeros
_COUNTS_SHOWN = 8  # longer counts travel as a checksum


class AgreedError(ValueError):
    """An error the ranks agreed on before raising it, every one alike: the communicator is
    still in step (an async call failing with it does not break it)."""


class CollectiveMismatch(AgreedError):
    """The ranks of a collective disagree on its arguments (raised on every rank)."""


def enabled_by_default() -> bool:
    return bool(switch("PYCOLL_CHECK", False))


FIELDS = ("collective", "algorithm", "op", "dtype", "memory", "count", "counts", "root",
          "sequence", "verify", "row")
_DTYPE_NAMES: dict[np.dtype, str] = {}


def signature(
    collective: str, algorithm: str, op: str | None, dtype: np.dtype, count: int | None,
    counts: tuple[int, ...] | None, root: int | None, sequence: int, memory: str = "host",
    verify: bool = False, row: tuple[int, ...] | None = None,
) -> tuple:
    """What every rank must agree on, in the order of :data:`FIELDS`; None for what does not
    apply (or may differ). ``row``: the shape of a row (``x.shape[1:]``) where counts are in
    rows: two ranks' rows of 2 and of 3 elements would be read in each other's shape."""
    counts = counts_field(counts)
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return (collective, algorithm, op, name, memory, count, counts, root, sequence, verify,
            None if row is None else list(row))


def agree(comm: Any, values: tuple) -> None:
    """Exchange ``values`` (a :func:`signature`) with every rank of ``comm``; raise
    :class:`CollectiveMismatch` on every rank if any field differs.

    The common case costs one exchange of two checksums of the whole signature, through
    shared memory where every rank shares a node, else a small direct AllGather; only when
    they differ do the ranks exchange the readable fields to name the difference (every rank
    sees the same table, so every rank takes that second step)."""
    text = repr(values).encode()  # ints, strings, tuples and None: repr is the same everywhere
    sums = np.array([zlib.crc32(text), zlib.adler32(text)], np.int64)
    table = _exchange(comm, sums).reshape(comm.size, sums.size)
    if (table == table[0]).all():
        return
    mine = pack(dict(zip(FIELDS, values)))
    rows = [unpack(row) for row in _exchange(comm, mine).reshape(comm.size, SIGNATURE_BYTES)]
    raise CollectiveMismatch(describe(rows, differing(rows, FIELDS) or list(FIELDS), comm.rank))


def pack(fields: dict) -> np.ndarray:
    """``fields`` (JSON values) as SIGNATURE_BYTES bytes, to travel as raw bytes."""
    body = json.dumps(fields, sort_keys=True).encode()
    row = np.zeros(SIGNATURE_BYTES, np.uint8)
    row[: len(body)] = np.frombuffer(body[:SIGNATURE_BYTES], np.uint8)
    return row


def unpack(row: np.ndarray) -> dict:
    """What :func:`pack` packed (a field that does not parse: "unreadable signature")."""
    text = bytes(row).rstrip(b"\0")
    try:
        return json.loads(text)
    except ValueError:
        return {"collective": "unreadable signature"}


def differing(rows: list[dict], names: tuple[str, ...]) -> list[str]:
    """The fields of ``names`` whose value is not the same in every rank's row."""
    return [name for name in names if len({_key(row.get(name)) for row in rows}) > 1]


def counts_field(counts: Any) -> Any:
    """``counts`` as a signature holds them: up to _COUNTS_SHOWN as they are, longer ones as
    a checksum."""
    if counts is not None and len(counts) > _COUNTS_SHOWN:
        data = np.asarray(counts, np.int64).tobytes()
        return f"{len(counts)} counts, crc32 {zlib.crc32(data):08x}"
    return counts


def _exchange(comm: Any, mine: np.ndarray) -> np.ndarray:
    """Every rank's ``mine`` (alike in size), concatenated in rank order; not itself checked."""
    shared = comm.node_transport()
    if shared is not None:
        return shared.allgather_small(mine)
    from pycoll.api import allgather

    traffic = comm.traffic
    counted = dict(traffic.messages), dict(traffic.bytes)  # the call's, not the check's
    comm.agreeing = True
    try:
        return allgather(mine, comm=comm, algorithm="direct")
    finally:
        comm.agreeing = False
        traffic.messages.update(counted[0])
        traffic.bytes.update(counted[1])


def describe(rows: list[dict], names: list[str], rank: int) -> str:
    """The error text: each differing field, with the ranks that hold each value."""
    mine = rows[rank]
    return (f"rank {rank}: the ranks disagree on collective #{mine.get('sequence')} "
            f"({mine.get('collective')} here): " + holders(rows, names))


def holders(rows: list[dict], names: list[str]) -> str:
    """Each field of ``names`` with the ranks that hold each of its values."""
    return " | ".join(f"{name}: " + "; ".join(ranks_holding([row.get(name) for row in rows]))
                      for name in names)


def ranks_holding(values: list[Any], show: Callable[[Any], str] | None = None) -> list[str]:
    """Each distinct value of ``values`` (rank r's at ``values[r]``), as ``show`` writes it
    (JSON by default), with the ranks that hold it: ["3 on rank 0", "4 on ranks 1, 2"]."""
    show = show or _key
    ranks_of: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        ranks_of.setdefault(show(value), []).append(rank)
    return [f"{value} on {_ranks(ranks)}" for value, ranks in ranks_of.items()]


def _key(value: Any) -> str:
    return json.dumps(value)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
