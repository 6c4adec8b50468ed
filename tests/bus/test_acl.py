"""Per-run ACL users (``flodl-bus acl``) against a real redis-server.

The server of this module starts with the default user open (it is the admin that runs
``flodl-bus acl create``); every check then talks as a per-run user made by the command,
with the credentials it wrote to its env files. Run ``A`` is the run under test, run
``B`` a neighbour on the same server whose keys A's users must never reach.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from flodl_bus.bus import acl
from flodl_bus.bus.connection import connect
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.server import RedisServer
from flodl_bus.bus.store import RedisStore

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parents[2]
A, B = RunKeys("acl-a"), RunKeys("acl-b")
BIG_ID = "18446744073709551615-18446744073709551615"


def _env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


@dataclass
class Acl:
    server: RedisServer
    admin: redis.Redis
    envs: dict[tuple[str, str], dict[str, str]]  # (run, role) -> env of that role

    @property
    def url(self) -> str:
        return self.server.url

    def client(self, run: RunKeys, role: str) -> redis.Redis:
        # Credentials from the environment, as a process of the run gets them.
        return connect(self.url, env=self.envs[(run.run, role)], client_name=f"test-{role}")


@pytest.fixture(scope="module")
def acl_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Acl]:
    server = RedisServer().start()
    admin = connect(server.url)
    envs = {}
    try:
        for run in (A, B):
            out = tmp_path_factory.mktemp(run.run)
            assert (
                acl.main(["create", run.run, "--redis-url", server.url, "--env-dir", str(out)]) == 0
            )
            for role in acl.ROLES:
                envs[(run.run, role)] = _env_file(out / f"{role}.env")
        yield Acl(server, admin, envs)
    finally:
        admin.close()
        server.cleanup()


def _seed(admin: redis.Redis, k: RunKeys) -> None:
    for stream in (k.ctl(0), k.ctl_all, k.up(0), k.join, k.dlq):
        admin.xadd(stream, {"type": "Seed", "rank": "0", "seq": "1"}, id="1-1")
    for stream in (k.ctl(0), k.ctl_all):
        admin.xgroup_create(stream, "rank0", id="0")
    admin.xgroup_create(k.up(0), "coordinator", id="0")
    admin.hset(k.meta, mapping={"status": "running", "job": "digits"})
    admin.hset(k.identity, mapping={"sign": "00" * 32, "check": "00"})
    admin.set(k.secret, "11" * 16)
    admin.set(k.store("s/k:x"), "1")
    admin.sadd(k.store("s/keys"), "x")


@pytest.fixture
def env(acl_env: Acl) -> Acl:
    acl_env.admin.flushdb()
    _seed(acl_env.admin, A)
    _seed(acl_env.admin, B)
    return acl_env


@pytest.fixture
def worker(env: Acl) -> Iterator[redis.Redis]:
    client = env.client(A, "worker")
    yield client
    client.close()


@pytest.fixture
def observer(env: Acl) -> Iterator[redis.Redis]:
    client = env.client(A, "observer")
    yield client
    client.close()


@pytest.fixture
def coordinator(env: Acl) -> Iterator[redis.Redis]:
    client = env.client(A, "coordinator")
    yield client
    client.close()


Cmd = tuple[Any, ...]


def _keyed(cmds: list[Cmd]) -> list[Cmd]:
    """The commands that name a key of the run (those must all fail on another run)."""
    # SCAN is the one key-less command there: it lists names (never values) of any run.
    return [
        c
        for c in cmds
        if c[0] != "SCAN" and any(str(a).startswith(("flodl:", "flodl-secret:")) for a in c)
    ]


# Every command a worker issues (module docstring of flodl_bus.bus.acl), on its keys.
def worker_may(k: RunKeys) -> list[Cmd]:
    st = k.store
    return [
        ("PING",),
        ("SELECT", "0"),
        ("CLIENT", "SETNAME", "flodl-rank0"),
        ("CLIENT", "GETNAME"),
        ("CLIENT", "ID"),
        ("XADD", k.up(0), "MAXLEN", "~", "100", "2-1", "type", "Heartbeat"),
        ("XADD", k.up(3), "*", "type", "Heartbeat"),
        ("XRANGE", k.up(0), "-", "+", "COUNT", "1"),
        ("XREVRANGE", k.up(0), "+", "-", "COUNT", "64"),
        ("XINFO", "STREAM", k.up(0)),
        ("XADD", k.join, "MAXLEN", "~", "10000", "*", "type", "Hello"),
        ("XREAD", "COUNT", "256", "STREAMS", k.join, "0"),
        ("XRANGE", k.join, "-", "+"),
        ("XREVRANGE", k.join, "+", "-"),
        ("XINFO", "STREAM", k.join),
        ("XADD", k.dlq, "MAXLEN", "~", "100", "*", "reason", "bad mac"),
        (
            "XREAD",
            "COUNT",
            "512",
            "BLOCK",
            "1",
            "STREAMS",
            k.ctl(0),
            k.ctl_all,
            "0",
            "0",
        ),
        ("XINFO", "STREAM", k.ctl(0)),
        ("XRANGE", k.ctl(0), "-", "+"),
        ("XREVRANGE", k.ctl_all, "+", "-", "COUNT", "1"),
        ("XREAD", "STREAMS", k.ctl_all, "0"),
        ("HGETALL", k.meta),
        ("HGET", k.meta, "status"),
        ("HMGET", k.meta, "status", "job"),
        ("EXISTS", k.meta),
        ("HGETALL", k.identity),
        ("HGET", k.identity, "sign"),
        ("SET", st("s/k:y"), "addr"),
        ("GET", st("s/k:x")),
        ("MGET", st("s/k:x"), st("s/k:y")),
        ("INCRBY", st("s/k:n"), "1"),
        ("APPEND", st("s/k:y"), "more"),
        ("EXISTS", st("s/k:x"), st("s/k:y")),
        ("DEL", st("s/r:y")),
        ("RPUSH", st("s/r:y"), "1"),
        ("BLMOVE", st("s/r:y"), st("s/r:y"), "LEFT", "RIGHT", "0.01"),
        ("SADD", st("s/keys"), "y"),
        ("SREM", st("s/keys"), "y"),
        ("SCARD", st("s/keys")),
        ("SMEMBERS", st("s/keys")),
    ]


def worker_may_not(k: RunKeys) -> list[Cmd]:
    return [
        # no consumer group on a rank's control: another reader could take from it
        ("XGROUP", "CREATE", k.ctl(5), "rank5", "0", "MKSTREAM"),
        ("XGROUP", "CREATE", k.ctl_all, "rank5", "0"),
        ("XREADGROUP", "GROUP", "rank1", "thief", "STREAMS", k.ctl(1), k.ctl_all, ">", ">"),
        ("XACK", k.ctl(0), "rank0", "1-1"),
        ("XINFO", "GROUPS", k.ctl_all),
        ("XADD", k.ctl(0), "*", "type", "StartEpoch"),
        ("XADD", k.ctl_all, BIG_ID, "type", "Shutdown"),
        ("XADD", k.meta, "*", "a", "b"),
        ("DEL", k.up(0)),
        ("DEL", k.ctl(0)),
        ("DEL", k.meta),
        ("DEL", k.join),
        ("UNLINK", k.up(0)),
        ("XTRIM", k.up(0), "MAXLEN", "0"),
        ("XTRIM", k.ctl(0), "MAXLEN", "0"),
        ("XDEL", k.up(0), "1-1"),
        ("XDEL", k.ctl(0), "1-1"),
        ("XSETID", k.up(0), BIG_ID),
        ("XSETID", k.ctl_all, BIG_ID),
        ("XGROUP", "DESTROY", k.ctl(0), "rank0"),
        ("XGROUP", "SETID", k.ctl(0), "rank0", "$"),
        ("XGROUP", "DELCONSUMER", k.ctl(0), "rank0", "rank0"),
        ("XGROUP", "CREATECONSUMER", k.ctl(0), "rank0", "intruder"),
        ("XGROUP", "CREATE", k.up(0), "thief", "0"),
        ("XREADGROUP", "GROUP", "coordinator", "coordinator", "STREAMS", k.up(0), ">"),
        ("XACK", k.up(0), "coordinator", "1-1"),
        ("XCLAIM", k.ctl(0), "rank0", "thief", "0", "1-1"),
        ("XAUTOCLAIM", k.ctl(0), "rank0", "thief", "0", "0"),
        ("XRANGE", k.dlq, "-", "+"),
        ("GET", k.secret),
        ("EXISTS", k.secret),
        ("SET", k.secret, "00" * 16),
        ("HSET", k.meta, "status", "done"),
        ("HDEL", k.meta, "status"),
        ("HSET", k.identity, "sign", "ff" * 32),
        ("SET", k.identity, "x"),
        ("DEL", k.identity),
        ("SET", f"{k.prefix}other", "x"),
        ("GET", f"{k.prefix}other"),
        ("SET", "not-flodl", "x"),
        ("CONFIG", "GET", "*"),
        ("CONFIG", "SET", "maxmemory", "1"),
        ("FLUSHDB",),
        ("FLUSHALL",),
        ("KEYS", "*"),
        ("SCAN", "0"),
        ("INFO",),
        ("EVAL", "return 1", "0"),
        ("EVAL_RO", "return 1", "1", k.up(0)),
        ("FUNCTION", "FLUSH"),
        ("SCRIPT", "FLUSH"),
        ("PUBLISH", "ch", "m"),
        ("CLIENT", "LIST"),
        ("CLIENT", "KILL", "TYPE", "normal"),
        ("ACL", "LIST"),
        ("MONITOR",),
    ]


def observer_may(k: RunKeys) -> list[Cmd]:
    return [
        ("PING",),
        ("CLIENT", "SETNAME", "flodl-tail"),
        ("XREAD", "COUNT", "1000", "STREAMS", k.ctl(0), k.ctl_all, k.up(0), "0", "0", "0"),
        ("XREAD", "BLOCK", "1", "STREAMS", k.dlq, "$"),
        ("XRANGE", k.ctl(0), "-", "+"),
        ("XRANGE", k.join, "-", "+"),
        ("XRANGE", k.dlq, "-", "+"),
        ("XREVRANGE", k.up(0), "+", "-", "COUNT", "5"),
        ("XLEN", k.ctl_all),
        ("XINFO", "STREAM", k.up(0)),
        ("XINFO", "GROUPS", k.ctl(0)),
        ("XINFO", "CONSUMERS", k.ctl(0), "rank0"),
        ("XPENDING", k.ctl(0), "rank0"),
        ("XPENDING", k.ctl_all, "rank0", "-", "+", "10"),
        ("HGETALL", k.meta),
        ("HGET", k.meta, "status"),
        ("HGETALL", k.identity),
        ("EXISTS", k.dlq),
        ("TYPE", k.ctl(0)),
        ("SCAN", "0", "MATCH", f"{k.prefix}*", "COUNT", "1000", "TYPE", "stream"),
        # flodl-bus status and tail: does the run exist, its dead letters
        ("EXISTS", k.meta, k.join, k.ctl_all),
        ("SCAN", "0", "MATCH", f"{k.prefix}*", "COUNT", "1000"),
        ("XLEN", k.dlq),
    ]


def observer_may_not(k: RunKeys) -> list[Cmd]:
    return [
        # no script: a busy one stops the server for every run (issue 28)
        ("EVAL_RO", "return redis.call('XRANGE', KEYS[1], '-', '+')", "1", k.ctl(0)),
        ("EVAL_RO", "return 1", "0"),
        ("EVAL", "return 1", "0"),
        ("XREADGROUP", "GROUP", "rank0", "rank0", "STREAMS", k.ctl(0), ">"),
        ("XACK", k.ctl(0), "rank0", "1-1"),
        ("XGROUP", "CREATE", k.ctl(0), "peek", "0"),
        ("XADD", k.ctl(0), "*", "a", "b"),
        ("XADD", k.up(0), "*", "a", "b"),
        ("XADD", k.join, "*", "a", "b"),
        ("XADD", k.dlq, "*", "a", "b"),
        ("XTRIM", k.up(0), "MAXLEN", "0"),
        ("XDEL", k.up(0), "1-1"),
        ("DEL", k.meta),
        ("HSET", k.meta, "status", "x"),
        ("HSET", k.identity, "sign", "x"),
        ("GET", k.secret),
        ("SET", k.store("s/k:x"), "x"),
        ("EVAL", "return 1", "0"),
        ("CONFIG", "GET", "*"),
        ("KEYS", "*"),
        ("FLUSHDB",),
        ("INFO",),
    ]


def coordinator_may(k: RunKeys) -> list[Cmd]:
    return [
        ("PING",),
        ("CLIENT", "SETNAME", "flodl-coordinator"),
        ("EXISTS", k.meta),
        ("HSET", k.meta, "status", "joining"),
        ("EXPIRE", k.meta, "604800"),
        ("SET", k.secret, "22" * 16, "NX"),
        ("GET", k.secret),
        ("EXISTS", k.secret),
        ("DEL", k.identity),
        ("HSET", k.identity, "sign", "ab" * 32),
        ("XADD", k.ctl(0), "MAXLEN", "~", "100000", "5-1", "type", "StartEpoch"),
        ("XADD", k.ctl_all, "5-2", "type", "Shutdown"),
        ("XGROUP", "CREATE", k.ctl(1), "rank1", "0", "MKSTREAM"),
        ("XGROUP", "CREATE", k.up(1), "coordinator", "0", "MKSTREAM"),
        ("XREADGROUP", "GROUP", "coordinator", "coordinator", "STREAMS", k.up(0), ">"),
        ("XACK", k.up(0), "coordinator", "1-1"),
        ("XRANGE", k.ctl(0), "5-1", "5-1", "COUNT", "1"),
        ("XREVRANGE", k.ctl(0), "+", "-", "COUNT", "64"),
        ("XINFO", "STREAM", k.ctl_all),
        ("XINFO", "GROUPS", k.ctl_all),
        ("XADD", k.dlq, "*", "reason", "foreign"),
        ("XADD", k.join, "*", "type", "Assign"),
        ("XREAD", "STREAMS", k.join, "0"),
        ("XADD", k.up(2), BIG_ID, "type", "junk"),
        ("XDEL", k.up(2), BIG_ID),
        ("XSETID", k.up(2), "1-0"),
        ("XGROUP", "SETID", k.ctl(0), "rank0", "0"),
        ("XGROUP", "CREATECONSUMER", k.ctl(0), "rank0", "c"),
        ("XGROUP", "DELCONSUMER", k.ctl(0), "rank0", "c"),
        ("XGROUP", "DESTROY", k.ctl(1), "rank1"),
        ("XTRIM", k.dlq, "MAXLEN", "~", "100"),
        ("SCAN", "0", "MATCH", f"{k.prefix}*", "COUNT", "1000"),
        ("SET", k.store("s/k:z"), "1"),
        ("HGETALL", k.meta),
        ("INFO", "memory"),
        ("UNLINK", k.join),
        ("DEL", k.up(1), k.ctl(1)),
    ]


def coordinator_may_not(k: RunKeys) -> list[Cmd]:
    return [
        ("SET", "not-flodl", "x"),
        ("GET", "flodl-secret:{other}"),
        ("CONFIG", "GET", "*"),
        ("CONFIG", "SET", "appendonly", "no"),
        ("FLUSHDB",),
        ("FLUSHALL",),
        ("KEYS", "*"),
        ("EVAL", "return 1", "0"),
        ("FUNCTION", "FLUSH"),
        ("SCRIPT", "FLUSH"),
        ("PUBLISH", "ch", "m"),
        ("CLIENT", "LIST"),
        ("CLIENT", "KILL", "TYPE", "normal"),
        ("ACL", "LIST"),
        ("ACL", "SETUSER", "x"),
        ("MONITOR",),
        ("SHUTDOWN",),
        ("SLAVEOF", "NO", "ONE"),
        ("SORT", k.up(0)),
        ("RESTORE", k.up(9), "0", "x"),
        ("MIGRATE", "127.0.0.1", "1", k.up(0), "0", "1"),
    ]


def _id(cmd: Cmd) -> str:
    short = [A.short(a) if isinstance(a, str) else str(a) for a in cmd[:3]]
    return " ".join(short)[:48]


def _raw(client: redis.Redis) -> redis.Redis:
    """The same connections, replies unparsed (redis-py's parsers expect its own forms)."""
    raw = redis.Redis(connection_pool=client.connection_pool)
    raw.response_callbacks.clear()
    return raw


def _run_all(client: redis.Redis, cmds: list[Cmd]) -> list[str]:
    """Run each command in order; the ones that failed (refused or otherwise)."""
    failed = []
    client = _raw(client)
    for cmd in cmds:
        try:
            client.execute_command(*cmd)  # type: ignore[no-untyped-call]
        except redis.exceptions.ResponseError as exc:
            failed.append(f"{' '.join(map(str, cmd))}: {exc}")
    return failed


def _assert_refused(client: redis.Redis, cmds: list[Cmd]) -> None:
    allowed = []
    client = _raw(client)
    for cmd in cmds:
        try:
            client.execute_command(*cmd)  # type: ignore[no-untyped-call]
        except redis.exceptions.NoPermissionError:
            continue
        except redis.exceptions.ResponseError as exc:
            if "NOPERM" in str(exc):
                continue
            allowed.append(f"{' '.join(map(str, cmd))} (ran, then failed: {exc})")
        else:
            allowed.append(" ".join(map(str, cmd)))
    assert not allowed, "allowed, should be refused with NOPERM:\n" + "\n".join(allowed)


# ------------------------------------------------------------------------- worker


def test_worker_may_run_every_command_a_rank_issues_on_its_run(worker: redis.Redis) -> None:
    assert _run_all(worker, worker_may(A)) == []


def test_worker_batches_upstream_in_a_watch_multi_exec_transaction(worker: redis.Redis) -> None:
    with worker.pipeline(transaction=True) as pipe:
        pipe.watch(A.up(0))  # type: ignore[no-untyped-call]
        pipe.xinfo_stream(A.up(0))
        pipe.multi()
        pipe.xadd(A.up(0), {"type": "Batch"}, id="3-1", maxlen=100, approximate=True)
        pipe.xadd(A.up(0), {"type": "Batch"}, id="3-2", maxlen=100, approximate=True)
        pipe.execute()
    assert [e[0] for e in worker.xrange(A.up(0), "3-1", "3-2")] == [b"3-1", b"3-2"]


def test_worker_cannot_slip_a_refused_command_into_a_transaction(
    worker: redis.Redis, env: Acl
) -> None:
    with worker.pipeline(transaction=True) as pipe:
        pipe.xadd(A.up(0), {"type": "Batch"}, id="4-1")
        pipe.delete(A.meta)
        with pytest.raises(redis.exceptions.NoPermissionError):
            pipe.execute()
    assert env.admin.exists(A.meta) and not env.admin.xrange(A.up(0), "4-1", "4-1")


def test_worker_runs_the_rendezvous_store(worker: redis.Redis) -> None:
    """Every ``torch.distributed.Store`` method of ``bus/store.py`` as the worker."""
    store = RedisStore(worker, A.store("sess1/"), timeout=2.0)
    store.set("addr", b"10.0.0.1:29500")
    assert store.get("addr") == b"10.0.0.1:29500"
    assert store.add("count", 2) == 2 and store.add("count", 1) == 3
    assert store.compare_set("cas", "", "v1") == b"v1"
    assert store.compare_set("cas", "v1", "v2") == b"v2"
    assert store.compare_set("cas", "nope", "v3") == b"v2"
    store.append("log", b"a")
    store.append("log", b"b")
    store.multi_set(["m1", "m2"], [b"1", b"2"])
    assert store.multi_get(["m1", "m2"]) == [b"1", b"2"]
    store.wait(["addr", "m1"])
    assert store.check(["addr", "log"]) and not store.check(["absent"])
    assert store.num_keys() == 6
    assert store.list_keys() == ["addr", "cas", "count", "log", "m1", "m2"]
    assert store.delete_key("m2") and store.num_keys() == 5
    assert store.clear() == 5


@pytest.mark.parametrize("cmd", worker_may_not(A), ids=_id)
def test_worker_is_refused(worker: redis.Redis, cmd: Cmd) -> None:
    _assert_refused(worker, [cmd])


def test_worker_cannot_touch_another_runs_keys(worker: redis.Redis, env: Acl) -> None:
    _assert_refused(worker, _keyed(worker_may(B)))
    _assert_refused(worker, [("GET", B.secret)])
    assert env.admin.xlen(B.up(0)) == 1 and env.admin.get(B.store("s/k:x")) == b"1"


# ----------------------------------------------------------------------- observer


def test_observer_may_read_streams_groups_and_meta(observer: redis.Redis) -> None:
    assert _run_all(observer, observer_may(A)) == []


def test_observer_tails_a_run_with_flodl_bus_tail(
    env: Acl, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from flodl_bus.bus import tail

    for key, value in env.envs[(A.run, "observer")].items():
        monkeypatch.setenv(key, value)
    argv = ["--run", A.run, "--redis-url", env.url, "--from-start", "--count", "4"]
    assert tail.main([*argv, "--duration", "5"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 4 and "Seed" in out, out + err


@pytest.mark.parametrize("cmd", observer_may_not(A), ids=_id)
def test_observer_is_refused(observer: redis.Redis, cmd: Cmd) -> None:
    _assert_refused(observer, [cmd])


def test_observer_cannot_read_another_run(observer: redis.Redis) -> None:
    _assert_refused(observer, _keyed(observer_may(B)))


# -------------------------------------------------------------------- coordinator


def test_coordinator_may_do_everything_on_its_run(coordinator: redis.Redis) -> None:
    assert _run_all(coordinator, coordinator_may(A)) == []


def test_coordinator_resets_its_run_and_nothing_else(coordinator: redis.Redis, env: Acl) -> None:
    from flodl_bus.coordinator.cli import _reset_run

    assert _reset_run(coordinator, A) > 0
    assert env.admin.keys(f"{A.prefix}*") == [] and not env.admin.exists(A.secret)
    assert env.admin.exists(B.meta, B.secret, B.up(0)) == 3


def test_coordinator_publishes_its_identity_in_a_transaction(
    coordinator: redis.Redis, env: Acl
) -> None:
    with coordinator.pipeline(transaction=True) as pipe:
        pipe.delete(A.identity)
        pipe.hset(A.identity, mapping={"sign": "cd" * 32, "check": "ef"})
        pipe.execute()
    assert env.admin.hgetall(A.identity) == {b"sign": b"cd" * 32, b"check": b"ef"}


def test_coordinator_creates_the_run_secret(coordinator: redis.Redis, env: Acl) -> None:
    from flodl_bus.bus.run_secret import ensure_run_secret

    env.admin.delete(A.secret)
    secret = ensure_run_secret(coordinator, A, env={})
    assert env.admin.get(A.secret) == secret.hex().encode()


@pytest.mark.parametrize("cmd", coordinator_may_not(A), ids=_id)
def test_coordinator_is_refused(coordinator: redis.Redis, cmd: Cmd) -> None:
    _assert_refused(coordinator, [cmd])


def test_coordinator_cannot_touch_another_run(coordinator: redis.Redis, env: Acl) -> None:
    _assert_refused(coordinator, _keyed(coordinator_may(B)))
    _assert_refused(coordinator, [("GET", B.secret), ("SET", B.secret, "x"), ("DEL", B.meta)])
    assert env.admin.exists(B.meta, B.secret, B.identity) == 3


# ---------------------------------------------------------------------- the command


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = acl.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_env_files_are_private_and_hold_what_each_role_needs(
    acl_env: Acl, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _cli(
        capsys, "create", "envs", "--redis-url", acl_env.url, "--env-dir", str(tmp_path)
    )
    assert code == 0 and "PASSWORD" not in out
    envs = {role: _env_file(tmp_path / f"{role}.env") for role in acl.ROLES}
    for role, e in envs.items():
        assert stat.S_IMODE(os.stat(tmp_path / f"{role}.env").st_mode) == 0o600
        assert e["FLODL_RUN"] == "envs" and e["FLODL_REDIS_USERNAME"] == f"flodl-envs-{role}"
        assert len(e["FLODL_REDIS_PASSWORD"]) == 64
    assert envs["coordinator"]["FLODL_RUN_SECRET"] == envs["worker"]["FLODL_RUN_SECRET"]
    assert "FLODL_RUN_SECRET" not in envs["observer"]
    assert len({e["FLODL_REDIS_PASSWORD"] for e in envs.values()}) == 3
    assert acl.main(["drop", "envs", "--redis-url", acl_env.url]) == 0


def test_create_prints_the_env_of_each_role(
    acl_env: Acl, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _cli(capsys, "create", "printed", "--redis-url", acl_env.url)
    assert code == 0
    assert out.count("FLODL_REDIS_PASSWORD=") == 3 and out.count("FLODL_RUN_SECRET=") == 2
    assert "# worker\nFLODL_RUN=printed\nFLODL_REDIS_USERNAME=flodl-printed-worker\n" in out
    assert acl.main(["drop", "printed", "--redis-url", acl_env.url]) == 0


def test_create_refuses_existing_users_and_replace_rotates_their_passwords(
    acl_env: Acl, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = acl_env.url
    assert (
        _cli(capsys, "create", "rot", "--redis-url", url, "--env-dir", str(tmp_path / "1"))[0] == 0
    )
    old = _env_file(tmp_path / "1" / "worker.env")
    client = connect(url, env=old)
    assert client.ping()
    code, _, err = _cli(capsys, "create", "rot", "--redis-url", url)
    assert code == 2
    assert err.startswith("flodl-bus acl: ACL user flodl-rot-") and "--replace" in err
    code, _, _ = _cli(
        capsys, "create", "rot", "--redis-url", url, "--replace", "--env-dir", str(tmp_path / "2")
    )
    assert code == 0
    new = _env_file(tmp_path / "2" / "worker.env")
    assert new["FLODL_REDIS_PASSWORD"] != old["FLODL_REDIS_PASSWORD"]
    with pytest.raises(redis.exceptions.ConnectionError):  # dropped with its old user
        client.ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        connect(url, env=old).ping()
    assert connect(url, env=new).ping()
    assert acl.main(["drop", "rot", "--redis-url", url]) == 0


def test_drop_deletes_the_users_and_disconnects_their_clients(
    acl_env: Acl, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = acl_env.url
    assert acl.main(["create", "gone", "--redis-url", url, "--env-dir", str(tmp_path)]) == 0
    worker = connect(url, env=_env_file(tmp_path / "worker.env"))
    assert worker.ping()
    code, out, _ = _cli(capsys, "drop", "gone", "--redis-url", url)
    assert code == 0 and "dropped 3 ACL user(s)" in out
    with pytest.raises(redis.exceptions.ConnectionError):
        worker.ping()
    assert _cli(capsys, "drop", "gone", "--redis-url", url)[1].startswith("run gone: dropped 0")


def test_a_user_without_acl_rights_gets_one_line(
    acl_env: Acl, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in acl_env.envs[(A.run, "coordinator")].items():
        monkeypatch.setenv(key, value)
    code, out, err = _cli(capsys, "create", "nope", "--redis-url", acl_env.url)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "may not read ACL users" in err and "no permissions" in err
    code, _, err = _cli(capsys, "drop", A.run, "--redis-url", acl_env.url)
    assert code == 2 and "may not delete ACL users" in err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["create", "bad}id", "--print-only"], "invalid run id 'bad}id'"),
        (["drop", "a:b"], "invalid run id 'a:b'"),
        (["create", "r", "--redis-url", "redis://127.0.0.1:1/0"], "cannot reach Redis"),
        (["create", "r", "--redis-url", "http://x"], "unsupported Redis URL scheme"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _cli(capsys, *argv)
    assert code == 2 and err.startswith("flodl-bus acl: ") and says in err
    assert err.count("\n") == 1


def test_save_on_a_server_without_aclfile_says_so(
    acl_env: Acl, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _cli(capsys, "drop", "unsaved", "--redis-url", acl_env.url, "--save")
    assert code == 2 and "has no aclfile" in err


def test_print_only_lines_load_as_an_aclfile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _cli(capsys, "create", "filed", "--print-only", "--env-dir", str(tmp_path))
    assert code == 0 and all(line.startswith("user flodl-filed-") for line in out.splitlines())
    aclfile = tmp_path / "users.acl"
    aclfile.write_text("user default off\n" + out)
    keys = RunKeys("filed")
    with RedisServer(extra_args=["--aclfile", str(aclfile)]) as server:
        coord = connect(server.url, env=_env_file(tmp_path / "coordinator.env"))
        worker = connect(server.url, env=_env_file(tmp_path / "worker.env"))
        coord.xadd(keys.ctl(0), {"type": "StartEpoch"})
        assert worker.xread({keys.ctl(0): "0"})
        _assert_refused(
            worker,
            [
                ("XADD", keys.ctl(0), "*", "a", "b"),
                ("GET", keys.secret),
                ("XGROUP", "CREATE", keys.ctl(0), "rank0", "0"),
            ],
        )
        coord.close()
        worker.close()


def test_rules_prints_the_rules_without_passwords(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(capsys, "rules", "r1")
    lines = out.splitlines()
    assert code == 0 and [line.split()[1] for line in lines] == [
        "flodl-r1-coordinator", "flodl-r1-worker", "flodl-r1-observer",
    ]  # fmt: skip
    assert "~flodl:{r1}:ctl:*" in lines[1] and "%R~flodl:{r1}:*" in lines[2]


def test_flodl_bus_acl_is_a_subcommand() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "flodl_bus.cli", "acl", "rules", "x"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0 and "user flodl-x-worker on" in out.stdout


# ----------------------------------------------------------------- ops/users.acl


def test_ops_users_acl_holds_the_static_rules() -> None:
    """The shipped file is ``role_rules(None, ...)``: global users, same command sets."""
    lines = (ROOT / "ops" / "users.acl").read_text().splitlines()
    assert lines[0] == "user default off"
    for line, role in zip(lines[1:], acl.ROLES, strict=True):
        _, name, on, hashed, rules = line.split(" ", 4)
        assert (name, on, hashed[0]) == (role, "on", "#")
        assert rules == " ".join(acl.role_rules(None, role, worker_reads_secret=role == "worker"))


def test_static_users_of_ops_are_held_too() -> None:
    with RedisServer(extra_args=["--aclfile", str(ROOT / "ops" / "users.acl")]) as server:
        port = server.port
        coord = redis.Redis(port=port, username="coordinator", password="flodl-coordinator-dev")
        worker = redis.Redis(port=port, username="worker", password="flodl-worker-dev")
        observer = redis.Redis(port=port, username="observer", password="flodl-observer-dev")
        _seed(coord, A)
        assert _run_all(worker, worker_may(A)) == []
        assert worker.get(A.secret) == b"11" * 16  # the development convenience (README)
        # Everything else a worker may not do stays refused, the secret read aside.
        _assert_refused(worker, [c for c in worker_may_not(A) if c[:2] != ("GET", A.secret)])
        assert _run_all(observer, observer_may(A)) == []
        _assert_refused(observer, observer_may_not(A))
        # The static coordinator is every run's: only the other-run secret read is allowed.
        _assert_refused(coord, [c for c in coordinator_may_not(A) if "{other}" not in c[-1]])
        for c in (coord, worker, observer):
            c.close()


# ------------------------------------------------------------------- a live run


@pytest.mark.slow
def test_a_run_trains_with_per_run_users_only(acl_env: Acl, tmp_path: Path) -> None:
    """The real processes, each with only its role's env from ``flodl-bus acl create``:
    the coordinator and two dial-in workers finish the run with exit 0."""
    run = "acl-live"
    assert acl.main(["create", run, "--redis-url", acl_env.url, "--env-dir", str(tmp_path)]) == 0
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_")}
    base.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", FLODL_REDIS_URL=acl_env.url)

    def start(name: str, role: str, *args: str) -> subprocess.Popen[bytes]:
        env = {**base, **_env_file(tmp_path / f"{role}.env")}
        log = (tmp_path / f"{name}.log").open("wb")
        return subprocess.Popen(
            [sys.executable, "-m", "flodl_bus.cli", role, "--run", run, *args],
            env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    run_dir = str(tmp_path / "runs")
    procs = [
        start("coordinator", "coordinator", "--job", "flodl_bus.examples.digits:job",
              "--world-size", "2", "--epochs", "1", "--run-dir", run_dir),
    ]  # fmt: skip
    procs += [start(f"w{i}", "worker", "--run-dir", run_dir) for i in range(2)]
    deadline = time.monotonic() + 240
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    logs = "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in tmp_path.glob("*.log"))
    assert [p.returncode for p in procs] == [0, 0, 0], logs
    assert "NOPERM" not in logs and "no permissions" not in logs, logs
    assert acl.main(["drop", run, "--redis-url", acl_env.url]) == 0
