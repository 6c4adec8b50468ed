"""``flodl-bus coordinator`` records through its record process by default: a real
2-rank run (redis-server, the coordinator, two workers training digits) whose record
replays identically; and the same run with the record process killed mid-run, which the
coordinator answers by stopping the run in order, exit 1, its record cut at a verified
line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from flodl_bus.exits import FAILED
from flodl_bus.record import chain
from flodl_bus.replay import load_run, replay, verify_run
from tests.replay.runs import _wait_for_line, record_run

pytestmark = [pytest.mark.redis, pytest.mark.slow]

INFO = ("--log-level", "info")


def test_the_coordinators_record_process_record_replays_identically(
    redis_url: str, tmp_path: Path
) -> None:
    os.environ.pop("FLODL_RECORD_PROCESS", None)  # the default
    _, run_dir = record_run(redis_url, tmp_path / "run", world_size=2, extra=INFO)
    log = (tmp_path / "run-coordinator.log").read_text()
    assert "record_process_started" in log and "record_process_unavailable" not in log
    assert "module=flodl_bus.record.process" in log
    run = load_run(run_dir)
    verify_run(run)  # every record complete and chained
    for key, rec in run.items():
        result = replay(rec)
        assert result.identical, f"{key}: {result.summary()}"


def _verified_lines(path: Path) -> int:
    """Lines of a record being written that verify so far (0 before there are any)."""
    try:
        return chain.check(path, allow_incomplete=True).lines
    except (OSError, ValueError):  # not there yet, or a block half written
        return 0


def test_killing_the_record_process_stops_the_real_run_in_order_with_exit_1(
    redis_url: str, tmp_path: Path
) -> None:
    os.environ.pop("FLODL_RECORD_PROCESS", None)
    killed: list[int] = []

    def kill_after_first_epoch(log: Path, coord: subprocess.Popen[bytes]) -> None:
        _wait_for_line(log, b"record_process_started", coord, 120)
        pid = re.search(rb"record_process_started[^\n]*?pid=(\d+)", log.read_bytes())
        assert pid is not None
        _wait_for_line(log, b"epoch_aggregated", coord, 120)
        # The child puts its lines on disk in blocks: kill it once more than ten are
        # there, so the cut record has something to verify (a loaded CI host killed it
        # with nine written).
        path = tmp_path / "run" / "coordinator.jsonl.zst"
        deadline = time.monotonic() + 120
        while _verified_lines(path) <= 10:
            assert coord.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        os.kill(int(pid[1]), signal.SIGKILL)
        killed.append(int(pid[1]))

    _, run_dir = record_run(
        redis_url,
        tmp_path / "run",
        world_size=2,
        epochs=50,
        extra=INFO,
        during=kill_after_first_epoch,
        codes=(FAILED, 0, 0),
    )
    assert killed
    log = (tmp_path / "run-coordinator.log").read_text()
    assert "record_process_died" in log and "run_stopped_record_lost" in log
    assert "SIGKILL" in log and "epoch_aggregated" in log
    run = load_run(run_dir)
    coord = run["coordinator"]
    assert coord.path is not None
    st = chain.check(coord.path, allow_incomplete=True)  # verified to its cut
    assert not st.ended and st.lines > 10
    with pytest.raises(chain.IncompleteRecord):
        chain.check(coord.path)
    result = replay(coord, allow_incomplete=True)
    assert result.identical, result.summary()
    # the ranks' records are whole: they were shut down, not cut
    for key in ("rank:0", "rank:1"):
        assert run[key].path is not None and chain.check(run[key].path).ended


def test_a_shadow_core_record_of_a_real_run_replays_identically(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLODL_RECORD_PROCESS", "shadow")
    _, run_dir = record_run(redis_url, tmp_path / "run", world_size=2, extra=INFO)
    log = (tmp_path / "run-coordinator.log").read_text()
    assert "flodl_bus.coordinator.shadow" in log and "record_shadow_diverged" not in log
    run = load_run(run_dir)
    verify_run(run)
    for key, rec in run.items():
        result = replay(rec)
        assert result.identical, f"{key}: {result.summary()}"
