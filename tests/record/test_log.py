"""The JSONL recorder: redaction, gzip and torn lines, thread-safe numbering, lines
encoded and sealed on the zstd writer thread."""

from __future__ import annotations

import gzip
import threading
from pathlib import Path

from flodl_bus.bus.connection import redact_url
from flodl_bus.protocol.messages import (
    AveragedParams,
    Batch,
    EpochPlan,
    LrUpdate,
    StartEpoch,
    Update,
)
from flodl_bus.record import chain
from flodl_bus.record.chain import record_bytes
from flodl_bus.record.dispatch import DispatchRecorder, record_value
from flodl_bus.record.log import Recorder, _default_with, read_records


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


def _record_steps(rec: DispatchRecorder) -> None:
    rec.header(world_size=1, batch_size=32)
    for k in range(1, 40):
        norm = 6.5 + k if k % 10 == 0 else None
        rec.step(
            args=(2.0 / k, 0.5, 0.05, 3e-3),
            calls=[] if norm is None else [{"port": "params", "call": "param_norm",
                                            "args": [], "result": norm}],
            out=[Batch(rank=0, batch_ms=0.5, data_ms=0.05, step_count=k, batch_loss=2.0 / k,
                       param_norm=norm), LrUpdate(rank=0, lr=3e-3)][: 2 if k == 1 else 1],
            after={"local_step": k, "pending_plan": {"epoch": 1, "partition_offset": 0,
                                                      "partition_size": 64}},
            now=k / 1000,
        )  # fmt: skip
        if k % 7 == 0:
            rec.take(stream="ctl:0", entry_id=f"{k}-0", msg=StartEpoch(EpochPlan(1, 0, 64)),
                     why="drop")  # fmt: skip
    rec.end(reason="done")
    rec.close()


def test_a_compressed_rank_record_encodes_its_steps_on_the_writer_thread_byte_for_byte(
    tmp_path: Path,
) -> None:
    """A rank's step line is encoded (and every line sealed) by the zstd writer, off the
    training thread: the record is byte for byte the one encoded where it was called."""
    plain = DispatchRecorder(tmp_path / "plain", "rank", 0, compress=False)
    zst = DispatchRecorder(tmp_path / "zst", "rank", 0, compress=True)
    encoded_on: dict[str, set[int]] = {}

    def encoder(obj: object) -> object:
        encoded_on.setdefault(type(obj).__name__, set()).add(threading.get_ident())
        return record_value(obj)

    assert zst._rec is not None
    zst._rec._default = _default_with(encoder)
    _record_steps(plain)
    _record_steps(zst)
    here = threading.get_ident()
    # the steps' messages on the writer; a take (not settled) where it was called
    assert encoded_on.keys() == {"Batch", "LrUpdate", "StartEpoch"}
    assert here not in encoded_on["Batch"] | encoded_on["LrUpdate"]
    assert encoded_on["StartEpoch"] == {here}
    assert record_bytes(zst.path) == record_bytes(plain.path)
    state = chain.check(zst.path)
    assert state.ended and state.lines == 1 + 39 + 5 + 1


def test_the_plain_record_encodes_a_settled_line_where_it_is_called(tmp_path: Path) -> None:
    encoded_on: list[int] = []

    def encoder(obj: object) -> object:
        encoded_on.append(threading.get_ident())
        return record_value(obj)

    rec = Recorder(tmp_path / "r.jsonl", encoder=encoder)
    rec.record_settled("step", i=0, out=[LrUpdate(rank=0, lr=0.1)])
    assert encoded_on == [threading.get_ident()]
    rec.close()


def test_an_unrecordable_settled_event_keeps_its_place_in_the_chain(tmp_path: Path) -> None:
    """Encoded on the writer thread, a value that cannot be recorded cannot raise to the
    caller: its line says so, and the chain and the end record's count still hold."""
    rec = Recorder(tmp_path / "r.jsonl.zst")
    rec.record_core("plan", i=0, now=0.5)
    rec.record_settled("step", i=1, out=[object()])
    rec.record_settled("step", i=2, now=1.5)
    rec.end()
    rec.close()
    lines = read_records(tmp_path / "r.jsonl.zst")
    assert [(r["event"], r.get("i")) for r in lines] == [
        ("plan", 0), ("unrecordable", 1), ("step", 2), ("end", None),
    ]  # fmt: skip
    assert lines[1]["of"] == "step" and "not JSON serializable" in lines[1]["error"]
    assert chain.check(tmp_path / "r.jsonl.zst").ended
