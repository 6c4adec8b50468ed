"""The coordinator's upstream read by reader processes (``bus.ingest``, ``--ingest-procs``)
against a real redis-server: per-rank order, exactly once, the dlq, a reader that dies
mid-stream, and one that hangs."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import signal
import threading
import time
from collections.abc import Callable, MutableMapping, Sequence
from multiprocessing.process import BaseProcess
from typing import Any

import pytest
import redis
import structlog

from flodl_bus.bus import entries, ingest
from flodl_bus.bus.api import Delivery, IngestHung
from flodl_bus.bus.connection import connect
from flodl_bus.bus.ids import format_id
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.server import RedisServer
from flodl_bus.bus.stream_ops import StreamsConfig
from flodl_bus.bus.streams import COORDINATOR_GROUP, RedisCoordinatorBus, RedisRankBus
from flodl_bus.protocol import messages as m
from flodl_bus.protocol.signing import fixed_keys
from tests.bus.conftest import CK, FAST, RK

pytestmark = pytest.mark.redis

K = 2


def _batch(rank: int, i: int) -> m.Batch:
    return m.Batch(rank=rank, batch_ms=1.0, data_ms=0.1, step_count=i, batch_loss=0.5)


def _coord(
    url: str,
    keys: RunKeys,
    ranks: Sequence[int],
    ingest_setup: Callable[[], None] | None = None,
    config: StreamsConfig = FAST,
) -> RedisCoordinatorBus:
    coord = RedisCoordinatorBus(
        connect(url),
        keys,
        CK,
        ranks=ranks,
        config=config,
        ingest_procs=K,
        ingest_setup=ingest_setup,
    )
    assert coord.ingest is not None and coord.ingest.wait_ready(60)
    return coord


def _prefill(
    url: str, keys: RunKeys, ranks: Sequence[int], n: int, first: int = 0, after_ms: int = 0
) -> None:
    """``n`` signed Batch entries per rank (steps first..first+n-1), rank-interleaved;
    their ids above ``after_ms`` (entries a test wrote there by hand)."""
    client = connect(url)
    pipe = client.pipeline(transaction=False)
    ms = max(int(time.time() * 1000), after_ms + 1)
    for i in range(first, first + n):
        for r in ranks:
            eid = f"{ms}-{i}"
            f = entries.build(CK.rank(r), keys.up(r), eid, _batch(r, i), str(r), i + 1)
            pipe.xadd(keys.up(r), f, id=eid)  # type: ignore[arg-type]
    pipe.execute()
    client.close()


def _drain(
    coord: RedisCoordinatorBus, n: int, timeout: float = 60.0, on_read: object = None
) -> list[Delivery]:
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        ds = coord.read_upstream(100)
        coord.ack(ds)
        got += ds
        if callable(on_read):
            on_read(got)
    return got


def _steps_by_rank(got: Sequence[Delivery]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in got:
        assert isinstance(d.msg, m.Batch), d
        out.setdefault(d.msg.rank, []).append(d.msg.step_count)
    return out


def _pending(url: str, keys: RunKeys, ranks: Sequence[int]) -> int:
    """Entries delivered to the readers and not yet acked (a stream whose reader has not
    made its group yet holds none)."""
    client = connect(url)
    try:
        total = 0
        for r in ranks:
            try:
                total += int(client.xpending(keys.up(r), COORDINATOR_GROUP)["pending"])
            except redis.exceptions.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
        return total
    finally:
        client.close()


def _pending_until(
    url: str, keys: RunKeys, ranks: Sequence[int], done: Callable[[int], bool], timeout: float
) -> int:
    """The readers' entries read and not yet acked, polled until ``done`` says so or
    ``timeout`` passes (the count then, either way)."""
    deadline = time.monotonic() + timeout
    left = _pending(url, keys, ranks)
    while not done(left) and time.monotonic() < deadline:
        time.sleep(0.01)
        left = _pending(url, keys, ranks)
    return left


def _until_acked(url: str, keys: RunKeys, ranks: Sequence[int], timeout: float = 20.0) -> int:
    """Acks ride on each reader's next read: wait for the last of them."""
    return _pending_until(url, keys, ranks, lambda left: left == 0, timeout)


def _until_read(url: str, keys: RunKeys, ranks: Sequence[int], n: int, why: str) -> None:
    """Wait until the readers hold ``n`` entries read and not yet acked (30 s at most)."""
    assert _pending_until(url, keys, ranks, lambda held: held >= n, 30.0) >= n, why


