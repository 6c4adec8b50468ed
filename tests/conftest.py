"""Shared fixtures: a real redis-server per test session, and fakeredis."""

from __future__ import annotations

import os
from collections.abc import Iterator

import fakeredis
import pytest
import redis

from flodl_bus.bus.server import RedisServer
from flodl_bus.params.hosts import pin_one_host
from flodl_bus.record.log import configure_console

# Every process group a test forms (and every process it starts) stays on loopback.
pin_one_host(os.environ)

# An in-process CLI configures the console log once per process, with loggers cached on
# their first use; one first used outside a test's ``capture_logs`` escaped the capture
# from then on (a miss that depended on which earlier test logged first). The same
# console, uncached, for the whole session.
configure_console(cache=False)

#: what a rank run in this process (``run_rank``, a ``UserGroup``) writes into the
#: environment, as a rank's process does; a later test's ``up`` would hand it to its own
#: ranks (a world of one's LOCAL_RANK, a store's MASTER_PORT)
RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _rank_env_restored() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in RANK_ENV}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


# The recorded-run fixtures and helpers (flodl_bus.replay.testing) for every test module.
pytest_plugins = ["flodl_bus.replay.testing"]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer | None]:
    """A real redis-server on a free port for the whole session (None if REDIS_URL)."""
    if os.environ.get("REDIS_URL"):
        yield None
        return
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer | None) -> str:
    if redis_server is None:
        return os.environ["REDIS_URL"]
    return redis_server.url


@pytest.fixture
def real_redis(redis_url: str) -> Iterator[redis.Redis]:
    """A client on the session's real server, flushed before each test."""
    client = redis.Redis.from_url(redis_url, socket_timeout=10)
    client.flushdb()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def fake_redis() -> Iterator[fakeredis.FakeRedis]:
    server = fakeredis.FakeServer()
    client = fakeredis.FakeRedis(server=server)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(params=["fakeredis", "redis-server"])
def any_redis(request: pytest.FixtureRequest) -> redis.Redis:
    """Run a transport test against both fakeredis and a real redis-server."""
    if request.param == "fakeredis":
        return request.getfixturevalue("fake_redis")  # type: ignore[no-any-return]
    return request.getfixturevalue("real_redis")  # type: ignore[no-any-return]
