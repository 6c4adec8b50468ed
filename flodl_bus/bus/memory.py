"""An in-process bus: ``RankBus`` / ``CoordinatorBus`` over shared memory.

For unit tests and single-process runs. It keeps the contract of ``bus.api`` that the
runtimes rely on, so code tested against it behaves the same on Redis:

* per-rank control order: one counter numbers every control entry, unicast and broadcast
  alike, and each rank reads its merged sequence in that order;
* one upstream sequence per rank, read in send order;
* deliveries stay pending until acked; a reader attached again for the same rank (a
  restart) first gets what was read but never acked, and never an acked entry;
* with ``roundtrip=True`` (the default) every message passes through the wire codec, so a
  message that could not travel on Redis cannot travel here either; an entry that fails
  to decode goes to ``dlq`` with the reason instead of reaching a reader.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from flodl_bus.bus.api import Delivery
from flodl_bus.protocol import wire
from flodl_bus.protocol.messages import ControlWire, UpstreamMsg


@dataclass
class _Lane:
    """One reader's entries (a rank's merged control, or the coordinator's upstream)."""

    #: built on the hub's one lock; a write wakes only the reader of its own lane (a
    #: rank's publish must not wake that rank's control reader: a needless GIL handoff
    #: on the training thread's hot path)
    cond: threading.Condition
    entries: list[Delivery] = field(default_factory=list)
    cursor: int = 0
    pending: dict[str, Delivery] = field(default_factory=dict)
    redeliver: bool = False

    def take(self) -> list[Delivery]:
        if self.redeliver:
            self.redeliver = False
            if self.pending:
                return list(self.pending.values())
        out = self.entries[self.cursor :]
        self.cursor = len(self.entries)
        for d in out:
            self.pending[d.entry_id] = d
        # Acked entries are never read again; drop them so memory stays bounded.
        del self.entries[: self.cursor]
        self.cursor = 0
        return out

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        for d in deliveries:
            self.pending.pop(d.entry_id, None)

    def ready(self) -> bool:
        return (self.redeliver and bool(self.pending)) or self.cursor < len(self.entries)


class MemoryHub:
    """The shared "server": every stream of one run lives here."""

    def __init__(self, world_size: int, *, roundtrip: bool = True) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.roundtrip = roundtrip
        self._lock = threading.Lock()
        self._seq = 0
        self._control = [_Lane(threading.Condition(self._lock)) for _ in range(world_size)]
        self._upstream = _Lane(threading.Condition(self._lock))
        self._up_seq = [0] * world_size
        #: (stream, reason) of every entry that failed to decode
        self.dlq: list[tuple[str, str]] = []

    # ------------------------------------------------------------------ access

    def rank_bus(self, rank: int) -> MemoryRankBus:
        """Attach a reader for ``rank``; a second attach re-delivers unacked entries."""
        self._check_rank(rank)
        with self._lock:
            self._control[rank].redeliver = True
        return MemoryRankBus(self, rank)

    def coordinator_bus(self) -> MemoryCoordinatorBus:
        with self._lock:
            self._upstream.redeliver = True
        return MemoryCoordinatorBus(self)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world_size {self.world_size}")

    # ------------------------------------------------------------------ writes

    def _carry(self, msg: object, channel: str, stream: str) -> object | None:
        if not self.roundtrip:
            return msg
        body = wire.encode(msg)
        try:
            decoded: object = wire.decode(body, channel)
            return decoded
        except wire.DecodeError as exc:
            self.dlq.append((stream, exc.reason))
            return None

    def _send_control(self, ranks: Sequence[int], stream: str, msg: ControlWire) -> None:
        carried = self._carry(msg, wire.CONTROL, stream)
        with self._lock:
            self._seq += 1
            entry_id = f"{self._seq}-0"
            if carried is not None:
                for r in ranks:
                    lane = self._control[r]
                    lane.entries.append(Delivery(stream, entry_id, carried))
                    lane.cond.notify()

    def _publish(self, rank: int, msg: UpstreamMsg) -> None:
        stream = f"up:{rank}"
        carried = self._carry(msg, wire.UPSTREAM, stream)
        with self._lock:
            self._up_seq[rank] += 1
            if carried is not None:
                entry_id = f"{rank}:{self._up_seq[rank]}-0"
                self._upstream.entries.append(Delivery(stream, entry_id, carried))
                self._upstream.cond.notify()

    # ------------------------------------------------------------------- reads

    def _read(self, lane: _Lane, block_ms: int) -> list[Delivery]:
        with self._lock:
            if not lane.ready() and block_ms > 0:
                lane.cond.wait_for(lane.ready, block_ms / 1000.0)
            return lane.take()

    def _ack(self, lane: _Lane, deliveries: Sequence[Delivery]) -> None:
        with self._lock:
            lane.ack(deliveries)


class MemoryRankBus:
    def __init__(self, hub: MemoryHub, rank: int) -> None:
        self.hub = hub
        self.rank = rank
        self._lane = hub._control[rank]
        self.closed = False

    def read_control(self, block_ms: int) -> Sequence[Delivery]:
        if self.closed:
            return []
        return self.hub._read(self._lane, block_ms)

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        self.hub._ack(self._lane, deliveries)

    def publish(self, msg: UpstreamMsg) -> None:
        if self.closed:
            raise RuntimeError(f"rank {self.rank} bus is closed")
        self.hub._publish(self.rank, msg)

    def flush(self, timeout: float) -> bool:
        # Writes land synchronously in publish; nothing is ever queued.
        return True

    def close(self) -> None:
        self.closed = True


class MemoryCoordinatorBus:
    def __init__(self, hub: MemoryHub) -> None:
        self.hub = hub
        self.closed = False

    def send(self, rank: int, msg: ControlWire) -> None:
        self.hub._check_rank(rank)
        self.hub._send_control((rank,), f"ctl:{rank}", msg)

    def broadcast(self, msg: ControlWire) -> None:
        self.hub._send_control(range(self.hub.world_size), "ctl:all", msg)

    #: every read takes all there is: never behind
    behind = False

    def read_upstream(self, block_ms: int) -> Sequence[Delivery]:
        if self.closed:
            return []
        return self.hub._read(self.hub._upstream, block_ms)

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        self.hub._ack(self.hub._upstream, deliveries)

    def close(self) -> None:
        self.closed = True