def test_live_publishers_reach_the_core_once_each_in_order_across_reader_processes(
    url: str,
) -> None:
    keys = RunKeys("ingest-order")
    ranks = range(6)
    n = 400
    coord = _coord(url, keys, ranks)
    buses = [RedisRankBus(connect(url), keys, r, RK(r), config=FAST) for r in ranks]

    def publish(bus: RedisRankBus) -> None:
        for i in range(n):
            bus.publish(_batch(bus.rank, i))

    threads = [threading.Thread(target=publish, args=(b,)) for b in buses]
    for t in threads:
        t.start()
    got = _drain(coord, n * len(ranks))
    for t in threads:
        t.join()
    assert _steps_by_rank(got) == {r: list(range(n)) for r in ranks}
    assert len({(d.stream, d.entry_id) for d in got}) == len(got)
    assert coord.read_upstream(200) == []  # nothing comes twice
    coord.flush_acks()
    assert _until_acked(url, keys, ranks) == 0
    for b in buses:
        assert b.flush(10)
        b.close()
    coord.close()


def test_a_rank_added_later_goes_to_a_reader(url: str) -> None:
    keys = RunKeys("ingest-late")
    coord = _coord(url, keys, [0, 1])
    coord.add_rank(2)
    _prefill(url, keys, [0, 1, 2], 30)
    got = _drain(coord, 90)
    assert _steps_by_rank(got) == {r: list(range(30)) for r in range(3)}
    coord.close()


def test_reader_processes_say_they_are_behind_until_every_entry_was_handed_on(url: str) -> None:
    # The coordinator's liveness asks this: a rank not reached yet is not a silent one.
    keys = RunKeys("ingest-behind")
    ranks = range(4)
    # Written before the readers start: a read racing the writes would rightly say it
    # caught up with what had landed, the backlog being what landed after it.
    _prefill(url, keys, ranks, 150)
    coord = _coord(url, keys, ranks, config=dataclasses.replace(FAST, read_count=4, read_total=8))
    total = 150 * len(ranks)
    reads_behind: list[bool] = []

    def on_read(got: list[Delivery]) -> None:
        if len(got) < total:
            reads_behind.append(coord.behind)

    got = _drain(coord, total, on_read=on_read)
    assert _steps_by_rank(got) == {r: list(range(150)) for r in ranks}
    assert reads_behind and all(reads_behind)
    # caught up: each reader's next read finds nothing left and says so
    deadline = time.monotonic() + 30
    while coord.behind:
        assert time.monotonic() < deadline, "the readers never said they caught up"
        assert coord.read_upstream(100) == []
    coord.close()


def test_one_read_of_the_readers_takes_about_the_read_budget_and_loses_nothing(
    url: str,
) -> None:
    # 4,096 ranks: one read took every pipe's fill, 24,000 entries, and the loop ticked
    # once in 18 s. Each reader now reads read_total / K at a time, and one read takes
    # a reader's share from each before moving on.
    keys = RunKeys("ingest-budget")
    ranks = range(6)
    total = 8
    coord = _coord(url, keys, ranks, config=dataclasses.replace(FAST, read_total=total))
    _prefill(url, keys, ranks, 100)
    # the readers read ahead: wait until their pipes hold a backlog of many reads
    _until_read(url, keys, ranks, 200, "the readers did not read ahead")
    sizes: list[int] = []

    def on_read(got: list[Delivery]) -> None:
        sizes.append(len(got) - sum(sizes))

    got = _drain(coord, 600, on_read=on_read)
    assert _steps_by_rank(got) == {r: list(range(100)) for r in ranks}
    # a reader's blob can pass its share by what one of its streams' count adds
    assert max(sizes) <= 2 * total, sizes
    coord.close()


def test_blobs_left_in_a_pipe_past_a_reads_budget_are_a_backlog(url: str) -> None:
    # Each of these reads caught up with what had landed (no blob says behind), yet the
    # pipe holds more than one read takes: the loop is behind all the same.
    keys = RunKeys("ingest-left")
    ranks = range(K)  # a stream a reader, 4 entries a read, 1 entry a write
    coord = _coord(url, keys, ranks, config=dataclasses.replace(FAST, read_total=4 * K))
    for i in range(10):
        _prefill(url, keys, ranks, 1, first=i)
        _until_read(url, keys, ranks, K * (i + 1), "the readers did not read")  # a blob each
    got = coord.read_upstream(1000)
    assert 0 < len(got) < 10 * K
    assert coord.behind
    got += _drain(coord, 10 * K - len(got))
    assert _steps_by_rank(got) == {r: list(range(10)) for r in ranks}
    coord.close()


