"""``send_batch`` in one EVALSHA (``bus.batch_script``), on a real redis-server: what it
does where a stream's top is not its own, after a lost script cache or a lost reply, and
what the per-run credentials may do with it. The order, loss and duplicate tests of
``send_batch`` in ``test_streams`` run it too (their real-server half)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from flodl_bus.bus import acl, entries
from flodl_bus.bus.batch_script import SHA, SOURCE, BatchScript, Refused
from flodl_bus.bus.connection import connect
from flodl_bus.bus.foreign import FOLLOW_LIMIT_MS
from flodl_bus.bus.ids import parse_id
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.server import RedisServer
from flodl_bus.bus.streams import RedisCoordinatorBus, RedisRankBus
from flodl_bus.protocol import messages as m
from tests.bus.conftest import CK, FAST, RK
from tests.bus.faults import Faults, lossy_client
from tests.bus.test_streams import _steps, collect

pytestmark = pytest.mark.redis

PATHS = ("script", "transaction")


@pytest.fixture
def admin(redis_url: str) -> Iterator[redis.Redis]:
    client = connect(redis_url)
    yield client
    client.close()


def _calls(client: redis.Redis) -> dict[str, int]:
    stats: Any = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


def _delta(before: dict[str, int], after: dict[str, int], cmd: str) -> int:
    return after.get(cmd, 0) - before.get(cmd, 0)


def _content(client: redis.Redis, stream: str) -> list[tuple[bytes, ...]]:
    """A stream's entries without their ids (two runs of one scenario compare equal)."""
    out = []
    for _, f in client.xrange(stream):
        out.append((f[b"type"], f[b"rank"], f[b"seq"], f[b"body"]))
    return out


def _steps_batch(first: int, targets: list[int | None]) -> list[tuple[int | None, Any]]:
    return [(t, m.SetGlobalStep(global_step=first + i)) for i, t in enumerate(targets)]


def test_a_batch_below_another_writers_top_is_renumbered_above_it_as_before(
    redis_url: str, admin: redis.Redis
) -> None:
    # An earlier coordinator of the run wrote ahead of this one's clock, on one stream
    # of the batch: the script refuses the whole batch (nothing written), the clock is
    # lifted above that top, and the batch goes again under new ids: the same outcome
    # as the transaction, which looks at the tops first.
    seen: dict[str, Any] = {}
    admin.script_load(SOURCE)  # a NOSCRIPT would count as one more call below
    for path in PATHS:
        keys = RunKeys(f"scripttop-{path}")
        coord = RedisCoordinatorBus(
            connect(redis_url), keys, CK, ranks=range(2), config=FAST, script=path == "script"
        )
        sec, usec = admin.time()
        ahead = sec * 1000 + usec // 1000 + 500  # ahead of now, within the follow limit
        other = RedisCoordinatorBus(connect(redis_url), keys, CK, ranks=range(2), config=FAST)
        other._clock.raise_floor((ahead, 0))
        other.send(1, m.SetGlobalStep(global_step=0))
        other.close()
        coord._seqs.clear()  # continue above the other coordinator's seq, as a new one would
        ranks = [RedisRankBus(connect(redis_url), keys, r, RK(r), config=FAST) for r in (0, 1)]
        before = _calls(admin)
        ids = coord.send_batch(_steps_batch(1, [0, 1, 0, 1]))
        after = _calls(admin)
        try:
            assert [parse_id(e) for e in ids] == sorted(parse_id(e) for e in ids)
            assert all(parse_id(e) > (ahead, 0) for e in ids)
            assert _steps(collect(ranks[0], 2)) == [1, 3]
            assert _steps(collect(ranks[1], 3)) == [0, 2, 4]
            if path == "script":
                # refused once, then written: two runs of the script, no transaction
                assert coord.script.off is None
                assert _delta(before, after, "evalsha") == 2
                assert _delta(before, after, "exec") == 0
            else:
                assert _delta(before, after, "evalsha") == 0
                assert _delta(before, after, "exec") == 1
            seen[path] = [_content(admin, keys.ctl(r)) for r in (0, 1)]
        finally:
            for b in (*ranks, coord):
                b.close()
    assert seen["script"] == seen["transaction"]


