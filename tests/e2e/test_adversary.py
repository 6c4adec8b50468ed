"""A live run attacked through every stream it uses, with per-run ACL users.

Two attackers write while the run trains:
- one holding what a worker holds (the worker user of the run, the run secret): junk,
  oversized, unknown-type and forged entries into ``up:*`` and ``join``, through
  redis-py and through raw RESP on a socket; a future id and the largest id; valid
  entries copied under new ids; and every command its ACL must refuse;
- the run's observer user: every script and write refused (a busy script stalled the
  coordinator before), reads allowed; and a flood of Hellos over the join size cap,
  MACed with the run secret;
- one holding more (the server's default user, standing for a leaked admin or coordinator
  credential, but not the coordinator's keys): the same into ``ctl:*`` and ``ctl:all``,
  plus a rank's group destroyed, delivered entries trimmed and deleted, meta deleted.

The run must finish with every process exiting 0, every sample of every epoch trained
exactly once (from the ranks' own metrics and from the plans in the coordinator's
record), and every bad entry a reader could see in the dlq with its reason.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from flodl_bus.bus import acl, entries
from flodl_bus.bus.connection import connect
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.server import RedisServer
from flodl_bus.examples import digits
from flodl_bus.protocol import messages as m
from flodl_bus.protocol.signing import MacKey, fixed_keys
from tests.e2e.harness import (
    SLOW,
    Cluster,
    epoch_samples,
    metrics_rows,
    new_run_id,
    records,
    sent_plans,
    tiles,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.redis]

WORLD = 2
EPOCHS = 4
MAX_ID = "18446744073709551615-18446744073709551615"
#: junk entries per stream; a few thousand in all (``bench`` territory beyond that)
JUNK = 300


@pytest.fixture
def server() -> Iterator[RedisServer]:
    srv = RedisServer().start()
    try:
        yield srv
    finally:
        srv.cleanup()


def _now_ms() -> int:
    return int(time.time() * 1000)


def _resp(*args: bytes) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


class Ledger:
    """Every entry an attacker put where a reader of the run will see it."""

    def __init__(self) -> None:
        self.entries: set[tuple[str, str]] = set()

    def add(self, stream: str, eid: bytes | str) -> None:
        self.entries.add((stream, eid.decode() if isinstance(eid, bytes) else eid))


def _junk_kinds(stream: str, rank: str) -> list[dict[bytes, bytes]]:
    wrong_key = fixed_keys(b"not this run")
    signed = entries.build(wrong_key.rank(0), stream, "1-1", m.SyncNow(), rank, 10**9)
    return [
        {b"junk": b"x"},
        {b"type": b"Batch", b"body": b"\xc1" * 8},
        {**signed, b"body": b"\x00" * (entries.MAX_BODY_BYTES + 1)},
        {**signed, b"type": b"Frobnicate"},
        signed,  # signed with another run's keys
        {b"type": b"\xff\xfe", b"rank": b"\x00", b"seq": b"-1", b"body": b"", b"mac": b"?"},
    ]


def _flood(client: redis.Redis, stream: str, rank: str, ledger: Ledger) -> None:
    kinds = _junk_kinds(stream, rank)
    pipe = client.pipeline(transaction=False)
    for i in range(JUNK):
        pipe.xadd(stream, kinds[i % len(kinds)])  # type: ignore[arg-type]
    for eid in pipe.execute():
        ledger.add(stream, eid)


def _copy_last(client: redis.Redis, admin: redis.Redis, stream: str, ledger: Ledger) -> None:
    """The newest valid entry of ``stream``, added again under a new id."""
    found = admin.xrevrange(stream, "+", "-", count=1)
    assert found, f"nothing to replay in {stream}"
    ledger.add(stream, client.xadd(stream, found[0][1]))  # type: ignore[arg-type]


def _raw_resp(url: str, user: str, password: str, stream: str, ledger: Ledger) -> None:
    """Binary junk over a socket of our own, as any RESP client could send it."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        cmds = [_resp(b"AUTH", user.encode(), password.encode())]
        cmds += [
            _resp(b"XADD", stream.encode(), b"*", b"\x00\xff" * i, b"\r\n$-1\r\n" * i)
            for i in range(1, 21)
        ]
        sock.sendall(b"".join(cmds))
        buf = b""
        while buf.count(b"\r\n") < 21:
            chunk = sock.recv(65536)
            assert chunk, "server closed the socket"
            buf += chunk
    assert buf.startswith(b"+OK\r\n"), buf[:80]
    # the ids: every entry of the stream with a binary field name is ours
    admin = redis.Redis.from_url(url)
    for eid, fields in admin.xrange(stream):
        if any(k.startswith(b"\x00\xff") for k in fields):
            ledger.add(stream, eid)
    admin.close()