def test_a_reader_with_no_streams_is_not_behind(url: str) -> None:
    keys = RunKeys("ingest-idle-reader")
    coord = _coord(url, keys, [0])  # K readers, one stream: the other reader has none
    deadline = time.monotonic() + 30
    while coord.behind:
        assert time.monotonic() < deadline, "an idle reader was taken for behind for ever"
        coord.read_upstream(100)
    coord.close()


def test_heartbeats_read_by_a_reader_still_tell_the_trimmer_where_each_rank_read(
    url: str,
) -> None:
    keys = RunKeys("ingest-heartbeat")
    coord = _coord(url, keys, [0, 1])
    coord.send(1, m.SetGlobalStep(global_step=1))
    coord.broadcast(m.SetGlobalStep(global_step=2))
    rank = RedisRankBus(connect(url), keys, 1, RK(1), config=FAST)
    got: list[Delivery] = []
    deadline = time.monotonic() + 30
    while len(got) < 2 and time.monotonic() < deadline:
        ds = rank.read_control(100)
        rank.ack(ds)
        got += ds
    ctl, bcast = rank.control_read()
    assert ctl is not None and bcast is not None
    rank.publish(m.Heartbeat(rank=1, step_count=0, ctl_read=ctl, all_read=bcast))
    assert [type(d.msg) for d in _drain(coord, 1)] == [m.Heartbeat]
    holds = {h.group: h for h in coord.read_holds()[keys.ctl(1)]}
    assert format_id(holds["rank1"].hold) == ctl
    rank.close()
    coord.close()


def test_forged_and_replayed_entries_of_a_readers_share_go_to_the_dlq_and_the_rest_flow(
    url: str,
) -> None:
    keys = RunKeys("ingest-dlq")
    ranks = [0, 1, 2, 3]
    coord = _coord(url, keys, ranks)
    _prefill(url, keys, ranks, 5)
    assert _steps_by_rank(_drain(coord, 20)) == {r: list(range(5)) for r in ranks}
    admin = connect(url)
    ms = int(time.time() * 1000) + 1
    stream = keys.up(1)  # reader 1's share (ranks go round-robin)
    forged = entries.build(fixed_keys(bytes(32)).rank(1), stream, f"{ms}-0", _batch(1, 5), "1", 6)
    replayed = entries.build(CK.rank(1), stream, f"{ms}-1", _batch(1, 2), "1", 3)
    admin.xadd(stream, forged, id=f"{ms}-0")  # type: ignore[arg-type]
    admin.xadd(stream, replayed, id=f"{ms}-1")  # type: ignore[arg-type]
    _prefill(url, keys, ranks, 5, first=5, after_ms=ms)
    got = _drain(coord, 20)
    assert _steps_by_rank(got) == {r: list(range(5, 10)) for r in ranks}
    dead = admin.xrange(keys.dlq)
    assert [(f[b"stream"], f[b"entry"]) for _, f in dead] == [
        (stream.encode(), f"{ms}-0".encode()),
        (stream.encode(), f"{ms}-1".encode()),
    ]
    reasons = [f[b"reason"].decode() for _, f in dead]
    assert reasons[0].startswith("authentication failed"), reasons
    assert reasons[1].startswith(entries.REPLAYED), reasons
    assert {f[b"by"] for _, f in dead} == {b"coordinator.ingest"}
    coord.flush_acks()
    assert _until_acked(url, keys, ranks) == 0  # the dead-lettered ones acked too
    admin.close()
    coord.close()


@pytest.mark.parametrize("level", ["error", "critical"])
def test_reader_processes_log_at_the_coordinators_console_level_on_stderr(
    url: str, level: str, capfd: pytest.CaptureFixture[str]
) -> None:
    from flodl_bus.record.log import configure_console

    keys = RunKeys(f"ingest-log-{level}")
    # what a coordinator run with ``--log-level LEVEL`` hands its bus
    setup = functools.partial(configure_console, level)
    coord = _coord(url, keys, [0, 1], ingest_setup=setup)
    ms = int(time.time() * 1000) + 1
    forged = entries.build(
        fixed_keys(bytes(32)).rank(1), keys.up(1), f"{ms}-0", _batch(1, 0), "1", 1
    )
    admin = connect(url)
    admin.xadd(keys.up(1), forged, id=f"{ms}-0")  # type: ignore[arg-type]
    _prefill(url, keys, [0, 1], 3, first=1, after_ms=ms)
    assert len(_drain(coord, 6)) == 6
    # the dead-lettering is logged (an error) before its entry's successors are sent
    assert admin.xlen(keys.dlq) == 1
    admin.close()
    coord.close()  # the readers exited: their output is all there
    out, err = capfd.readouterr()
    assert "bus_dead_letter" not in out  # never on stdout
    assert ("bus_dead_letter" in err) == (level == "error"), err


