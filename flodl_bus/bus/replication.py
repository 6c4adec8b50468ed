"""Control entries that must survive the failover of a master (a run on a Redis Cluster).

Redis replicates asynchronously: a master can acknowledge an XADD and die before its
replica has it, and the promoted replica then serves the stream without the entry. A
lost StartEpoch or SyncNow would leave a rank waiting for good, so the coordinator:

1. follows every control write with ``WAIT 1 <ms>`` (``cluster.confirm``). An entry a
   replica acknowledged survives the loss of its master;
2. keeps every entry no replica acknowledged in time (a replica lagging, restarting or
   gone), with one ``bus_replication_unconfirmed`` line per episode, until a later WAIT
   covers it (``bus_replication_confirmed``). While a master has no replica in sync
   (a promoted replica whose old master is not back yet) it WAITs no more, which would
   cost every write the whole timeout, but looks for a replica once a second;
3. after any lost connection or redirect of its link (a failover shows as one of those),
   before its next write, looks each kept entry up: one that is gone is named
   (``bus_control_lost``: stream, id, seq, type) and written again with the same id, seq
   and MAC, so the rank reads it in its place in the send order. Replication is one
   ordered stream per master, so what a failover loses is always the newest writes of
   that master: every later id of the stream went too, and the same id is free again. A
   rank that had read the entry from the old master refuses the copy as ``replayed``
   (dlq), never dispatching it twice. Were the id taken after all, the loss is logged as
   ``bus_control_lost`` with ``rewritten=False``: named, never silent.

Upstream entries are not WAITed for: a lost one shows as a seq gap at the coordinator
(``bus_entries_missing``), and heartbeats and timing repeat.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Final

import redis
import structlog

from flodl_bus.bus import entries
from flodl_bus.bus.cluster import confirm, moves
from flodl_bus.bus.connection import Link
from flodl_bus.bus.stream_ops import DEFAULT_MAXLEN, id_refused, landed

log = structlog.get_logger("flodl_bus.bus")

#: unconfirmed entries kept per shard (older ones are dropped with a line saying so)
KEEP: Final = 100_000
#: with no replica in sync, how often the guard looks for one again
RECHECK_S: Final = 1.0

Written = tuple[str, str, dict[bytes, bytes]]


def _has_replica(client: redis.Redis) -> bool:
    info: Any = client.info("replication")
    return int(info.get("connected_slaves", 0)) > 0


class ReplicaGuard:
    """WAIT after writes; the entries no replica acknowledged; what a failover lost."""

    def __init__(self, client: redis.Redis, fence: str, wait_ms: int, link: Link) -> None:
        self.client = client
        self.fence = fence
        self.wait_ms = wait_ms
        self.link = link
        self._kept: deque[Written] = deque()
        self._seen = self._episodes()
        #: entries named lost so far, and how many of them were written again
        self.lost = 0
        self.rewritten = 0
        #: when a WAIT (or a look at INFO) last found no replica; None: WAIT as usual
        self._degraded_at: float | None = None

    def _episodes(self) -> tuple[int, int, int]:
        return (moves(self.client), self.link.reconnects, self.link.write_blocks)

    @property
    def unconfirmed(self) -> int:
        return len(self._kept)

    def written(self, items: list[Written]) -> None:
        """After a write that Redis acknowledged: WAIT for a replica.

        A master with no replica in sync (a promoted replica before the old master is
        back as its replica) would make every WAIT time out: after a WAIT that got no
        replica, the guard looks at ``INFO replication`` at most once per ``RECHECK_S``
        instead, and WAITs again once a replica is connected, keeping the entries
        meanwhile."""
        if self._degraded_at is not None:
            now = time.monotonic()
            if now - self._degraded_at < RECHECK_S:
                self._keep(items)
                return
            if not _has_replica(self.client):
                self._degraded_at = now
                self._keep(items)
                return
        acked = confirm(self.client, self.fence, self.wait_ms)
        if acked >= 1:
            self._degraded_at = None
            if self._kept:
                log.warning("bus_replication_confirmed", fence=self.fence, entries=len(self._kept))
                self._kept.clear()
            return
        self._degraded_at = time.monotonic()
        self._keep(items)

    def _keep(self, items: list[Written]) -> None:
        if not self._kept:
            log.error(
                "bus_replication_unconfirmed",
                fence=self.fence,
                wait_ms=self.wait_ms,
                first=f"{items[0][0]} {items[0][1]}",
                reason="no replica acknowledged the write in time; kept until one does, "
                "written again if a failover loses it",
            )
        self._kept.extend(items)
        if len(self._kept) > KEEP:
            dropped = len(self._kept) - KEEP
            for _ in range(dropped):
                self._kept.popleft()
            log.error("bus_replication_unconfirmed_dropped", fence=self.fence, entries=dropped)

    def recover(self) -> None:
        """Before a write: if the link lost its server or was redirected since the last
        look, find the kept entries a failover lost and write them again."""
        if not self._kept:
            self._seen = self._episodes()
            return
        # A connection whose server went away is replaced silently when it is next
        # taken from the pool (on the promoted replica): a PING settles it first, so a
        # failover shows in ``moves`` before the write that would land above the loss.
        self.client.ping()
        seen = self._episodes()
        if seen == self._seen:
            return
        self._seen = seen
        for stream, eid, fields in list(self._kept):
            if landed(self.client, stream, eid, fields[entries.F_MAC]):
                continue
            self.lost += 1
            try:
                self.client.xadd(
                    stream,
                    fields,  # type: ignore[arg-type]
                    id=eid,
                    maxlen=DEFAULT_MAXLEN,
                    approximate=True,
                )
                ok = True
            except redis.exceptions.ResponseError as exc:
                if not id_refused(exc):
                    raise
                ok = False
            self.rewritten += ok
            log.error(
                "bus_control_lost",
                stream=stream,
                entry=eid,
                seq=fields[entries.F_SEQ].decode(),
                type=fields[entries.F_TYPE].decode(),
                rewritten=ok,
                reason="a failover lost an entry no replica had acknowledged",
            )