def _refused(client: redis.Redis, k: RunKeys) -> None:
    """What the worker credential must not do, each refused by the server."""
    attempts = [
        lambda: client.xadd(k.ctl(0), {"type": "Shutdown"}),
        lambda: client.xadd(k.ctl_all, {"type": "Shutdown"}),
        lambda: client.delete(k.up(0)),
        lambda: client.xtrim(k.ctl(0), maxlen=0),
        lambda: client.xgroup_destroy(k.ctl(0), "rank0"),
        # a rank's control cannot be taken: no consumer group on ctl:* at all
        lambda: client.xgroup_create(k.ctl(0), "rank0", id="0"),
        lambda: client.xreadgroup("rank0", "thief", {k.ctl(0): ">"}),
        lambda: client.get(k.secret),
        lambda: client.hset(k.identity, "sign_pub", "00"),
        lambda: client.config_get("*"),
        lambda: client.xadd(RunKeys("another-run").up(0), {"x": "1"}),
    ]
    for attempt in attempts:
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()


def _as_worker(url: str, creds: acl.RunCredentials, k: RunKeys, ledger: Ledger) -> None:
    env = creds.env("worker")
    client = connect(url, env=env, client_name="attacker-worker")
    admin = connect(url)
    _refused(client, k)
    for r in range(WORLD):
        _copy_last(client, admin, k.up(r), ledger)  # first: the newest entry is a real one
        _flood(client, k.up(r), str(r), ledger)
    _flood(client, k.join, "join", ledger)
    _raw_resp(url, env["FLODL_REDIS_USERNAME"], env["FLODL_REDIS_PASSWORD"], k.up(1), ledger)
    # a Batch MACed with the run secret: the member key, never a rank's
    forged = entries.build(MacKey(bytes.fromhex(creds.run_secret)), k.up(0), "1-1",
                           m.Batch(0, 1.0, 0.1, 99, 0.5), "0", 10**9)  # fmt: skip
    ledger.add(k.up(0), client.xadd(k.up(0), forged))  # type: ignore[arg-type]
    ahead = f"{_now_ms() + 5000}-0"
    ledger.add(k.up(0), client.xadd(k.up(0), {"junk": "ahead"}, id=ahead))
    ledger.add(k.up(1), client.xadd(k.up(1), {"junk": "largest"}, id=MAX_ID))
    client.close()
    admin.close()


def _giant_hellos(url: str, creds: acl.RunCredentials, k: RunKeys, ledger: Ledger) -> None:
    """Hellos over the join size cap, MACed with the run secret (what a worker holds):
    each refused by its size before its MAC or body is read; the loop never stalls."""
    from flodl_bus.bus.join import JoinStream
    from flodl_bus.protocol.messages import Hello

    client = connect(url, env=creds.env("worker"), client_name="attacker-hellos")
    flooder = JoinStream(client, k, bytes.fromhex(creds.run_secret))
    big = "x" * (64 * 1024)
    for i in range(20):
        ledger.add(k.join, flooder.post(Hello(f"flood{i}", big, "sig")))
    client.close()


def _as_observer(url: str, creds: acl.RunCredentials, k: RunKeys) -> None:
    """The read-only observer cannot run a script (a busy one made the coordinator's
    ping fail with BUSY) nor write anything."""
    client = connect(url, env=creds.env("observer"), client_name="attacker-observer")
    attempts = [
        lambda: client.eval_ro("while true do end", 0),
        lambda: client.eval("return 1", 0),
        lambda: client.script_load("return 1"),
        lambda: client.fcall_ro("f", 0),
        lambda: client.xadd(k.up(0), {"x": "1"}),
        lambda: client.hset(k.meta, "status", "finished"),
    ]
    for attempt in attempts:
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    assert client.hget(k.meta, "status") is not None  # what it may do: read
    client.close()