def test_a_foreign_top_beyond_the_horizon_is_removed_and_the_batch_lands_as_before(
    redis_url: str, admin: redis.Redis
) -> None:
    # A foreign entry far ahead (and one at the largest id) would wedge the streams: the
    # script names them, the coordinator removes them (dead-lettered) and writes the
    # batch below the horizon, as the transaction path does.
    seen: dict[str, Any] = {}
    for path in PATHS:
        keys = RunKeys(f"scriptforeign-{path}")
        coord = RedisCoordinatorBus(
            connect(redis_url), keys, CK, ranks=range(2), config=FAST, script=path == "script"
        )
        now_ms = admin.time()[0] * 1000
        admin.xadd(keys.ctl(0), {"type": "Junk"}, id=f"{now_ms + 2 * FOLLOW_LIMIT_MS}-0")
        admin.xadd(keys.ctl_all, {"type": "Junk"}, id=f"{2**64 - 1}-{2**64 - 1}")
        ranks = [RedisRankBus(connect(redis_url), keys, r, RK(r), config=FAST) for r in (0, 1)]
        try:
            coord.send_batch(_steps_batch(1, [0, 1, 0]))
            coord.send_batch(_steps_batch(10, [None, None]))
            assert _steps(collect(ranks[0], 4)) == [1, 3, 10, 11]
            assert _steps(collect(ranks[1], 3)) == [2, 10, 11]
            for st in (keys.ctl(0), keys.ctl_all):
                top = parse_id(admin.xinfo_stream(st)["last-generated-id"])
                assert top[0] < now_ms + FOLLOW_LIMIT_MS
            reasons = sorted(
                (keys.short(f[b"stream"].decode()), f[b"reason"])
                for _, f in admin.xrange(keys.dlq_for(keys.ctl(0)))
            )
            foreign = [r for r in reasons if r[1].startswith(b"foreign")]
            assert len(foreign) == 2
            seen[path] = (
                foreign,
                [_content(admin, st) for st in (keys.ctl(0), keys.ctl(1), keys.ctl_all)],
            )
        finally:
            for b in (*ranks, coord):
                b.close()
    assert seen["script"] == seen["transaction"]


def test_batches_racing_a_foreign_writer_lose_and_duplicate_nothing(
    redis_url: str, admin: redis.Redis
) -> None:
    # A writer of the run's keys that is not the coordinator keeps adding entries with
    # server-time ids (``*``): the coordinator's next id is often at or below them. Every
    # such batch is refused whole and renumbered; each rank still gets exactly the
    # coordinator's entries in send order (the foreign ones fail authentication).
    keys = RunKeys("scriptrace")
    coord = RedisCoordinatorBus(connect(redis_url), keys, CK, ranks=range(3), config=FAST)
    ranks = [RedisRankBus(connect(redis_url), keys, r, RK(r), config=FAST) for r in range(3)]
    stop = threading.Event()
    written = [0]

    def foreign() -> None:
        client = connect(redis_url)
        streams = [keys.ctl(0), keys.ctl(1), keys.ctl(2), keys.ctl_all]
        while not stop.is_set():
            client.xadd(streams[written[0] % 4], {"type": "SetGlobalStep", "rank": "0"})
            written[0] += 1
        client.close()

    expected: dict[int, list[int]] = {r: [] for r in range(3)}
    before = _calls(admin)
    racer = threading.Thread(target=foreign)
    racer.start()
    try:
        i = 0
        for n in range(150):
            targets: list[int | None] = (
                [None, None] if n % 5 == 4 else [(n + k) % 3 for k in range(4)]
            )
            coord.send_batch(_steps_batch(i, targets))
            for k, t in enumerate(targets):
                for r in range(3) if t is None else (t,):
                    expected[r].append(i + k)
            i += len(targets)
    finally:
        stop.set()
        racer.join(10)
    after = _calls(admin)
    try:
        assert coord.script.off is None
        assert _delta(before, after, "evalsha") >= 150
        assert _delta(before, after, "exec") == 0
        assert written[0] > 0
        for r in range(3):
            assert _steps(collect(ranks[r], len(expected[r]))) == expected[r], f"rank {r}"
            assert ranks[r].read_control(50) == []
    finally:
        for b in (*ranks, coord):
            b.close()