def test_an_upstream_stream_wedged_at_the_largest_id_is_repaired_by_its_reader(
    url: str,
) -> None:
    """A foreign entry at the largest id makes Redis refuse every later XADD; the reader
    that owns the stream removes it (dlq first), and the rank's publisher goes on."""
    keys = RunKeys("ingest-wedged")
    coord = _coord(url, keys, [0, 1])
    ranks = [RedisRankBus(connect(url), keys, r, RK(r), config=FAST) for r in (0, 1)]
    admin = connect(url)
    admin.xadd(keys.up(1), {"junk": "x"}, id="18446744073709551615-18446744073709551615")
    for i in range(3):
        for rank in ranks:
            rank.publish(_batch(rank.rank, i))
    got = _drain(coord, 6)
    assert _steps_by_rank(got) == {0: [0, 1, 2], 1: [0, 1, 2]}
    assert ranks[1].flush(10)
    reasons = [f[b"reason"].decode() for _, f in admin.xrange(keys.dlq)]
    assert sum(r.startswith("foreign: entry id beyond the horizon") for r in reasons) == 1
    assert not admin.xinfo_stream(keys.up(1))["last-generated-id"].startswith(b"1844674407")
    for rank in ranks:
        rank.close()
    admin.close()
    coord.close()


def _read_until_restarted(coord: RedisCoordinatorBus, restarts: int) -> list[Delivery]:
    """Read (acking nothing) until the pool restarted its dead reader."""
    pool = coord.ingest
    assert pool is not None
    got: list[Delivery] = []
    deadline = time.monotonic() + 60
    while pool.restarts < restarts and time.monotonic() < deadline:
        got += coord.read_upstream(100)
    assert pool.restarts == restarts
    return got


def test_a_reader_killed_mid_stream_is_restarted_and_nothing_is_lost_or_repeated(
    url: str,
) -> None:
    keys = RunKeys("ingest-kill")
    ranks = range(4)
    n = 3000
    total = n * len(ranks)
    coord = _coord(url, keys, ranks)
    pool = coord.ingest
    assert pool is not None
    _prefill(url, keys, ranks, n)
    mine = keys.up(0)  # reader 0's share: ranks 0 and 2
    got: list[Delivery] = []

    def until_mine(at_least: int) -> list[Delivery]:
        """Read and ack until a read holds reader 0's entries; that read is not acked."""
        nonlocal got
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ds = coord.read_upstream(100)
            got += ds
            if sum(d.stream == mine for d in got) >= at_least and any(d.stream == mine for d in ds):
                return ds
            coord.ack(ds)
        raise AssertionError("reader 0 sent nothing")

    with structlog.testing.capture_logs() as logs:
        # 1. Killed before it acted on acks it was sent: its successor acks them.
        ds = until_mine(200)
        victim = pool.pids[0]
        assert victim is not None
        os.kill(victim, signal.SIGSTOP)
        coord.ack(ds)
        coord.flush_acks()  # into the stopped reader's pipe, never acted on
        os.kill(victim, signal.SIGKILL)
        held = _read_until_restarted(coord, 1)
        got += held
        coord.ack(held)
        # 2. Killed with entries the main process received and has not acked: its
        # successor starts after them, and acks them once the core is done.
        ds = until_mine(1000)
        victim = pool.pids[0]
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        held = _read_until_restarted(coord, 2)
        assert pool.wait_ready(120)
        # Still nothing acked: a successor that read its pending entries from the start
        # would hand out those of `ds` again here.
        deadline = time.monotonic() + 60
        while not any(d.stream == mine for d in held) and time.monotonic() < deadline:
            held += coord.read_upstream(100)
        got += held
        coord.ack([*ds, *held])
        got += _drain(coord, total - len(got))
        _prefill(url, keys, ranks, 50, first=n)  # the new reader reads new entries too
        got += _drain(coord, 50 * len(ranks))
    assert len(got) == total + 50 * len(ranks)
    assert [e["reader"] for e in logs if e["event"] == "bus_ingest_reader_died"] == [
        "coordinator.ingest.0"
    ] * 2
    assert _steps_by_rank(got) == {r: list(range(n + 50)) for r in ranks}
    assert coord.read_upstream(300) == []
    coord.flush_acks()
    assert _until_acked(url, keys, ranks) == 0
    client = connect(url)
    assert client.xlen(keys.dlq) == 0
    client.close()
    coord.close()