def _as_admin(url: str, k: RunKeys, ledger: Ledger) -> None:
    admin = connect(url)
    for r in range(WORLD):
        _copy_last(admin, admin, k.ctl(r), ledger)
        _flood(admin, k.ctl(r), str(r), ledger)
    _copy_last(admin, admin, k.ctl_all, ledger)
    _flood(admin, k.ctl_all, "all", ledger)
    ledger.add(k.ctl(0), admin.xadd(k.ctl(0), {"junk": "ahead"}, id=f"{_now_ms() + 5000}-0"))
    ledger.add(k.ctl_all, admin.xadd(k.ctl_all, {"junk": "largest"}, id=MAX_ID))
    # what only a coordinator-level credential can do: drain a consumer group made on a
    # rank's control (a rank has none: it reads with XREAD and loses nothing), and trim
    # entries the coordinator's group was already handed
    admin.xgroup_create(k.ctl(1), "rank1", id="0")
    admin.xreadgroup("rank1", "thief", {k.ctl(1): ">"}, count=10_000)
    for stream, group in ((k.up(0), "coordinator"),):
        delivered = next(
            g["last-delivered-id"]
            for g in admin.xinfo_groups(stream)
            if g["name"] == group.encode()
        )
        first = admin.xrange(stream, count=1)
        if first and first[0][0] < delivered:
            admin.xdel(stream, first[0][0])
        admin.xtrim(stream, minid=delivered, approximate=False)
    admin.delete(k.meta)
    admin.close()


def test_a_run_attacked_through_every_stream_trains_every_sample_exactly_once(
    server: RedisServer, tmp_path: Path
) -> None:
    admin = connect(server.url)
    run = new_run_id("attack")
    k = RunKeys(run)
    creds = acl.create(admin, run)
    cluster = Cluster(server.url, tmp_path)
    try:
        coord = cluster.coordinator(
            run,
            "--mode",
            "cpu-cadence",
            "--world-size",
            str(WORLD),
            "--epochs",
            str(EPOCHS),
            job=SLOW,
            env=creds.env("coordinator"),
        )
        workers = [
            cluster.worker(run, f"w{i}", "--mode", "cpu-cadence", env=creds.env("worker"))
            for i in range(WORLD)
        ]
        run_dir = cluster.run_dir(run)
        wait_for(lambda: len(metrics_rows(run_dir)) >= 1, 120, "the first epoch", cluster)
        ledger = Ledger()
        _as_observer(server.url, creds, k)
        _as_worker(server.url, creds, k, ledger)
        _giant_hellos(server.url, creds, k, ledger)
        _as_admin(server.url, k, ledger)
        codes = cluster.wait([coord, *workers], timeout=240)
        assert codes == [0] * (WORLD + 1), cluster.tails()
    finally:
        cluster.kill_all()

    # every sample of every epoch trained exactly once: by the ranks' own counts ...
    total = (len(digits.job.train_data()) // digits.job.batch_size) * digits.job.batch_size
    rows = metrics_rows(run_dir)
    assert [int(r["epoch"]) for r in rows] == list(range(EPOCHS))
    for row in rows:
        assert sum(epoch_samples(row, WORLD)) == total, row
    # ... and by the plans the coordinator sent (nothing planned twice)
    plans = sent_plans(records(run_dir))
    for epoch in range(EPOCHS):
        ranges = [rg for rank_ranges in plans[epoch].values() for rg in rank_ranges]
        assert tiles(ranges, [(0, total)]), (epoch, plans[epoch])

    # every bad entry a reader could see is in the dlq, with a reason (an entry may be
    # there twice: read and refused by a rank, and removed by the coordinator)
    dead: dict[tuple[str, str], list[str]] = {}
    for _, f in admin.xrange(k.dlq):
        dead.setdefault((f[b"stream"].decode(), f[b"entry"].decode()), []).append(
            f[b"reason"].decode()
        )
    missing = sorted(ledger.entries - set(dead))
    assert not missing, f"{len(missing)} of {len(ledger.entries)} not dead-lettered: {missing[:5]}"
    reasons = [dead[e] for e in ledger.entries]
    assert sum(any(r.startswith("replayed") for r in rs) for rs in reasons) >= 2 * WORLD + 1
    assert sum(any(r.startswith("foreign") for r in rs) for rs in reasons) >= 2
    assert all(all(rs) for rs in reasons)
    admin.close()
