"""The coordinator's bus over the S shards of a Redis Cluster (``bus.cluster``).

One ``RedisCoordinatorBus`` per shard, each on a client pinned to its shard's master,
all sharing ONE id clock and ONE lock: every id handed out is larger than every id before
it, whichever shard it goes to, so each rank (which reads only its own ``ctl:<r>`` and its
shard's ``ctl:all``) still gets its control in the send order (DESIGN §3 rule 1). A
broadcast is written to every shard's broadcast stream, under the lock, each copy signed
over its own stream key (a copy moved to another shard's stream fails authentication).

Upstream: a thread per shard runs that shard's XREADGROUP and hands what it read to
``read_upstream`` through a bounded queue; acks ride on the shard reader's next read.
Each shard keeps its own dead-lettering, foreign-entry repair, trimming and WAIT
(``bus.replication``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Sequence
from typing import Final

import redis

from flodl_bus.bus.api import Delivery
from flodl_bus.bus.connection import BusClosed
from flodl_bus.bus.ids import IdClock
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.stream_ops import StreamsConfig, log
from flodl_bus.bus.streams import RedisCoordinatorBus
from flodl_bus.protocol.messages import ControlWire
from flodl_bus.protocol.signing import CoordinatorKeys

#: read batches a shard's thread may hold before it waits for the coordinator
_QUEUE_BATCHES: Final = 64


class ShardedCoordinatorBus:
    """The coordinator's side of the bus (``api.CoordinatorBus``) over S shards."""

    def __init__(
        self,
        clients: Sequence[redis.Redis],
        keys: RunKeys,
        signing: CoordinatorKeys,
        *,
        ranks: Iterable[int] = (),
        config: StreamsConfig | None = None,
        where: str = "",
        wait_ms: int = 0,
    ) -> None:
        if len(clients) != len(keys.shards) or not clients:
            raise ValueError(f"{len(clients)} clients for {len(keys.shards)} shards")
        self.keys = keys
        self.config = config or StreamsConfig()
        self._lock = threading.RLock()
        clock = IdClock()
        ranks = list(ranks)
        self.parts = [
            RedisCoordinatorBus(
                client,
                keys,
                signing,
                ranks=[r for r in ranks if keys.shard_of(r) == i],
                config=self.config,
                where=f"{where} shard {i}",
                shard=i,
                clock=clock,
                lock=self._lock,
                wait_ms=wait_ms,
            )
            for i, client in enumerate(clients)
        ]
        #: each shard's entry ids of the last broadcast batch (benches time them)
        self.broadcast_ids: list[list[str]] = []
        self._q: queue.Queue[list[Delivery] | BaseException] = queue.Queue(_QUEUE_BATCHES)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._read_loop, args=(p,), name=f"flodl-bus-s{i}", daemon=True)
            for i, p in enumerate(self.parts)
        ]
        for t in self._threads:
            t.start()

    def _part(self, rank: int) -> RedisCoordinatorBus:
        shard = self.keys.shard_of(rank)
        assert shard is not None
        return self.parts[shard]

    def _read_loop(self, part: RedisCoordinatorBus) -> None:
        while not self._stop.is_set():
            try:
                got = part.read_upstream(self.config.max_block_ms)
            except BusClosed:
                return
            except BaseException as exc:
                log.error("bus_shard_reader_failed", shard=part.shard, error=repr(exc)[:200])
                self._put(exc)
                return
            if got:
                self._put(list(got))

    def _put(self, item: list[Delivery] | BaseException) -> None:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    @property
    def ranks(self) -> list[int]:
        return sorted(r for p in self.parts for r in p.ranks)

    def add_rank(self, rank: int) -> None:
        self._part(rank).add_rank(rank)

    def send(self, rank: int, msg: ControlWire) -> None:
        self._part(rank).send(rank, msg)

    def broadcast(self, msg: ControlWire) -> None:
        with self._lock:
            for part in self.parts:
                part.broadcast(msg)

    def send_batch(self, items: Sequence[tuple[int | None, ControlWire]]) -> list[str]:
        """Like ``RedisCoordinatorBus.send_batch``: one transaction per shard, shards in
        turn under the shared lock (a broadcast batch goes to every shard; the ids
        returned are shard 0's)."""
        if not items:
            return []
        if len({rank is None for rank, _ in items}) > 1:
            raise ValueError("send_batch: unicasts and broadcasts go in separate batches")
        with self._lock:
            if items[0][0] is None:
                self.broadcast_ids = [part.send_batch(items) for part in self.parts]
                return self.broadcast_ids[0]
            by_shard: dict[int, list[int]] = {}
            for i, (rank, _) in enumerate(items):
                assert rank is not None
                shard = self.keys.shard_of(rank)
                assert shard is not None
                by_shard.setdefault(shard, []).append(i)
            out = [""] * len(items)
            for shard, idx in sorted(by_shard.items()):
                got = self.parts[shard].send_batch([items[i] for i in idx])
                for i, eid in zip(idx, got, strict=True):
                    out[i] = eid
            return out

    @property
    def behind(self) -> bool:
        """Some shard's reader is behind its streams, or its reads wait in the queue."""
        return not self._q.empty() or any(part.behind for part in self.parts)

    def read_upstream(self, block_ms: int) -> list[Delivery]:
        out: list[Delivery] = []
        try:
            first = self._q.get(timeout=max(0, block_ms) / 1000) if block_ms > 0 else None
        except queue.Empty:
            return out
        items = [first] if first is not None else []
        while True:
            try:
                items.append(self._q.get_nowait())
            except queue.Empty:
                break
        for item in items:
            if isinstance(item, BaseException):
                raise item
            out.extend(item)
        return out

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        by_part: dict[int, list[Delivery]] = {}
        for d in deliveries:
            rank = self.keys.rank_of(d.stream)
            if rank is None:
                continue
            by_part.setdefault(self.keys.shard_of(rank) or 0, []).append(d)
        for shard, ds in by_part.items():
            self.parts[shard].ack(ds)

    def flush_acks(self) -> None:
        """Acks ride on each shard reader's next read (at most a BLOCK away)."""

    def trim_now(self) -> None:
        for part in self.parts:
            part.trim_now()

    def overdue(self, budget_s: float) -> list[tuple[int, str, float]]:
        """Each shard's ranks that leave control unread too long (``streams``)."""
        return sorted(o for part in self.parts for o in part.overdue(budget_s))

    @property
    def trimmed_passes(self) -> int:
        return sum(p.trimmed_passes for p in self.parts)

    @property
    def reconnects(self) -> int:
        return sum(p.reconnects for p in self.parts)

    @property
    def lost(self) -> int:
        """Control entries a failover lost (each named, and written again when it could)."""
        return sum(p._guard.lost for p in self.parts if p._guard is not None)

    def close(self) -> None:
        # The threads end after their current read (one BLOCK at most); each shard's
        # close then flushes the acks its reader still holds.
        self._stop.set()
        for t in self._threads:
            t.join(self.config.max_block_ms / 1000 + 5.0)
        for part in self.parts:
            part.close()
