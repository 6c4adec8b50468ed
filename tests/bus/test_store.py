"""RedisStore against a real redis-server: torch's Store semantics, and a gloo group
formed through it by two real processes."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from flodl_bus.bus.store import RedisStore

pytestmark = pytest.mark.redis


@pytest.fixture
def store(redis_url: str) -> Iterator[RedisStore]:
    s = RedisStore(redis_url, f"test:{{{uuid.uuid4().hex[:8]}}}:store:s/", timedelta(seconds=2))
    try:
        yield s
    finally:
        s.clear()
        s.close()


def test_set_then_get_returns_the_bytes_for_str_and_bytes_values(store: RedisStore) -> None:
    store.set("a", "text")
    store.set("b", b"\x00\xffraw")
    assert store.get("a") == b"text"
    assert store.get("b") == b"\x00\xffraw"


def test_set_overwrites(store: RedisStore) -> None:
    store.set("a", "1")
    store.set("a", "2")
    assert store.get("a") == b"2"
    assert store.num_keys() == 1


def test_get_of_a_missing_key_fails_after_the_store_timeout(store: RedisStore) -> None:
    store.set_timeout(timedelta(seconds=0.3))
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        store.get("never")
    waited = time.monotonic() - started
    assert 0.3 <= waited < 3.0


def test_get_blocks_until_another_client_sets_the_key(store: RedisStore) -> None:
    other = store.clone()
    timer = threading.Timer(0.2, lambda: other.set("late", "here"))
    timer.start()
    try:
        assert store.get("late") == b"here"
    finally:
        timer.join()


def test_a_get_blocked_on_a_connection_that_is_killed_reconnects_and_still_returns(
    store: RedisStore, redis_url: str
) -> None:
    import redis

    store.set_timeout(timedelta(seconds=10))
    waiter_id = store._client.client_id()  # the store's one pooled connection
    got: list[bytes] = []
    waiter = threading.Thread(target=lambda: got.append(store.get("later")))
    waiter.start()
    time.sleep(0.3)  # blocked in BLMOVE by now
    admin = redis.Redis.from_url(redis_url)
    try:
        assert admin.client_kill_filter(_id=waiter_id) == 1
        time.sleep(0.2)
        store.clone().set("later", "still here")
        waiter.join(10)
    finally:
        admin.close()
    assert got == [b"still here"]


def test_add_creates_then_increments_a_counter_readable_with_get(store: RedisStore) -> None:
    assert store.add("n", 2) == 2
    assert store.add("n", 3) == 5
    assert store.add("n", -1) == 4
    assert store.get("n") == b"4"


def test_compare_set_follows_torch_semantics(store: RedisStore) -> None:
    # missing key, empty expected: set
    assert store.compare_set("k", "", "v1") == b"v1"
    # mismatch: unchanged, returns the current value
    assert store.compare_set("k", "other", "v2") == b"v1"
    # match: swapped
    assert store.compare_set("k", "v1", "v3") == b"v3"
    assert store.get("k") == b"v3"
    # missing key, non-empty expected: nothing set, returns expected
    assert store.compare_set("missing", "exp", "x") == b"exp"
    assert not store.check(["missing"])


def test_wait_returns_once_every_key_exists(store: RedisStore) -> None:
    store.set("x", "1")
    threading.Timer(0.1, lambda: store.clone().set("y", "2")).start()
    store.wait(["x", "y"])
    store.wait(["x", "y"], timedelta(seconds=1))


def test_wait_with_a_timeout_fails_within_that_timeout(store: RedisStore) -> None:
    store.set("x", "1")
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        store.wait(["x", "nope"], timedelta(seconds=0.2))
    assert time.monotonic() - started < 10.0  # bounded, not fast: speed is for benches


def test_a_wait_whose_caller_gives_it_up_ends_with_the_reason_before_its_timeout(
    redis_url: str,
) -> None:
    """``cancelled`` is asked between two slices of a wait: once it names a reason, the
    wait (and a gloo rendezvous blocked in it) ends with that reason, the store timeout
    (an hour here) notwithstanding; a clone keeps the question."""
    why: list[str] = []
    s = RedisStore(
        redis_url,
        f"test:{{{uuid.uuid4().hex[:8]}}}:store:c/",
        timedelta(hours=1),
        cancelled=lambda: why[0] if why else None,
    )
    errors: list[BaseException] = []

    def waiter(store: RedisStore) -> None:
        try:
            store.wait(["never"])
        except dist.DistStoreError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=waiter, args=(t,), daemon=True) for t in (s, s.clone())]
    try:
        for t in threads:
            t.start()
        why.append("a newer session was offered")
        for t in threads:
            t.join(30.0)
            assert not t.is_alive()
        assert len(errors) == 2
        assert all("a newer session was offered" in str(e) for e in errors)
    finally:
        s.close()


def test_wait_without_a_timeout_uses_the_store_timeout(store: RedisStore) -> None:
    store.set_timeout(timedelta(seconds=0.25))
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        store.wait(["nope"])
    assert 0.25 <= time.monotonic() - started < 10.0


def test_check_delete_and_num_keys(store: RedisStore) -> None:
    assert store.check([])
    store.set("a", "1")
    store.add("b", 1)
    assert store.check(["a", "b"])
    assert not store.check(["a", "c"])
    assert store.num_keys() == 2
    assert store.delete_key("a") is True
    assert store.delete_key("a") is False
    assert not store.check(["a"])
    assert store.num_keys() == 1


def test_a_deleted_key_blocks_get_again_until_it_is_set(store: RedisStore) -> None:
    store.set("a", "1")
    store.delete_key("a")
    store.set_timeout(timedelta(seconds=0.2))
    with pytest.raises(dist.DistStoreError):
        store.get("a")


def test_multi_set_multi_get_and_append(store: RedisStore) -> None:
    store.multi_set(["p", "q"], ["1", b"2"])
    assert store.multi_get(["p", "q"]) == [b"1", b"2"]
    store.append("log", "ab")
    store.append("log", b"cd")
    assert store.get("log") == b"abcd"


def test_sessions_with_different_prefixes_never_see_each_other(
    store: RedisStore, redis_url: str
) -> None:
    other = RedisStore(redis_url, store.prefix + "next/", timedelta(seconds=0.2))
    try:
        store.set("addr", "old-session")
        assert not other.check(["addr"])
        with pytest.raises(dist.DistStoreError):
            other.get("addr")
        assert other.num_keys() == 0
    finally:
        other.clear()
        other.close()


def test_torch_prefix_store_drives_it_through_the_cpp_trampoline(store: RedisStore) -> None:
    wrapped = dist.PrefixStore("pg", store)
    wrapped.set("k", "v")
    assert wrapped.get("k") == b"v"
    assert store.get("pg/k") == b"v"
    assert wrapped.add("c", 3) == 3
    assert wrapped.compare_set("cs", "", "z") == b"z"
    assert wrapped.num_keys() == 3
    assert wrapped.delete_key("k") is True
    with pytest.raises(dist.DistStoreError):
        wrapped.wait(["absent"], timedelta(seconds=0.2))


def test_two_processes_form_a_gloo_group_through_the_store(redis_url: str) -> None:
    prefix = f"test:{{{uuid.uuid4().hex[:8]}}}:store:gloo/"
    code = (
        "import sys, datetime, torch, torch.distributed as dist\n"
        "from flodl_bus.bus.store import RedisStore\n"
        "rank = int(sys.argv[1])\n"
        f"s = RedisStore({redis_url!r}, {prefix!r}, datetime.timedelta(seconds=20))\n"
        "pg = dist.ProcessGroupGloo(s, rank, 2, datetime.timedelta(seconds=20))\n"
        "t = torch.tensor([float(rank + 1)])\n"
        "pg.allreduce([t]).wait()\n"
        "print(t.item())\n"
        "del pg  # a gloo group alive at interpreter exit ends in std::terminate\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(r)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert float(out.strip().splitlines()[-1]) == 3.0
    RedisStore(redis_url, prefix).clear()
