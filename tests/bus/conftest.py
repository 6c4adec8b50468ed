"""Fixtures of the bus tests: one backend, many clients.

``backend`` runs a test against fakeredis (one shared ``FakeServer``, so several clients
see one data set) and against the session's real redis-server. Every client is built
like production builds it: no redis-py retries, so a lost connection reaches the bus.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import fakeredis
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from flodl_bus.bus.connection import Backoff, connect
from flodl_bus.bus.stream_ops import StreamsConfig
from flodl_bus.protocol.signing import RankKeys, fixed_keys, rank_keys_for

#: Fast reconnects so fault tests stay short.
FAST = StreamsConfig(backoff=Backoff(base_s=0.002, factor=2.0, cap_s=0.05))
SECRET = bytes(range(16))
#: the coordinator's keys and each rank's, from one seed (no join in these tests)
CK = fixed_keys(bytes(range(32)))


def RK(rank: int) -> RankKeys:
    return rank_keys_for(CK, rank)


@dataclass
class Backend:
    kind: str
    make: Callable[[], redis.Redis]
    admin: redis.Redis
    url: str | None = None
    fake_server: fakeredis.FakeServer | None = None

    @property
    def real(self) -> bool:
        return self.kind == "redis-server"

    def kill_connections(self) -> None:
        """Drop every client connection (CLIENT KILL on a real server)."""
        if self.fake_server is not None:
            self.fake_server.connected = False
            time.sleep(0.01)
            self.fake_server.connected = True
        else:
            self.admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")


def fake_client(server: fakeredis.FakeServer) -> redis.Redis:
    return fakeredis.FakeRedis(server=server, retry=Retry(NoBackoff(), 0))


@pytest.fixture(params=["fakeredis", "redis-server"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "fakeredis":
        server = fakeredis.FakeServer()
        yield Backend("fakeredis", lambda: fake_client(server), fake_client(server), None, server)
        return
    url: str = request.getfixturevalue("redis_url")
    admin = connect(url)
    admin.flushdb()
    try:
        yield Backend("redis-server", lambda: connect(url), admin, url)
    finally:
        admin.close()


@pytest.fixture
def url(redis_url: str) -> Iterator[str]:
    """The test server's URL, its keys flushed (the ingest tests count what is left)."""
    admin = connect(redis_url)
    admin.flushdb()
    admin.close()
    yield redis_url
