"""Foreign entries: ids beyond what any writer of the run follows (DESIGN §3 rule 3).

Nothing anyone writes stops a writer or wedges a stream: a foreign entry that moved a
stream's top is followed up to ``FOLLOW_LIMIT_MS`` ahead, and beyond that removed by the
coordinator (``repair_stream``).
"""

from __future__ import annotations

from typing import Any, Final

import redis

from flodl_bus.bus import entries
from flodl_bus.bus.ids import ZERO, EntryId, format_id, parse_id
from flodl_bus.bus.stream_ops import DEFAULT_MAXLEN, BusError, _as_map, log, stream_top

#: How far ahead of its own clock a writer follows a stream's top. A top further ahead
#: was put there by a foreign writer (every writer of the run makes ids from its own
#: clock): the writer does not follow it up to the largest id, where the stream would be
#: wedged, but has the coordinator remove it (``repair_stream``). Half a day tolerates
#: any clock skew between hosts that NTP leaves.
FOLLOW_LIMIT_MS: Final = 12 * 3600 * 1000


def writer_limit(now_ms: int) -> int:
    """The largest stream-top millisecond a writer follows; above it, it waits for the
    coordinator to remove the foreign entry (``repair_stream``)."""
    return now_ms + FOLLOW_LIMIT_MS


class StreamBlocked(BusError):
    """A foreign entry put the stream's top beyond any id a writer of the run may use."""


def repair_stream(
    client: redis.Redis, stream: str, dlq: str, *, floor: EntryId, now_ms: int, by: str
) -> int:
    """Remove foreign entries whose ids lie beyond what any writer of the run follows,
    and bring the stream's top and its groups back below them. Returns how many were
    removed (each is dead-lettered first).

    A foreign entry at the largest id wedges a stream for good: Redis refuses every later
    XADD, explicit id or ``*``. XDEL alone does not lower the top; XSETID does, once the
    entry is gone. A group that was handed the foreign entry has its last-delivered id
    beyond every real one, so it is set back too: it had been handed every real entry
    below, as Redis delivers in id order. Coordinator credential only (XDEL, XSETID,
    XGROUP SETID)."""
    limit = writer_limit(now_ms)
    removed = 0
    for _ in range(16):  # a writer keeps adding foreign entries: bounded, then give up
        top = stream_top(client, stream)
        if top[0] <= limit:
            return removed
        found: Any = client.xrange(stream, min=f"{limit + 1}-0", max="+", count=1000)
        pipe = client.pipeline(transaction=False)
        for raw_id, fields in found or ():
            eid = raw_id.decode()
            flat = _as_map(fields)
            pipe.xadd(
                dlq,
                entries.dead_letter_fields(  # type: ignore[arg-type]
                    stream, eid, "foreign: entry id beyond the horizon, removed", flat, by
                ),
                maxlen=DEFAULT_MAXLEN,
                approximate=True,
            )
            pipe.xdel(stream, eid)
            removed += 1
        pipe.execute()
        if found and len(found) >= 1000:
            continue
        last: Any = client.xrevrange(stream, "+", "-", count=1)
        new_top = max(parse_id(last[0][0]) if last else ZERO, floor)
        client.execute_command("XSETID", stream, format_id(new_top))  # type: ignore[no-untyped-call]
        groups: Any = client.xinfo_groups(stream)
        for g in groups:
            if parse_id(g["last-delivered-id"]) > new_top:
                client.xgroup_setid(stream, g["name"], format_id(new_top))
        log.warning("bus_stream_repaired", stream=stream, removed=removed, top=format_id(new_top))
    raise StreamBlocked(f"{stream}: foreign entries beyond the horizon keep coming")
