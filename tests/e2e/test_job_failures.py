"""A failing job stops the run in order, and a rank revived after being declared dead
leaves with one line: real coordinator and worker processes over redis-server.

Every wait is on an event the processes leave behind (a record line, a log line, an
exit), never a sleep; what is asserted is what an operator would read."""

from __future__ import annotations

import signal
import time

import pytest

from flodl_bus.record.chain import record_bytes, resolve
from flodl_bus.record.log import read_records
from tests.e2e.harness import Cluster, Proc, alerts, new_run_id, received, records, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.redis]

WS = 2


def _start(cluster: Cluster, job: str, *extra: str) -> tuple[str, Proc, list[Proc]]:
    run = new_run_id("jobfail")
    coord = cluster.coordinator(
        run,
        "--mode",
        "cpu-cadence",
        "--world-size",
        str(WS),
        "--epochs",
        "4",
        "--heartbeat-timeout",
        "3",
        *extra,
        job=job,
    )
    return run, coord, cluster.ranked_workers(run, WS, "--mode", "cpu-cadence")


def _saved_with(recs: list[dict], reason: str) -> bool:
    return any(
        o.get("msg", {}).get("type") == "ShutdownWithSave" and o["msg"]["reason"] == reason
        for r in recs
        for o in r.get("out", ())
    )


def _assert_stopped_for_job(cluster: Cluster, run: str, codes: list[int], line: str) -> None:
    coord_rc, r0, r1 = codes
    # rank 1's job failed (1); the run was ended by the protocol (a save): 3 for the
    # coordinator, rank 0 stopped in order as told (0 or 3 by the exit-code table)
    assert r1 == 1, cluster.tails()
    assert coord_rc == 3 and r0 in (0, 3), cluster.tails()
    recs = records(cluster.run_dir(run))
    assert recs[-1]["event"] == "end", recs[-1]
    assert recs[-1]["reason"] == "job_failed" or recs[-1]["reason"] == 6
    (alert,) = alerts(recs, "job_failed")
    assert alert["detail"] == f"rank 1: {line}", alert
    (exiting,) = [m for m in received(recs, "Exiting") if m.get("reason")]
    assert exiting["rank"] == 1 and exiting["reason"] == f"job_failed: {line}"
    # The failed rank says it in one line on its console; no traceback at info.
    out = cluster.procs[2].output()
    assert "rank_failed" in out and line in out, out
    assert "Traceback" not in out, out
    # Every rank record that exists is closed.
    for r in range(WS):
        path = resolve(cluster.run_dir(run) / f"rank{r}.jsonl")
        if path.exists():
            assert read_records(path)[-1]["event"] == "end", r


def test_loss_fn_raising_on_one_rank_stops_the_run_in_order(cluster: Cluster) -> None:
    run, coord, workers = _start(cluster, "tests.e2e.jobs:loss_raises_job")
    started = time.monotonic()
    codes = cluster.wait([coord, *workers], timeout=120)
    all_exited = time.monotonic()
    line = "loss_fn raised ValueError: labels out of range in batch"
    _assert_stopped_for_job(cluster, run, codes, line)
    recs = records(cluster.run_dir(run))
    assert _saved_with(recs, 6)
    told = next(r["now"] for r in recs if r.get("event") == "dispatch" and r["msg"].get("reason"))
    print(
        f"loss_fn raised: coordinator told -> its end {recs[-1]['now'] - told:.2f}s, "
        f"-> every process exited {all_exited - told:.2f}s (CLOCK_MONOTONIC); "
        f"run {all_exited - started:.1f}s"
    )


def test_a_raising_builder_stops_the_run_before_training(cluster: Cluster) -> None:
    run, coord, workers = _start(cluster, "tests.e2e.jobs:builder_raises_job")
    codes = cluster.wait([coord, *workers], timeout=120)
    line = "build_optimizer raised RuntimeError: no optimizer for this device"
    _assert_stopped_for_job(cluster, run, codes, line)


def test_a_non_finite_loss_stops_the_run_by_default(cluster: Cluster) -> None:
    run, coord, workers = _start(cluster, "tests.e2e.jobs:nan_stop_job")
    codes = cluster.wait([coord, *workers], timeout=120)
    assert codes[2] == 1 and codes[0] == 3, cluster.tails()
    (alert,) = alerts(records(cluster.run_dir(run)), "job_failed")
    assert alert["detail"].startswith("rank 1: loss_fn returned a non-finite loss (nan)")


def test_a_non_finite_loss_is_skipped_when_the_job_says_so(cluster: Cluster) -> None:
    run, coord, workers = _start(cluster, "tests.e2e.jobs:nan_skip_job")
    codes = cluster.wait([coord, *workers], timeout=180)
    assert codes == [0, 0, 0], cluster.tails()
    assert "nonfinite_loss_skipped" in workers[1].output()
    assert not alerts(records(cluster.run_dir(run)), "job_failed")


def test_a_rank_revived_after_being_declared_dead_leaves_with_one_line(cluster: Cluster) -> None:
    run = new_run_id("revive")
    coord = cluster.coordinator(
        run,
        "--mode",
        "cpu-cadence",
        "--world-size",
        "3",
        "--epochs",
        "6",
        "--heartbeat-timeout",
        "3",
        job="tests.e2e.jobs:slow_job",
    )
    workers = cluster.ranked_workers(run, 3, "--mode", "cpu-cadence")
    victim = workers[2]
    # Mid-run: after the first averaging round the rank took part in.
    wait_for(lambda: "rank_lost" not in coord.output() and _synced(coord), 90, "a sync", cluster)
    victim.popen.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: "rank_lost" in coord.output(), 60, "rank 2 declared dead", cluster)
    finally:
        victim.popen.send_signal(signal.SIGCONT)
    resumed = time.monotonic()
    assert victim.popen.wait(timeout=60) == 3, cluster.tails()
    print(f"revived rank: SIGCONT -> exit 3 in {time.monotonic() - resumed:.2f}s")
    out = victim.output()
    assert "declared_dead" in out and "RequestParams while" not in out, out
    assert "Traceback" not in out, out
    codes = cluster.wait([coord, *workers[:2]], timeout=180)
    assert codes == [0, 0, 0], cluster.tails()


def _synced(coord: Proc) -> bool:
    # The coordinator logs nothing per round at info; its record's first SyncAck
    # dispatch is the event (the record is written as it happens).
    path = coord.log.parent / "runs"
    for rec in path.glob("*/coordinator.jsonl*"):
        try:
            return b'"SyncAck"' in record_bytes(rec)  # readable while being written
        except (OSError, ValueError):
            return False
    return False