def kill_until_in_thread(
    coord: RedisCoordinatorBus, j: int
) -> tuple[list[Delivery], list[MutableMapping[str, Any]]]:
    """SIGKILL reader ``j`` (one that may not be restarted again) and read, acking,
    until the coordinator's thread reads in the pool's place: what was read, and the
    logs meanwhile."""
    pool = coord.ingest
    assert pool is not None
    pid = pool.pids[j]
    assert pid is not None
    got: list[Delivery] = []
    with structlog.testing.capture_logs() as logs:
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while coord.ingest is not None and time.monotonic() < deadline:
            ds = coord.read_upstream(100)
            coord.ack(ds)
            got += ds
    assert coord.ingest is None
    return got, logs


def test_a_reader_that_keeps_dying_hands_the_ingest_to_the_coordinators_thread(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ingest, "MAX_RESTARTS", 0)
    keys = RunKeys("ingest-dies")
    ranks = [0, 1]
    n = 2000
    coord = _coord(url, keys, ranks)
    pool = coord.ingest
    assert pool is not None
    _prefill(url, keys, ranks, n)
    got: list[Delivery] = []
    while sum(d.stream == keys.up(1) for d in got) < 100:
        ds = coord.read_upstream(100)
        coord.ack(ds)
        got += ds
    read, logs = kill_until_in_thread(coord, 1)
    got += read
    (why,) = [e["reason"] for e in logs if e["event"] == "bus_ingest_in_thread"]
    assert "coordinator.ingest.1 died 1 times" in why
    assert not any(p.is_alive() for p in _children(pool))
    got += _drain(coord, len(ranks) * n - len(got))
    _prefill(url, keys, ranks, 10, first=n)
    got += _drain(coord, 10 * len(ranks))
    assert _steps_by_rank(got) == {r: list(range(n + 10)) for r in ranks}
    assert coord.read_upstream(200) == []
    coord.flush_acks()
    assert _until_acked(url, keys, ranks) == 0
    coord.close()


def test_a_hung_reader_is_killed_and_named_with_its_ranks_and_its_successor_reads_on(
    url: str,
) -> None:
    keys = RunKeys("ingest-hung")
    ranks = range(4)
    coord = _coord(url, keys, ranks)
    pool = coord.ingest
    assert pool is not None
    pool.stall_s = 1.0
    _prefill(url, keys, ranks, 20)
    got = _drain(coord, 80)
    # idle readers still turn their loop: twice stall_s with nothing to read is no stall
    idle_until = time.monotonic() + 2 * pool.stall_s
    while time.monotonic() < idle_until:
        assert coord.read_upstream(100) == []
    victim = pool.pids[0]  # reader 0's share: ranks 0 and 2
    assert victim is not None
    with structlog.testing.capture_logs() as logs:
        os.kill(victim, signal.SIGSTOP)  # alive, reading nothing
        try:
            deadline = time.monotonic() + 60
            with pytest.raises(IngestHung) as hung:
                while time.monotonic() < deadline:
                    got += coord.read_upstream(100)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGCONT)
    why = str(hung.value)
    assert f"coordinator.ingest.0 (pid {victim}, ranks 0, 2)" in why and "hung" in why
    (e,) = [e for e in logs if e["event"] == "bus_ingest_reader_hung"]
    assert e["ranks"] == ["0", "2"] and e["pid"] == victim
    # killed (a stopped process would outlive the run) and replaced: its ranks are
    # still heard, so a run stopping in order gets their last words
    assert pool.restarts == 1 and pool.pids[0] != victim
    assert not any(p.pid == victim and p.is_alive() for p in _children(pool))
    _prefill(url, keys, ranks, 10, first=20)
    got += _drain(coord, 40)
    assert _steps_by_rank(got) == {r: list(range(30)) for r in ranks}
    coord.close()


def _children(pool: ingest.IngestPool) -> list[BaseProcess]:
    return [r.proc for r in pool._readers]


def test_ingest_procs_zero_keeps_the_in_thread_reader(url: str) -> None:
    keys = RunKeys("ingest-zero")
    coord = RedisCoordinatorBus(connect(url), keys, CK, ranks=[0], config=FAST)
    assert coord.ingest is None
    _prefill(url, keys, [0], 3)
    assert _steps_by_rank(_drain(coord, 3)) == {0: [0, 1, 2]}
    coord.close()


