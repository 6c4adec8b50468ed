"""``flodl-bus tail`` and ``ops/tail.sh`` print every entry, one line each."""

from __future__ import annotations

import io
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.run_secret import publish_identity
from flodl_bus.bus.streams import RedisCoordinatorBus, RedisRankBus
from flodl_bus.bus.tail import main, tail
from flodl_bus.protocol import messages as m
from flodl_bus.protocol.signing import CoordinatorIdentity, CoordinatorKeys, new_secret
from tests.bus.conftest import CK, FAST, RK, Backend

ROOT = Path(__file__).resolve().parents[2]


def _batch(i: int) -> m.Batch:
    return m.Batch(rank=0, batch_ms=1.0, data_ms=0.1, step_count=i, batch_loss=0.5)


def test_tail_prints_every_entry_of_a_10000_entry_burst(backend: Backend) -> None:
    keys = RunKeys("burst")
    coord = RedisCoordinatorBus(backend.make(), keys, CK, ranks=[0, 1], config=FAST)
    rank = RedisRankBus(backend.make(), keys, 0, RK(0), config=FAST)
    out = io.StringIO()
    printed: list[int] = []
    t = threading.Thread(
        target=lambda: printed.append(
            tail(
                backend.make(),
                keys.run,
                count=10_000,
                out=out,
                broadcast_key=CK.signing.public,
                duration=60,
            )
        )
    )
    t.start()
    time.sleep(0.3)  # the tail's first scan finds ctl:* already there, starts at their top
    for i in range(4000):
        rank.publish(_batch(i))
    for i in range(6000):
        msg = m.SetGlobalStep(global_step=i)
        coord.broadcast(msg) if i % 3 == 0 else coord.send(i % 2, msg)
    assert rank.flush(30)
    t.join(60)
    assert printed == [10_000]
    lines = out.getvalue().splitlines()
    assert len(lines) == 10_000
    seen = {(line.split()[1], line.split()[2]) for line in lines}
    written = {
        (keys.short(s), eid.decode())
        for s in (keys.ctl(0), keys.ctl(1), keys.ctl_all, keys.up(0))
        for eid, _ in backend.admin.xrange(s)
    }
    assert seen == written
    assert "[BAD SIGNATURE]" not in out.getvalue()
    assert sum("SetGlobalStep" in line for line in lines) == 6000
    assert '{"global_step":5999}' in out.getvalue()
    rank.close()
    coord.close()


