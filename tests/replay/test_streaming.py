"""Replay streams: a record read from disk is never held whole, the replay's streams keep
a window of it, and a healthy replay says nothing on stderr."""

from __future__ import annotations

from pathlib import Path

import pytest

from flodl_bus.bench.record import bench_coordinator
from flodl_bus.record.chain import DamagedRecord
from flodl_bus.replay import CoordinatorReplay, load_run, recording_from_records
from flodl_bus.replay.cli import main
from flodl_bus.replay.engine import WINDOW

GOLDEN = Path(__file__).resolve().parents[1] / "sessions" / "cpu-cadence"


def test_a_long_record_replays_without_being_loaded_and_its_streams_stay_a_window(
    tmp_path: Path,
) -> None:
    n = 4 * WINDOW
    bench_coordinator(n, tmp_path)  # a coordinator record of n upstream dispatches
    rec = load_run(tmp_path)["coordinator"]
    replay = CoordinatorReplay(rec, keep_actual=False)
    result = replay.run()
    assert result.identical, result.summary()
    assert result.replayed == n + 1  # start + every dispatch
    assert not rec.loaded and result.actual == []
    # Consumed entries were trimmed as the replay went: the streams hold the last one.
    for r in range(4):
        assert replay.client.xlen(replay.keys.up(r)) <= 1
    assert replay.feeder.fed == n


def test_a_healthy_replay_prints_nothing_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(GOLDEN)]) == 0
    got = capsys.readouterr()
    assert got.err == ""
    assert got.out.count("identical (") == 4


def test_a_ranks_events_written_out_of_order_by_its_two_threads_come_back_in_order() -> None:
    header = {"event": "run", "role": "rank", "rank": 0}
    events = [{"event": "step", "i": i} for i in range(200)]
    # the reader and the training thread race to the file: neighbours swap
    shuffled = list(events)
    for k in range(0, 198, 7):
        shuffled[k], shuffled[k + 1] = shuffled[k + 1], shuffled[k]
    rec = recording_from_records("rank:0", [header, *shuffled])
    assert [e["i"] for e in rec.events] == list(range(200))


def test_a_rank_record_missing_an_event_is_refused_naming_it() -> None:
    header = {"event": "run", "role": "rank", "rank": 0}
    events = [{"event": "step", "i": i} for i in range(100) if i != 57]
    with pytest.raises(DamagedRecord, match=r"misses core events i=\[57\]"):
        recording_from_records("rank:0", [header, *events])