def test_a_lost_script_cache_is_loaded_again(tmp_path: Path) -> None:
    # SCRIPT FLUSH, then a restarted server (its cache empty, its streams from the AOF):
    # NOSCRIPT, which ran nothing, loads the script again. A lost SCRIPT LOAD reply (the
    # load ran) is retried and the batch still lands once.
    server = RedisServer(appendonly=True, directory=str(tmp_path)).start()
    keys = RunKeys("scriptcache")
    try:
        admin = connect(server.url)
        faults = Faults("SCRIPT", times=0)
        coord = RedisCoordinatorBus(
            lossy_client(faults, url=server.url), keys, CK, ranks=range(2), config=FAST
        )
        rank = RedisRankBus(connect(server.url), keys, 1, RK(1), config=FAST)
        coord.send_batch(_steps_batch(0, [0, 1]))
        assert coord.script.loads == 1 and coord.script.off is None
        admin.script_flush()
        faults.times = 1  # the next SCRIPT LOAD's reply is lost
        coord.send_batch(_steps_batch(2, [0, 1]))
        assert faults.lost == 1
        assert coord.script.loads >= 2
        admin.close()
        server.restart()
        admin = connect(server.url)
        loads = coord.script.loads
        coord.send_batch(_steps_batch(4, [1, 1]))
        assert coord.script.loads == loads + 1
        assert coord.script.off is None
        assert admin.xlen(keys.ctl(1)) == 4
        assert _steps(collect(rank, 4)) == [1, 3, 4, 5]
        assert admin.script_exists(SHA) == [True]
        rank.close()
        coord.close()
        admin.close()
    finally:
        server.cleanup()


def _argv_of(client: redis.Redis, streams: list[str]) -> tuple[list[str], list[Any]]:
    """The keys and arguments of the script call that wrote ``streams``' entries."""
    rows = sorted(
        (parse_id(eid), i, eid, f)
        for i, st in enumerate(streams, start=1)
        for eid, f in client.xrange(st)
    )
    argv: list[Any] = [1000]
    for _, i, eid, f in rows:
        argv += (i, eid, f[entries.F_TYPE], f[entries.F_RANK], f[entries.F_SEQ])
        argv += (f[entries.F_BODY], f[entries.F_MAC])
    return streams, argv


def test_the_same_script_call_sent_twice_writes_once(redis_url: str, admin: redis.Redis) -> None:
    # What a client resending a request whose reply was lost would send: the script finds
    # its first entry there, same id and MAC, and writes nothing. The same id with
    # another MAC is someone else's entry: refused, nothing written either.
    keys = RunKeys("scripttwice")
    coord = RedisCoordinatorBus(connect(redis_url), keys, CK, ranks=range(2), config=FAST)
    coord.send_batch(_steps_batch(0, [0, 1, 0]))
    streams = [keys.ctl(0), keys.ctl(1)]
    sizes = [admin.xlen(st) for st in streams]
    keys_, argv = _argv_of(admin, streams)
    script = BatchScript(admin)
    assert script.run(keys_, argv) == "landed"
    forged = list(argv)
    forged[7] = b"0" * 32  # the first entry's mac
    got = script.run(keys_, forged)
    assert isinstance(got, Refused) and {k for k, _ in got} == {1, 2}
    assert [admin.xlen(st) for st in streams] == sizes
    coord.close()


