"""A real 3-rank cpu-cadence run (redis-server, ``flodl-bus coordinator``, three
``flodl-bus worker`` processes training digits) records itself and replays identically."""

from __future__ import annotations

from pathlib import Path

import pytest

from flodl_bus.replay import load_run, replay, verify_run
from tests.replay.runs import record_run

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def test_a_real_cpu_cadence_run_replays_identically_for_every_process(
    redis_url: str, tmp_path: Path
) -> None:
    run_id, run_dir = record_run(redis_url, tmp_path / "run", mode="cpu-cadence", epochs=1)
    run = load_run(run_dir)
    assert sorted(run) == ["coordinator", "rank:0", "rank:1", "rank:2"]
    assert run["coordinator"].header["run"] == run_id
    for key, rec in run.items():
        result = replay(rec)
        assert result.identical, f"{key}: {result.summary()}"
        assert result.replayed == len(rec.core_events()) > 10
    # The rank records carry the CPU round's port answers and the in-process Update.
    calls = {c["call"] for e in run["rank:1"].core_events() for c in e.get("calls") or ()}
    assert {"snapshot", "load_averaged"} <= calls
    # No secret reaches any record.
    import os

    secret_hex = os.environ.get("FLODL_RUN_SECRET")
    for f in run_dir.iterdir():
        text = f.read_text(errors="replace")
        assert "secret" not in text.lower() or "***" in text
        if secret_hex:
            assert secret_hex not in text


def test_a_reused_run_id_with_reset_run_leaves_two_replayable_records(
    redis_url: str, tmp_path: Path
) -> None:
    """Compose's pattern: the same run id, ``--reset-run``, the same run directory. The
    second run is recorded beside the first (``run.2``), never appended to it."""
    asked = tmp_path / "run"
    record_run(redis_url, asked, run="reused", world_size=2, reset_run=True)
    record_run(redis_url, asked, run="reused", world_size=2, reset_run=True)
    second = tmp_path / "run.2"
    assert second.is_dir(), sorted(p.name for p in tmp_path.iterdir())
    walls = []
    for run_dir in (asked, second):
        run = load_run(run_dir)
        assert sorted(run) == ["coordinator", "rank:0", "rank:1"]
        verify_run(run)  # complete, chained, one header each
        for key, rec in run.items():
            assert sum(1 for r in rec.other if r.get("event") == "run") == 0, key
            result = replay(rec)
            assert result.identical, f"{run_dir.name} {key}: {result.summary()}"
        walls.append(run["coordinator"].header["launched_wall"])
    assert walls[0] < walls[1]
    assert "record_rotated" in (tmp_path / "run-coordinator.log").read_text()


def test_a_run_recorded_under_a_record_key_replays_with_it_and_fails_without_it(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flodl_bus.record.chain import DamagedRecord

    monkeypatch.setenv("FLODL_RECORD_KEY", "a key kept outside the run directory")
    _, run_dir = record_run(redis_url, tmp_path / "run", world_size=2, epochs=1)
    run = load_run(run_dir)
    verify_run(run)
    for key, rec in run.items():
        assert replay(rec).identical, key
    monkeypatch.delenv("FLODL_RECORD_KEY")
    with pytest.raises(DamagedRecord, match="set FLODL_RECORD_KEY to verify it"):
        verify_run(load_run(run_dir))


def test_a_real_world_of_one_scores_each_epoch_it_held_ahead_and_replays_identically(
    redis_url: str, tmp_path: Path
) -> None:
    # issue 27: each next epoch's plan waits in the rank's mailbox, the eval of that
    # epoch's start armed: the rank scores it in process, just before taking the plan
    _, run_dir = record_run(
        redis_url, tmp_path / "run", world_size=1, epochs=4, extra=("--eval-every", "1")
    )
    run = load_run(run_dir)
    assert sorted(run) == ["coordinator", "rank:0"]
    for key, rec in run.items():
        result = replay(rec)
        assert result.identical, f"{key}: {result.summary()}"
    events = run["rank:0"].core_events()
    kinds = [(e.get("event"), (e.get("msg") or {}).get("type")) for e in events]
    armed = [e for e in events if (e.get("msg") or {}).get("type") == "ArmEpochEval"]
    assert [e["msg"]["epoch"] for e in armed] == [1, 2, 3]
    evals = [i for i, k in enumerate(kinds) if k == ("dispatch", "ExecuteEvalCallback")]
    assert [events[i]["msg"]["epoch"] for i in evals] == [1, 2, 3]
    for i in evals:
        assert events[i].get("stream") is None  # made by the rank, not read off a stream
        assert events[i]["out"][0]["type"] == "EvalResult"
        assert kinds[i + 1] == ("plan", None)  # then that epoch's plan, already held
        assert events[i + 1]["plan"]["epoch"] == events[i]["msg"]["epoch"]
