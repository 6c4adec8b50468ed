"""One console line when the run's Redis refuses writes for lack of memory.

Under ``maxmemory-policy noeviction`` (ops/redis.conf) a full Redis answers every write
with OOM; the bus waits and retries (``bus.connection.Link``), so nothing fails and the
run just stops moving. ``flodl-bus up`` asks ``INFO memory`` every few seconds and says
so once, with the figures, and once more when writes are accepted again: an operator
sees why the progress bar stands still without reading any child's log.

The test is Redis's own: writes are refused while ``used_memory`` minus the memory it
does not count for eviction (replication and AOF buffers) exceeds ``maxmemory``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Final

import redis

#: How often ``up`` asks (one INFO: a few hundred microseconds on the server).
EVERY_S: Final = 2.0


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def out_of_memory(info: dict[str, Any]) -> tuple[int, int] | None:
    """``(maxmemory, used)`` when Redis refuses writes for memory, else None."""
    limit = int(info.get("maxmemory", 0))
    if limit <= 0:
        return None
    used = int(info.get("used_memory", 0)) - int(info.get("mem_not_counted_for_evict", 0))
    return (limit, used) if used > limit else None


class RedisMemoryWatch:
    """``poll()`` returns a line to print when Redis turns full or has room again."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        every_s: float = EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.every_s = every_s
        self._clock = clock
        self._next = 0.0
        self._full_since: float | None = None
        #: False once the server refused INFO (an ACL user without it): never ask again
        self.enabled = True

    def poll(self) -> str | None:
        now = self._clock()
        if not self.enabled or now < self._next:
            return None
        self._next = now + self.every_s
        try:
            info: dict[str, Any] = self.client.info("memory")  # type: ignore[assignment]
        except redis.exceptions.NoPermissionError:
            self.enabled = False
            return None
        except redis.exceptions.RedisError:
            return None  # unreachable: the watch loop says that already
        full = out_of_memory(info)
        if full is not None and self._full_since is None:
            self._full_since = now
            limit, used = full
            return (
                f"  Redis is out of memory (maxmemory {_human(limit)}, used {_human(used)}); "
                "waiting"
            )
        if full is None and self._full_since is not None:
            waited = now - self._full_since
            self._full_since = None
            return f"  Redis accepts writes again (was out of memory for {waited:.0f}s)"
        return None