def test_the_benches_measure_each_ingest_procs_beside_the_in_thread_reader(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from flodl_bus.bench import bus, path

    argv = ["--redis-url", url, "--ranks", "", "--ingest-ranks", "2", "--ingest", "200"]
    assert bus.main([*argv, "--publishes", "40", "--repeats", "1", "--ingest-procs", "0,1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"2 ranks +in-thread +pre-filled +\d+/s", out), out
    assert re.search(r"2 ranks +1 procs +pre-filled +\d+/s .* \d\.\d\dx K=0", out), out
    argv = ["--redis-url", url, "--ranks", "4", "--steps", "2", "--repeats", "1"]
    assert path.main([*argv, "--ingest-procs", "0,1"]) == 0
    out = capsys.readouterr().out
    assert "ingest on the dispatching thread" in out and "ingest in 1 procs" in out, out
    assert len(re.findall(r"^  ingest +[\d.]+ µs/msg .* cpu +[\d.]+ µs/msg", out, re.M)) == 2
    assert bus.main(["--redis-url", url, "--ingest-procs", "-1"]) == 2
    assert path.main(["--ingest-procs", "two"]) == 2


def test_up_passes_ingest_procs_to_the_coordinator_and_both_refuse_a_negative_count() -> None:
    from pathlib import Path

    from flodl_bus.coordinator import cli_args
    from flodl_bus.launch import up_args

    args = up_args._parser().parse_args(["--ingest-procs", "2"])
    coord = up_args.coordinator_argv(args, "r", Path("runs/r"))
    assert coord[coord.index("--ingest-procs") + 1] == "2"
    plain = up_args._parser().parse_args([])
    assert "--ingest-procs" not in up_args.coordinator_argv(plain, "r", Path("runs/r"))
    with pytest.raises(SystemExit):
        up_args._parser().parse_args(["--ingest-procs", "-1"])
    base = ["--run", "r", "--world-size", "2", "--job", "flodl_bus.examples.digits:job"]
    assert cli_args._parser().parse_args(base).ingest_procs is None  # auto
    assert cli_args._parser().parse_args([*base, "--ingest-procs", "0"]).ingest_procs == 0
    with pytest.raises(SystemExit):
        cli_args._parser().parse_args([*base, "--ingest-procs", "-2"])


def test_auto_ingest_procs_read_in_processes_only_for_hundreds_of_ranks_on_many_cores() -> None:
    from flodl_bus.bus.ingest import AUTO_MIN_RANKS, AUTO_PROCS, auto_procs, procs_arg

    assert auto_procs(AUTO_MIN_RANKS, 16) == AUTO_PROCS
    assert auto_procs(AUTO_MIN_RANKS - 1, 16) == 0
    assert auto_procs(4096, 2) == 0  # the readers would share the core thread's cores
    assert auto_procs(4096, None) == 0
    assert procs_arg("auto") is None and procs_arg("AUTO") is None and procs_arg("3") == 3
    for bad in ("-1", "two", ""):
        with pytest.raises(ValueError, match="expected 'auto' or a count >= 0"):
            procs_arg(bad)


def test_a_redis_outage_longer_than_the_stall_bound_is_weather_not_a_hung_reader() -> None:
    # The readers' loop turns through an outage (each read gives up at its deadline and
    # goes round again), so an outage of several stall bounds kills and replaces nobody,
    # and every entry written before and after it is read once, in order.
    with RedisServer(appendonly=True) as server:
        keys = RunKeys("ingest-outage")
        ranks = range(4)
        coord = _coord(server.url, keys, ranks)
        pool = coord.ingest
        assert pool is not None
        pool.stall_s = 1.0
        _prefill(server.url, keys, ranks, 10)
        got = _drain(coord, 40)
        assert server.proc is not None
        server.proc.kill()
        server.proc.wait()
        server.stop()
        outage_until = time.monotonic() + 4 * pool.stall_s
        while time.monotonic() < outage_until:  # the fault itself, read through
            ds = coord.read_upstream(100)
            coord.ack(ds)
            got += ds
        server.start()
        _prefill(server.url, keys, ranks, 10, first=10)
        got += _drain(coord, 40)
        assert pool.restarts == 0
        assert _steps_by_rank(got) == {r: list(range(20)) for r in ranks}
        coord.close()
