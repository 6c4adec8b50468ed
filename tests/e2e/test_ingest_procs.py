"""A coordinator that reads its ranks' upstream in reader processes (``--ingest-procs``)
trains digits with real rank processes to a clean end, and its record replays exactly:
the core saw one ordered stream of deliveries, whichever process read them; and a reader
process that hangs stops the run in order with exit 1."""

from __future__ import annotations

import contextlib
import os
import re
import signal
from pathlib import Path

import pytest

from flodl_bus.replay import replay_run
from tests.e2e.harness import (
    SLOW,
    Cluster,
    assert_each_sample_once,
    metrics_rows,
    new_run_id,
    received,
    records,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.redis]


def test_a_run_with_two_ingest_processes_ends_clean_and_replays_identically(
    cluster: Cluster,
) -> None:
    run = new_run_id("ingest")
    ranks, epochs = 2, 2
    coord = cluster.coordinator(
        run,
        "--mode", "cpu-cadence",
        "--world-size", str(ranks),
        "--epochs", str(epochs),
        "--ingest-procs", "2",
    )  # fmt: skip
    workers = cluster.ranked_workers(run, ranks, "--mode", "cpu-cadence")
    codes = cluster.wait([coord, *workers], timeout=300)
    assert codes == [0] * (ranks + 1), cluster.tails()
    assert "bus_ingest_started" in coord.output(), cluster.tails()
    assert "bus_ingest_reader_died" not in coord.output()

    run_dir = cluster.run_dir(run)
    recs = records(run_dir)
    assert_each_sample_once(run_dir, ranks, epochs, cluster.tails())
    assert sorted(msg["rank"] for msg in received(recs, "Exiting")) == list(range(ranks))
    assert recs[-1]["event"] == "end" and recs[-1]["reason"] is None

    replays = replay_run(run_dir)
    assert sorted(replays) == ["coordinator", *(f"rank:{r}" for r in range(ranks))]
    assert {k: r.summary() for k, r in replays.items() if not r.identical} == {}


def _readers(pid: int) -> list[int]:
    """The reader processes among a coordinator's children (spawned: ``spawn_main``, the
    resource tracker aside), oldest first."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmd = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in cmd:
                found.append(int(child))
    return sorted(found)


def test_a_hung_reader_process_stops_the_run_in_order_with_exit_1(cluster: Cluster) -> None:
    run = new_run_id("ingest-hung")
    coord = cluster.coordinator(
        run,
        "--mode", "cpu-cadence",
        "--world-size", "2",
        "--epochs", "20",
        "--ingest-procs", "2",
        "--log-level", "warning",
        job=SLOW,
        env={"FLODL_INGEST_STALL_S": "3"},
    )  # fmt: skip
    workers = cluster.ranked_workers(run, 2, "--mode", "cpu-cadence")
    run_dir = cluster.run_dir(run)
    wait_for(lambda: len(metrics_rows(run_dir)) >= 1, 120, "the first epoch", cluster)
    readers = _readers(coord.popen.pid)
    assert len(readers) == 2, cluster.tails()
    victim = readers[0]
    os.kill(victim, signal.SIGSTOP)  # alive, reading nothing
    try:
        codes = cluster.wait([coord, *workers], timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)
    out = coord.output()
    assert codes == [1, 0, 0], cluster.tails()  # the ranks were told to stop, and did
    assert "run_stopped_ingest_hung" in out, cluster.tails()
    named = re.search(rf"coordinator\.ingest\.(\d) \(pid {victim}, ranks (\d)\)", out)
    assert named is not None and named[1] == named[2], out  # reader j reads rank j
    recs = records(run_dir)
    # stopped in order: the reader's successor heard its rank leave, as the other did
    assert sorted(msg["rank"] for msg in received(recs, "Exiting")) == [0, 1]
    assert len(metrics_rows(run_dir)) < 20
    # the readers log at the coordinator's level too: nothing below a warning
    assert not re.search(r"\[(debug|info)\s*\]", out), out