# ------------------------------------------------------------------ credentials


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Any]]]:
    server = RedisServer().start()
    out = tmp_path_factory.mktemp("acl")
    try:
        assert acl.main(["create", "sc", "--redis-url", server.url, "--env-dir", str(out)]) == 0
        envs = {}
        for role in acl.ROLES:
            text = (out / f"{role}.env").read_text().splitlines()
            envs[role] = dict(line.split("=", 1) for line in text if "=" in line)
        yield server.url, envs
    finally:
        server.cleanup()


def test_no_run_credential_may_run_or_load_the_script(
    acl_server: tuple[str, dict[str, Any]],
) -> None:
    # Arbitrary Lua could hold the server busy for every run, which no command the
    # coordinator may issue can: the per-run users get no script, the worker's least of
    # all (the script writes control). Loaded by the admin, it is still refused.
    url, envs = acl_server
    keys = RunKeys("sc")
    admin = connect(url)
    admin.script_load(SOURCE)
    argv = [1000, 1, "1-1", "SetGlobalStep", "0", "1", b"\x80", "0" * 32]
    for role in ("worker", "coordinator", "observer"):
        client = connect(url, env=envs[role])
        for cmd in (
            ("EVALSHA", SHA, 1, keys.ctl(0), *argv),
            ("EVALSHA_RO", SHA, 1, keys.ctl(0), *argv),
            ("SCRIPT", "LOAD", "return 1"),
            ("EVAL", "return 1", 0),
            ("FCALL", "f", 0),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*cmd)
        client.close()
    worker = connect(url, env=envs["worker"])
    with pytest.raises(redis.exceptions.NoPermissionError):
        worker.xadd(keys.ctl(0), {"type": "SetGlobalStep"}, id="1-1")
    worker.close()
    assert admin.exists(keys.ctl(0)) == 0
    # Asked anyway, the script is refused and switched off, nothing written.
    script = BatchScript(connect(url, env=envs["coordinator"]))
    assert script.run([keys.ctl(0)], argv) is None
    assert script.off is not None and "NOPERM" in script.off
    script.client.close()
    assert admin.exists(keys.ctl(0)) == 0
    # The coordinator's bus (a named user) does not ask, and delivers by the transaction.
    coord = RedisCoordinatorBus(
        connect(url, env=envs["coordinator"]), keys, CK, ranks=range(2), config=FAST
    )
    rank = RedisRankBus(connect(url, env=envs["worker"]), keys, 0, RK(0), config=FAST)
    try:
        before = _calls(admin)
        coord.send_batch(_steps_batch(0, [0, 1, 0]))
        coord.send_batch(_steps_batch(3, [0]))
        after = _calls(admin)
        assert coord.script.off is not None and "named Redis user" in coord.script.off
        assert _delta(before, after, "evalsha") == 0
        assert _delta(before, after, "exec") == 2
        assert _steps(collect(rank, 3)) == [0, 2, 3]
    finally:
        rank.close()
        coord.close()
        admin.close()


def test_a_scripted_batch_is_still_waited_for_and_kept_until_a_replica_has_it(
    redis_url: str, admin: redis.Redis
) -> None:
    # ``wait_ms`` > 0: WAIT 1 follows the script as it followed EXEC. This server has no
    # replica, so no WAIT is ever acknowledged and every entry of every batch is kept
    # (to be written again after a failover, ``bus.replication``).
    keys = RunKeys("scriptwait")
    coord = RedisCoordinatorBus(
        connect(redis_url), keys, CK, ranks=range(2), config=FAST, wait_ms=20
    )
    before = _calls(admin)
    coord.send_batch(_steps_batch(0, [0, 1, 0]))
    coord.send_batch(_steps_batch(3, [None, None]))
    after = _calls(admin)
    try:
        assert coord.script.off is None
        assert _delta(before, after, "exec") == 0
        assert _delta(before, after, "wait") == 1  # then degraded: kept without waiting
        assert coord._guard is not None and coord._guard.unconfirmed == 5
    finally:
        coord.close()
