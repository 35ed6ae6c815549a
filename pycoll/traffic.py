"""What a rank handed its transports: messages and bytes per link class.

Every message a schedule posts is counted where the executor hands it to the transport (the
same place for every transport: MPI, shared memory, the in-process rendezvous, peer memory,
staged copies), by the link class of its peer: ``intra`` (same node) or ``inter``. Shared
memory's one-round small calls publish an array once for every peer of the node to read:
counted as one message to each. The agreement check's and verification's own exchanges are
not counted (on every transport alike). ``comm.traffic`` holds a communicator's counts;
``reset()`` starts them over.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CLASSES = ("intra", "inter")


@dataclass
class Traffic:
    """Counts for one rank of a communicator whose ranks sit on ``nodes`` (node per rank)."""

    nodes: list[int]
    rank: int
    messages: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))

    def __post_init__(self) -> None:
        mine = self.nodes[self.rank]
        self._class_of = ["intra" if node == mine else "inter" for node in self.nodes]
        peers = self._class_of[: self.rank] + self._class_of[self.rank + 1 :]
        self._peers_by_class = [(link, peers.count(link)) for link in CLASSES
                                if link in peers]

    def add(self, peer: int, nbytes: int) -> None:
        """One message of ``nbytes`` to ``peer``."""
        link = self._class_of[peer]
        self.messages[link] += 1
        self.bytes[link] += nbytes

    def to_every_peer(self, nbytes: int) -> None:
        """One message of ``nbytes`` to every other rank (a published array)."""
        for link, peers in self._peers_by_class:  # once per link class: every small call
            self.messages[link] += peers
            self.bytes[link] += peers * nbytes

    def reset(self) -> None:
        for table in (self.messages, self.bytes):
            table.update(dict.fromkeys(CLASSES, 0))

    def __str__(self) -> str:
        return ", ".join(f"{link} {self.messages[link]} messages {self.bytes[link]} B"
                         for link in CLASSES)