@pytest.mark.redis
def test_tail_main_decodes_from_the_start_and_exits_after_count(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from flodl_bus.bus.connection import connect

    admin = connect(redis_url)
    admin.flushdb()
    ident = CoordinatorIdentity.generate()
    publish_identity(admin, RunKeys("cli"), ident, new_secret())
    keys = CoordinatorKeys(ident.signing, {0: CK.rank(0)})
    coord = RedisCoordinatorBus(connect(redis_url), "cli", keys, ranks=[0], config=FAST)
    coord.send(0, m.StartEpoch(plan=m.EpochPlan(epoch=2, partition_offset=0, partition_size=9)))
    coord.broadcast(m.Shutdown())
    # tail checks the broadcast with the public key from the run's identity
    rc = main(["--run", "cli", "--redis-url", redis_url, "--from-start", "--count", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert not any("BAD SIGNATURE" in line for line in lines)
    assert rc == 0
    assert len(lines) == 2
    assert "ctl:0" in lines[0] and "StartEpoch" in lines[0] and '"epoch":2' in lines[0]
    assert "ctl:all" in lines[1] and "Shutdown" in lines[1]
    assert main(["--run", "bad{run}", "--redis-url", redis_url]) == 2
    coord.close()
    admin.close()


@pytest.mark.redis
def test_ops_tail_script_prints_every_entry_with_plain_fields(redis_url: str) -> None:
    from flodl_bus.bus.connection import connect

    admin = connect(redis_url)
    admin.flushdb()
    coord = RedisCoordinatorBus(connect(redis_url), "sh", CK, ranks=[0, 1], config=FAST)
    for i in range(1200):  # more than one 500-entry page per stream
        coord.send(i % 2, m.SetGlobalStep(global_step=i))
    coord.broadcast(m.Shutdown())
    done = subprocess.run(
        ["bash", str(ROOT / "ops" / "tail.sh"), "sh"],
        env={**os.environ, "REDIS_URL": redis_url, "TAIL_ROUNDS": "1", "TAIL_FROM_START": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1201
    assert sum(line.startswith("ctl:0 ") for line in lines) == 600
    assert any(line.startswith("ctl:all ") and "type=Shutdown" in line for line in lines)
    assert all("rank=" in line and "seq=" in line for line in lines)
    coord.close()
    admin.close()


@pytest.mark.redis
def test_tail_of_a_run_that_does_not_exist_is_an_error(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--run", "never-ran", "--redis-url", redis_url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no run 'never-ran'" in err, err


@pytest.mark.redis
def test_tail_ends_after_shutdown_with_the_ranks_last_words_unless_follow(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from flodl_bus.bus.connection import connect

    keys = RunKeys("ends")
    admin = connect(redis_url)
    admin.delete(*admin.keys(f"{keys.prefix}*") or [keys.meta])
    coord = RedisCoordinatorBus(connect(redis_url), keys, CK, ranks=[0], config=FAST)
    rank = RedisRankBus(connect(redis_url), keys, 0, RK(0), config=FAST)
    rank.publish(_batch(1))
    coord.broadcast(m.Shutdown())
    rank.publish(m.Exiting(rank=0, reason=None))
    deadline = time.monotonic() + 30
    while admin.xlen(keys.up(0)) < 2 and time.monotonic() < deadline:  # the rank's writes landed
        time.sleep(0.01)
    # no --count, no --duration: it returns by itself, having printed the Exiting too
    assert main(["--run", "ends", "--redis-url", redis_url, "--from-start"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sorted(line.split()[3] for line in lines) == ["Batch", "Exiting", "Shutdown"], lines

    # --follow: an entry written after the Shutdown was printed still comes
    out = io.StringIO()
    done: list[int] = []
    t = threading.Thread(
        target=lambda: done.append(
            tail(
                connect(redis_url),
                "ends",
                from_start=True,
                count=4,
                out=out,
                follow=True,
                duration=60,
            )
        )
    )
    t.start()
    deadline = time.monotonic() + 30
    while "Exiting" not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)
    rank.publish(_batch(2))
    t.join(timeout=60)
    assert done == [4], out.getvalue()
    coord.close()
    rank.close()
    admin.close()


@pytest.mark.redis
def test_a_foreign_largest_id_is_shown_once_and_never_hides_what_the_run_writes_after(
    redis_url: str,
) -> None:
    import redis as redis_py

    from flodl_bus.bus import entries
    from flodl_bus.bus.foreign import repair_stream
    from flodl_bus.bus.ids import parse_id

    client = redis_py.Redis.from_url(redis_url)
    keys = RunKeys("tail-far")
    stream = keys.up(0)

    def genuine(eid: str, step: int) -> None:
        fields = entries.build(CK.rank(0), stream, eid, _batch(step), "0", step)
        client.xadd(stream, fields, id=eid)  # type: ignore[arg-type]

    genuine("5-1", 1)
    client.xadd(stream, {b"type": b"Batch"}, id="18446744073709551615-18446744073709551615")
    out = io.StringIO()
    printed: list[int] = []
    t = threading.Thread(
        target=lambda: printed.append(
            tail(client, keys.run, rank=0, from_start=True, count=3, out=out, duration=60)
        )
    )
    t.start()
    deadline = time.monotonic() + 30
    while "FOREIGN" not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.02)
    now_ms = int(time.time() * 1000)
    assert repair_stream(client, stream, keys.dlq, floor=parse_id("5-1"), now_ms=now_ms, by="t")
    genuine(f"{now_ms}-0", 2)
    t.join(30)
    assert printed == [3], out.getvalue()
    lines = out.getvalue().splitlines()
    assert "step_count" in lines[0] and '"step_count":1' in lines[0]
    assert "??:??:??.???" in lines[1] and "FOREIGN" in lines[1]
    assert '"step_count":2' in lines[2]
    client.close()
