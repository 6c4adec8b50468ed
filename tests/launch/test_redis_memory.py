"""``up``'s one line when Redis is out of memory, against a real redis-server."""

from __future__ import annotations

import pytest
import redis

from flodl_bus.bus.connection import connect
from flodl_bus.bus.server import RedisServer
from flodl_bus.launch.redis_memory import RedisMemoryWatch, out_of_memory

pytestmark = pytest.mark.redis


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_out_of_memory_follows_redis_own_rule() -> None:
    assert out_of_memory({"maxmemory": 0, "used_memory": 10**9}) is None
    assert out_of_memory({"maxmemory": 100, "used_memory": 100}) is None
    assert out_of_memory({"maxmemory": 100, "used_memory": 150}) == (100, 150)
    # Replication and AOF buffers do not count against maxmemory.
    assert (
        out_of_memory({"maxmemory": 100, "used_memory": 150, "mem_not_counted_for_evict": 60})
        is None
    )


def test_one_line_when_redis_turns_full_and_one_when_it_has_room_again() -> None:
    with RedisServer() as server:
        client = connect(server.url)
        clock = Clock()
        watch = RedisMemoryWatch(client, every_s=2.0, clock=clock)
        try:
            assert watch.poll() is None
            used = int(client.info("memory")["used_memory"])
            client.config_set("maxmemory", str(used // 2))
            # The server really refuses writes now: what the line claims is true.
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                client.xadd("s", {"a": "b"})
            assert watch.poll() is None  # asked at most every 2 s
            clock.now = 2.0
            line = watch.poll()
            assert line is not None
            assert line.strip().startswith("Redis is out of memory (maxmemory ")
            assert line.endswith("; waiting")
            clock.now = 4.0
            assert watch.poll() is None  # said once per episode
            client.config_set("maxmemory", "0")
            client.xadd("s", {"a": "b"})
            clock.now = 9.0
            assert watch.poll() == "  Redis accepts writes again (was out of memory for 7s)"
            clock.now = 11.0
            assert watch.poll() is None
        finally:
            client.close()
