"""A real rank process (``run_rank`` over ``RedisRankBus`` on a real redis-server) records
itself while a scripted coordinator drives it; its record replays against a fresh
``WorkerControl`` over fakeredis."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from flodl_bus.bus.connection import connect
from flodl_bus.bus.streams import RedisCoordinatorBus
from flodl_bus.examples import digits
from flodl_bus.protocol.messages import (
    Batch,
    Checkpoint,
    CheckpointResult,
    EpochPlan,
    Exiting,
    ExtendPartition,
    MetricsMsg,
    RequestParams,
    SetGlobalStep,
    Shutdown,
    StartEpoch,
    SyncAck,
    SyncNow,
    Throttle,
    WireUpdate,
)
from flodl_bus.protocol.signing import fixed_keys, new_secret
from flodl_bus.record.chain import record_bytes
from flodl_bus.replay import Recording, load_run, replay, surgery
from flodl_bus.replay.cli import INCOMPLETE, main
from flodl_bus.replay.testing import logged

pytestmark = [pytest.mark.redis, pytest.mark.slow]

BS = digits.job.batch_size


class _Upstream:
    """The rank's upstream as one sequence: a wait consumes up to what it waited for and
    keeps the rest of the read (two Metrics can arrive in one read)."""

    def __init__(self, bus: RedisCoordinatorBus) -> None:
        self.bus = bus
        self.backlog: list[object] = []

    def wait(self, pred: Callable[[object], bool], timeout: float = 60.0) -> object:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            while self.backlog:
                msg = self.backlog.pop(0)
                if pred(msg):
                    return msg
            got = self.bus.read_upstream(100)
            self.bus.ack(got)
            self.backlog += [d.msg for d in got]
        raise AssertionError("the rank never sent what the script waits for")


@pytest.fixture(scope="module")
def rank_run(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One scripted session: a plan read while idle, a Throttle, an ExtendPartition, a
    Checkpoint and the next plan serviced while throttled, SyncNow, a CPU round
    (RequestParams, the plane's Update, the wire Update's plan), SetGlobalStep, Shutdown."""
    run_dir = tmp_path_factory.mktemp("rank-run")
    client: redis.Redis = connect(redis_url)
    run, secret = f"rec-rank-{uuid.uuid4().hex[:6]}", new_secret()
    bus = RedisCoordinatorBus(client, run, fixed_keys(secret), ranks=[0])
    up = _Upstream(bus)
    bus.send(0, StartEpoch(EpochPlan(0, 0, 6 * BS)))
    bus.send(0, Throttle())
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.replay.rank_proc",
            "--url",
            redis_url,
            "--run",
            run,
            "--secret",
            secret.hex(),
            "--record-dir",
            str(run_dir),
            "--save-path",
            str(run_dir / "ckpt"),
        ],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        up.wait(lambda m: isinstance(m, Batch))
        # Throttled: all of these are serviced by the throttle loop, in this order.
        bus.send(0, ExtendPartition(6 * BS, 2 * BS))
        bus.send(0, Checkpoint(version=1, target_rank=0))
        bus.send(0, StartEpoch(EpochPlan(0, 8 * BS, 3 * BS)))
        up.wait(lambda m: isinstance(m, CheckpointResult))
        bus.send(0, SyncNow())
        # The throttle is released: the rank finishes its plan, then the pending one.
        up.wait(lambda m: isinstance(m, MetricsMsg))
        up.wait(lambda m: isinstance(m, MetricsMsg))
        bus.send(0, RequestParams())
        up.wait(lambda m: isinstance(m, SyncAck) and m.step_count == 0)
        bus.send(0, WireUpdate(1, EpochPlan(0, 11 * BS, 2 * BS)))
        bus.send(0, SetGlobalStep(5))
        up.wait(lambda m: isinstance(m, MetricsMsg))
        bus.send(0, Shutdown())
        up.wait(lambda m: isinstance(m, Exiting))
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out.decode()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        bus.close()
        client.close()
    yield run_dir


def _rank(run_dir: Path) -> Recording:
    return load_run(run_dir)["rank:0"]


def test_the_rank_record_replays_identically(rank_run: Path) -> None:
    result = replay(_rank(rank_run))
    assert result.identical, result.summary()
    events = _rank(rank_run).core_events()
    assert {e["event"] for e in events} >= {"dispatch", "plan", "step"}
    # One path for a plan: a StartEpoch dispatched into the core's mailbox (the one read
    # while idle too), then taken from it.
    plans = [e for e in events if e["event"] == "plan"]
    starts = [e for e in events if e["event"] == "dispatch" and e["msg"]["type"] == "StartEpoch"]
    assert len(plans) == len(starts) == 3
    assert all(e["source"] == "pending" for e in plans)
    assert not any(e["event"] == "take" and e["why"] == "plan" for e in events)
    assert result.replayed == len(_rank(rank_run).core_events())


