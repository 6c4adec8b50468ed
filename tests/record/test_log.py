"""The JSONL recorder: redaction, gzip and torn lines, thread-safe numbering."""

from __future__ import annotations

import gzip
import threading
from pathlib import Path

from flodl_bus.bus.connection import redact_url
from flodl_bus.protocol.messages import AveragedParams, EpochPlan, StartEpoch, Update
from flodl_bus.record.dispatch import DispatchRecorder, record_value
from flodl_bus.record.log import Recorder, read_records


def test_free_form_events_never_carry_secrets_or_url_credentials(tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "r.jsonl")
    rec.record("connect", run_secret="abc", password="pw", url="redis://u:pw@host:6379/0")
    rec.close()
    (line,) = read_records(tmp_path / "r.jsonl")
    assert line["run_secret"] == line["password"] == "***"
    assert line["url"] == "redis://u:***@host:6379/0" == redact_url("redis://u:pw@host:6379/0")
    assert "pw" not in line["url"]


def test_gzipped_records_read_like_plain_ones_and_a_torn_last_line_is_skipped(
    tmp_path: Path,
) -> None:
    data = b'{"event":"run"}\n{"event":"dispatch","i":0}\n{"event":"tick","i'
    (tmp_path / "a.jsonl").write_bytes(data)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(data))
    assert read_records(tmp_path / "a.jsonl") == read_records(tmp_path / "a.jsonl.gz")
    assert [r["event"] for r in read_records(tmp_path / "a.jsonl")] == ["run", "dispatch"]


def test_an_update_is_recorded_without_its_tensors_and_messages_as_wire_maps() -> None:
    upd = Update(AveragedParams(params=(object(), object()), buffers=(), version=3))
    assert record_value(upd) == {
        "type": "Update",
        "local": True,
        "version": 3,
        "realized": True,
        "tensors": [2, 0],
    }
    assert record_value(StartEpoch(EpochPlan(1, 2, 3)))["plan"] == {
        "epoch": 1,
        "partition_offset": 2,
        "partition_size": 3,
    }


def test_two_threads_recording_get_distinct_indices(tmp_path: Path) -> None:
    rec = DispatchRecorder(tmp_path, "rank", 0)

    def work() -> None:
        for _ in range(500):
            rec.take(stream="s", entry_id="1-0", msg=StartEpoch(EpochPlan(0, 0, 1)), why="plan")

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rec.close()
    indices = [r["i"] for r in read_records(tmp_path / "rank0.jsonl")]
    assert sorted(indices) == list(range(1000))


def test_lines_appended_to_an_existing_record_continue_its_chain(tmp_path: Path) -> None:
    """The launcher's up.jsonl of a run id used again: one file, still verifiable."""
    for n in range(2):
        rec = Recorder(tmp_path / "up.jsonl", role="up")
        rec.record("up", n=n)
        rec.record("summary", n=n)
        rec.close()
    assert [(r["event"], r["n"]) for r in read_records(tmp_path / "up.jsonl")] == [
        ("up", 0), ("summary", 0), ("up", 1), ("summary", 1),
    ]  # fmt: skip
