"""``flodl-bus status`` against a real run on a real redis-server, and what a run leaves
behind in Redis: keys and secret that expire."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from flodl_bus.bus.entries import F_BODY, F_RANK, F_SEQ, F_TYPE
from flodl_bus.bus.keys import RunKeys
from flodl_bus.launch.status import main, read_status, render

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def _up(tmp_path: Path, redis_url: str, run: str, *extra: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "FLODL_RUN_SECRET"}
    return subprocess.Popen(
        [sys.executable, "-m", "flodl_bus.cli", "up", "--no-progress", "--no-plot",
         "--redis-url", redis_url, "--run", run, *extra],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def test_status_shows_a_live_run_then_its_end_and_the_run_keys_expire(
    tmp_path: Path, redis_url: str, real_redis: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    run = "status-live"
    from flodl_bus.coordinator.metrics import TensorBoardScalars

    board = [] if TensorBoardScalars.available() else ["--tensorboard", str(tmp_path / "tb")]
    proc = _up(tmp_path, redis_url, run, "--epochs", "6", "--workers", "2", *board)
    live: dict[str, Any] | None = None
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            if real_redis.exists(RunKeys(run).meta):
                st = read_status(real_redis, run)
                seen.append(st["status"])
                if (
                    st["status"] == "running"
                    and st["gate"] is not None
                    and all(r["steps_per_s"] for r in st["ranks"])
                    and all(r["heartbeat_s"] is not None for r in st["ranks"])
                    and st["epoch"] is not None
                ):
                    live = st
                    break
            time.sleep(0.1)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert live is not None, (seen[-5:], out)
    assert live["world_size"] == 2 and live["mode"] == "cpu-cadence" and live["epochs"] == 6
    assert 0 <= live["epoch"] <= 6
    assert live["anchor"] is not None and live["anchor"] >= 1
    assert live["gate"]["open"] or live["gate"]["why"]  # shut says why
    assert live["state_age_s"] is not None and live["state_age_s"] < 30
    assert live["dead_letters"] == 0
    for r in live["ranks"]:
        assert r["steps_per_s"] > 0 and r["heartbeat_s"] < 30 and r["last_step_s"] < 30
    text = render(live)
    assert f"run {run}  running  cpu-cadence  world 2  epoch {live['epoch']}/6" in text
    assert len(text.splitlines()) == 3 + 2

    # metrics.csv has each rank's memory of every epoch, and no GPU figures on CPU
    import csv

    rows = list(csv.DictReader((tmp_path / "runs" / run / "metrics.csv").open()))
    assert len(rows) == 6
    for row in rows:
        for r in (0, 1):
            # A rank that trained nothing of an epoch (bridges and the CPU plane's open
            # epochs can leave it all to its peer) sent no metrics of it: no figure.
            if row[f"samples_r{r}"] != "0":
                assert float(row[f"rss_mib_r{r}"]) > 50, row
            else:
                assert row[f"rss_mib_r{r}"] == "", row
        assert row["vram_mib_r0"] == row["gpu_util_r1"] == ""
    assert any(row["samples_r0"] != "0" for row in rows)
    assert any(row["samples_r1"] != "0" for row in rows)

    # the worker console said its rank, its progress and how it ended
    for r in (0, 1):
        log = (tmp_path / "runs" / run / f"rank{r}.log").read_text()
        assert f"flodl-bus worker: rank {r} of 2 (given) in run '{run}'" in log
        assert f"flodl-bus worker: rank {r}: epoch 0: " in log and "samples/s" in log
        assert log.rstrip().endswith(f"flodl-bus worker: rank {r} finished (exit 0)"), log[-500:]

    if board:  # the coordinator wrote the same figures for TensorBoard
        from tests.coordinator.test_metrics import _scalars

        scalars = _scalars(str(tmp_path / "tb"))
        assert [step for step, _ in scalars["loss"]] == list(range(6))
        assert {"anchor", "syncs/epoch", "samples_per_s/rank1", "eval/metric"} <= set(scalars)
        # flodl's telemetry and resources beside them: each round's divergence as the
        # run's events.jsonl has it, each epoch's summary, each rank's memory
        events = [
            json.loads(line)
            for line in (tmp_path / "runs" / run / "events.jsonl").read_text().splitlines()
        ]
        rounds = [e for e in events if e["kind"] == "Divergence" and e["d_raw"] is not None]
        assert rounds and {"divergence/d_raw", "divergence_epoch/d_max"} <= set(scalars)
        assert {step for step, _ in scalars["divergence/d_raw"]} == {e["step"] for e in rounds}
        assert {"resources/rss_mib/rank0", "resources/rss_mib/rank1"} <= set(scalars)

    # after the run: the command shows it finished, with each rank's memory as its last
    # metrics said (its own process; no GPU on CPU); its keys and secret expire
    done = read_status(real_redis, run)
    for r in done["ranks"]:
        assert r["resources"]["rss_bytes"] > 50 * 2**20
        assert "device_index" not in r["resources"]
    assert main(["--run", run, "--redis-url", redis_url]) == 0
    shown = capsys.readouterr().out
    assert f"run {run}  finished" in shown and "rss MiB" in shown
    rss = done["ranks"][0]["resources"]["rss_bytes"]
    assert f" {rss / 2**20:.0f} " in shown.splitlines()[3]
    keys = RunKeys(run)
    names = list(real_redis.scan_iter(match=f"{keys.prefix}*"))
    assert len(names) > 5
    # up hands the secret over in the environment; a coordinator that made one stores it
    if real_redis.exists(keys.secret):
        names.append(keys.secret)
    week = 7 * 24 * 3600
    for name in names:
        ttl = real_redis.ttl(name)
        assert 0 < ttl <= week, (name, ttl)


def test_status_of_an_unknown_run_is_an_error(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--run", "never-there", "--redis-url", redis_url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no run 'never-there'" in err


def test_expire_run_sets_a_ttl_on_every_key_of_the_run_and_its_secret_only(
    real_redis: redis.Redis,
) -> None:
    from flodl_bus.coordinator.cli import expire_run

    keys, other = RunKeys("expiring"), RunKeys("expiring2")
    for k in (keys, other):
        real_redis.hset(k.meta, "status", "finished")
        real_redis.xadd(k.ctl(0), {"type": "x"})
        real_redis.set(k.secret, "ab" * 16)
    assert expire_run(real_redis, keys, 120) == 3
    for name in (keys.meta, keys.ctl(0), keys.secret):
        assert 0 < real_redis.ttl(name) <= 120
    for name in (other.meta, other.ctl(0), other.secret):
        assert real_redis.ttl(name) == -1  # another run is untouched


def _live_meta(
    client: redis.Redis, keys: RunKeys, world: int, *, state_age: float, **fields: str
) -> int:
    """A running run's meta as its coordinator publishes it, its state ``state_age`` s
    old; now, in ms."""
    now_ms = int(time.time() * 1000)
    meta = {"status": "running", "world_size": str(world), "dead": "[]", "exited": "[]"}
    meta.update(state_at=repr(now_ms / 1000 - state_age), **fields)
    client.hset(keys.meta, mapping=meta)
    return now_ms


def test_forged_heartbeats_in_a_ranks_stream_do_not_make_a_silent_rank_look_alive(
    real_redis: redis.Redis,
) -> None:
    # The coordinator's view (what it verified): rank 0 heard 0.5 s before its state
    # was published, rank 1 silent for 40 s, rank 2 declared dead.
    run = "status-forged"
    keys = RunKeys(run)
    now_ms = _live_meta(real_redis, keys, 3, state_age=2.0, heard_s="[0.5, 40.0, 90.0]", dead="[2]")
    # Anyone who can write up:1 adds fresh, unsigned heartbeats for the silent rank.
    for _ in range(4):
        real_redis.xadd(keys.up(1), {F_TYPE: b"Heartbeat", F_RANK: b"1", F_SEQ: b"1", F_BODY: b""})
    st = read_status(real_redis, run, now_ms=now_ms)
    r0, r1, r2 = st["ranks"]
    assert r0["verified"] and r0["heartbeat_s"] == pytest.approx(2.5, abs=0.01)
    assert r1["verified"] and r1["heartbeat_s"] == pytest.approx(42.0, abs=0.01)
    assert (r0["state"], r1["state"], r2["state"]) == ("alive", "alive", "dead")
    text = render(st)
    assert "42.0s" in text and text.splitlines()[-1].endswith("dead")


def test_without_the_coordinators_view_a_streams_heartbeat_is_shown_as_unverified(
    real_redis: redis.Redis,
) -> None:
    run = "status-old-coordinator"
    keys = RunKeys(run)
    real_redis.hset(keys.meta, mapping={"status": "running", "world_size": "1"})
    real_redis.xadd(keys.up(0), {F_TYPE: b"Heartbeat", F_RANK: b"0", F_SEQ: b"1", F_BODY: b""})
    st = read_status(real_redis, run)
    (r0,) = st["ranks"]
    assert r0["verified"] is False and r0["heartbeat_s"] is not None
    assert render(st).splitlines()[-1].split()[4].endswith("s?")


def test_a_finished_run_shows_every_epoch_done_and_no_live_gate_or_rate(
    real_redis: redis.Redis,
) -> None:
    """Issue 30: a finished run showed `epoch 7/8`, `gate shut: rank 0 at 14/31` and a
    step rate from minutes before."""
    run = "status-finished"
    keys = RunKeys(run)
    now_ms = int(time.time() * 1000)
    real_redis.hset(
        keys.meta,
        mapping={
            "status": "finished",
            "world_size": "1",
            "epochs": "8",
            "rank_epoch": "[7]",
            "gate_open": "0",
            "gate_why": "rank 0 at 14/31 steps",
            "state_at": repr(now_ms / 1000 - 500),
            "heard_s": "[0.2]",
            "dead": "[]",
            "exited": "[0]",
        },
    )
    for i in range(3):
        real_redis.xadd(keys.up(0), {F_TYPE: b"Batch"}, id=f"{now_ms - 500_000 + i}-0")
    st = read_status(real_redis, run, now_ms=now_ms)
    assert st["epoch"] == 8 and st["gate"] is None
    (r0,) = st["ranks"]
    assert r0["steps_per_s"] is None and r0["state"] == "left"
    text = render(st)
    assert "epoch 8/8" in text and "gate -" in text and "14/31" not in text


def test_status_renders_a_gpu_ranks_utilisation_and_memory() -> None:
    rank = {
        "rank": 0, "epoch": 2, "steps_per_s": 10.0, "last_step_s": 0.1, "heartbeat_s": 0.5,
        "verified": True, "state": "alive",
        "resources": {
            "rss_bytes": 2048 * 2**20, "device_index": 1, "gpu_util_percent": 62.0,
            "vram_allocated_bytes": 1843 * 2**20, "vram_reserved_peak_bytes": 4096 * 2**20,
        },
    }  # fmt: skip
    st = {
        "run": "r", "status": "running", "mode": "nccl-cadence", "world_size": 1,
        "epochs": 4, "epoch": 2, "anchor": 3, "gate": None, "syncs": 1,
        "state_age_s": 0.2, "dead_letters": 0, "ranks": [rank],
    }  # fmt: skip
    line = render(st).splitlines()[-1]
    assert " 2048 " in line and "cuda:1 62% 1843/4096M" in line


def test_status_says_when_the_coordinator_is_behind_its_input(real_redis: redis.Redis) -> None:
    """Issue 31: a coordinator behind its ranks' entries declares no death until it
    catches up; its ranks' "heard" grows meanwhile, and status says why."""
    run = "status-behind"
    keys = RunKeys(run)
    now_ms = _live_meta(real_redis, keys, 1, state_age=0.5, heard_s="[14.0]", behind_s="12.5")
    st = read_status(real_redis, run, now_ms=now_ms)
    assert st["behind_s"] == 12.5
    assert "coordinator behind its input for 12.5s" in render(st)
    for shown, behind in ((False, ""), (False, "0.4")):
        real_redis.hset(keys.meta, "behind_s", behind)
        st = read_status(real_redis, run, now_ms=now_ms)
        assert ("behind its input" in render(st)) is shown
    real_redis.hset(keys.meta, mapping={"behind_s": "30.0", "status": "finished"})
    assert read_status(real_redis, run, now_ms=now_ms)["behind_s"] is None  # history


def test_the_coordinator_publishes_how_long_it_has_been_behind_as_status_reads_it(
    real_redis: redis.Redis,
) -> None:
    from flodl_bus.coordinator.cli import publish_state

    keys = RunKeys("status-behind-published")
    real_redis.hset(keys.meta, mapping={"status": "running", "world_size": "0"})
    summary = {"phase": "training", "dead": [], "exited": [], "rank_epoch": []}
    publish_state(real_redis, keys.meta, summary, behind_s=3.26)
    assert read_status(real_redis, keys.run)["behind_s"] == 3.3
    publish_state(real_redis, keys.meta, summary)  # caught up: the field is cleared
    assert read_status(real_redis, keys.run)["behind_s"] is None
