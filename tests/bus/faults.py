"""Fault injection for the bus tests: a connection that loses the reply of a command.

The server really executes the command (the request went out); the client then sees
its connection drop before the reply arrives, which is exactly the case redis-py would
silently retry and the bus must make harmless.
"""

from __future__ import annotations

import threading
from typing import Any

import fakeredis
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry


class Faults:
    """Lose the reply of the next ``times`` requests that contain ``command``."""

    def __init__(self, command: str, times: int = 1) -> None:
        self.marker = f"${len(command)}\r\n{command.upper()}\r\n".encode()
        self.times = times
        self.lost = 0
        self._lock = threading.Lock()

    def arm(self, packed: Any) -> bool:
        data = packed if isinstance(packed, bytes) else b"".join(bytes(p) for p in packed)
        with self._lock:
            if self.times > 0 and self.marker in data.upper():
                self.times -= 1
                self.lost += 1
                return True
        return False


def _lossy(base: type[redis.Connection], faults: Faults) -> type[redis.Connection]:
    class Lossy(base):  # type: ignore[misc, valid-type]
        _armed = False

        def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            armed = faults.arm(command)
            super().send_packed_command(command, check_health)
            self._armed = armed

        def read_response(self, *args: Any, **kwargs: Any) -> Any:
            if self._armed:
                self._armed = False
                self.disconnect()
                raise redis.exceptions.ConnectionError("reply lost (injected)")
            return super().read_response(*args, **kwargs)

    return Lossy


def lossy_client(
    faults: Faults, *, url: str | None = None, server: fakeredis.FakeServer | None = None
) -> redis.Redis:
    retry = Retry(NoBackoff(), 0)
    if server is not None:
        cls = _lossy(fakeredis.FakeRedis(server=server).connection_pool.connection_class, faults)
        pool = redis.ConnectionPool(connection_class=cls, server=server, retry=retry)
    else:
        assert url is not None
        cls = _lossy(redis.Connection, faults)
        pool = redis.ConnectionPool.from_url(
            url, connection_class=cls, retry=retry, socket_timeout=10
        )
    return redis.Redis(connection_pool=pool)