def test_the_record_holds_port_answers_and_no_tensors(rank_run: Path) -> None:
    events = _rank(rank_run).core_events()
    calls = [c["call"] for e in events for c in e.get("calls") or ()]
    assert {"sync_now", "snapshot", "load_averaged", "checkpoint"} <= set(calls)
    update = next(e for e in events if (e.get("msg") or {}).get("local"))
    assert update["stream"] is None and update["msg"]["tensors"][0] > 0
    assert "params" not in update["msg"]


def test_replay_prints_identical_and_is_the_same_twice(
    rank_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(rank_run)]) == 0
    first = capsys.readouterr().out
    assert main([str(rank_run)]) == 0
    assert capsys.readouterr().out == first
    assert first.startswith("identical (") and first.rstrip().endswith("dispatches)")


def test_a_changed_port_answer_is_named_as_the_first_divergence(rank_run: Path) -> None:
    run = load_run(rank_run)
    rec = run["rank:0"]
    ev = next(e for e in rec.events if any(c["call"] == "sync_now" for c in e.get("calls") or ()))
    call = next(c for c in ev["calls"] if c["call"] == "sync_now")
    call["result"]["divergence"] = 0.5
    result = replay(rec)
    assert not result.identical
    first = result.divergences[0]
    assert (first.index, first.field) == (ev["i"], "out")
    assert first.expected[0]["divergence"] != first.actual[0]["divergence"] == 0.5


def test_a_changed_entry_diverges_at_its_dispatch_and_the_cli_exits_1(
    rank_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from flodl_bus.replay import save_run

    run = load_run(rank_run)
    rec = run["rank:0"]
    ev = next(e for e in rec.events if (e.get("msg") or {}).get("type") == "ExtendPartition")
    read = next(
        x
        for r in rec.events
        if r["event"] == "read"
        for x in r["entries"]
        if x["id"] == ev["id"] and x["stream"] == ev["stream"]
    )
    read["msg"]["partition_size"] = 5 * BS
    assert main([str(save_run(run, tmp_path / "changed"))]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"divergence at event i={ev['i']} (dispatch of ExtendPartition")
    assert "expected:" in out and "actual:" in out


def test_a_duplicated_start_epoch_replays_into_the_one_chunk_in_flight_error(
    rank_run: Path,
) -> None:
    run = surgery.duplicate_start_epoch(load_run(rank_run), 0, nth=1)
    assert not replay(run["rank:0"]).identical
    result = replay(run["rank:0"], explore=True)
    errors = logged(result, "one_chunk_in_flight_violated")
    assert len(errors) == 1 and errors[0]["level"] == "error"
    assert errors[0]["dropped_plan"] == errors[0]["kept_plan"]
    # The original record has no such error.
    assert not logged(replay(_rank(rank_run)), "one_chunk_in_flight_violated")


def test_a_corrupted_control_entry_is_dead_lettered_in_replay(rank_run: Path) -> None:
    run = load_run(rank_run)
    stream, eid = surgery.find_entry(run, "rank:0", "SetGlobalStep")
    result = replay(surgery.corrupt_entry(run, "rank:0", stream, eid, "body")["rank:0"])
    assert [(d["stream"], d["id"]) for d in result.dead_letters] == [(stream, eid)]
    assert result.divergences[0].field == "entry"
    assert "dead-lettered: undecodable" in str(result.divergences[0].actual)


def test_a_rank_killed_mid_run_leaves_an_incomplete_record_that_replays_to_its_last_line(
    redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGKILL while training: no end record, maybe a torn frame. The record is refused as
    incomplete (exit 5), and ``--allow-incomplete`` replays it up to its last whole line."""
    client: redis.Redis = connect(redis_url)
    run, secret = f"rec-kill-{uuid.uuid4().hex[:6]}", new_secret()
    bus = RedisCoordinatorBus(client, run, fixed_keys(secret), ranks=[0])
    up = _Upstream(bus)
    bus.send(0, StartEpoch(EpochPlan(0, 0, 400 * BS)))
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "tests.replay.rank_proc", "--url", redis_url, "--run", run,
            "--secret", secret.hex(), "--record-dir", str(tmp_path),
        ],
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for _ in range(3):
            up.wait(lambda m: isinstance(m, Batch))
        # The record is readable while it is written: kill once a step is in it.
        deadline = time.monotonic() + 60
        while b'"event":"step"' not in _readable(tmp_path / "rank0.jsonl.zst"):
            assert time.monotonic() < deadline, "no step reached the record"
            time.sleep(0.02)  # polling the record for the line, not timing the rank
        proc.kill()
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        bus.close()
        client.close()
    assert main([str(tmp_path)]) == INCOMPLETE
    assert "rank0.jsonl.zst: incomplete" in capsys.readouterr().err
    assert main([str(tmp_path), "--allow-incomplete"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("identical (") and "(incomplete record)" in out
    rec = _rank(tmp_path)
    assert not any(r.get("event") == "end" for r in rec.other)
    assert any(e["event"] == "step" for e in rec.core_events())


def _readable(path: Path) -> bytes:
    try:
        return record_bytes(path)
    except FileNotFoundError:
        return b""
