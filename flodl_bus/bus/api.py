"""The transport contract the runtimes are written against.

``bus.streams`` implements it on Redis Streams; ``bus.memory`` in process (unit tests,
single-process runs). Runtimes never touch Redis directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from flodl_bus.protocol.messages import ControlWire, UpstreamMsg


class BusLost(RuntimeError):
    """The transport is gone for good (a rank's host agent did not come back within its
    grace): the rank stops in order, as when it loses the coordinator."""


class IngestHung(RuntimeError):
    """A reader process (``--ingest-procs``) alive but hung: it went ``ingest.STALL_S``
    without coming round its read loop. The coordinator stops the run in order and exits
    ``FAILED``. ``deliveries``: what the read that found it received first, to dispatch."""

    def __init__(self, reason: str, deliveries: Sequence[Delivery] = ()) -> None:
        super().__init__(reason)
        self.deliveries = list(deliveries)


class Delivery(NamedTuple):
    """One decoded entry as it left the stream (a tuple: the coordinator builds one per
    upstream message, and a frozen dataclass costs several times as much to make)."""

    stream: str
    entry_id: str
    msg: object


class RankBus(Protocol):
    """A rank's side: control in (merged unicast + broadcast, in send order), upstream out."""

    rank: int

    def read_control(self, block_ms: int) -> Sequence[Delivery]:
        """Next control deliveries in the coordinator's send order (may be empty).

        Entries that fail to decode or authenticate never appear here: they are
        dead-lettered by the transport. Deliveries are ``ack``ed once taken over (the rank
        runtime acks once an entry is in its local control queue): on Redis that is what
        the rank's heartbeats report (``control_read``), so the coordinator trims no
        further; nothing is ever yielded twice, and no other reader can take an entry
        from this one (it reads with XREAD from its own cursor, ``bus.reader``).
        """
        ...

    def ack(self, deliveries: Sequence[Delivery]) -> None: ...

    def publish(self, msg: UpstreamMsg) -> None:
        """Queue an upstream message; returns at once (a publisher thread writes it)."""
        ...

    def flush(self, timeout: float) -> bool:
        """Wait until every queued upstream message is written; False on timeout."""
        ...

    def close(self) -> None: ...


class CoordinatorBus(Protocol):
    """The coordinator's side: control out, every rank's upstream in."""

    def send(self, rank: int, msg: ControlWire) -> None: ...

    def broadcast(self, msg: ControlWire) -> None: ...

    def read_upstream(self, block_ms: int) -> Sequence[Delivery]:
        """Upstream deliveries, each rank's in its send order (ranks interleaved)."""
        ...

    @property
    def behind(self) -> bool:
        """Whether the last read may have left entries waiting (a silent rank may then
        be one not reached yet)."""
        ...

    def ack(self, deliveries: Sequence[Delivery]) -> None: ...

    def close(self) -> None: ...
