"""The golden runs in tests/sessions (real 3-rank runs of every mode, recorded by the
coordinator and worker CLIs) replay identically, process by process."""

from __future__ import annotations

import gzip
from pathlib import Path

import orjson
import pytest

from flodl_bus.record.chain import record_bytes
from flodl_bus.replay import Recording, load_run, save_run
from flodl_bus.replay.cli import DAMAGED, INCOMPLETE, main
from flodl_bus.replay.testing import assert_identical, recorded_sessions

SESSIONS = Path(__file__).resolve().parents[1] / "sessions"
GOLDEN = recorded_sessions(SESSIONS)


def test_there_is_a_golden_run_of_every_mode_under_a_megabyte() -> None:
    assert {p.name for p in GOLDEN} == {
        "cpu-cadence",
        "cpu-sync",
        "cpu-async",
        "nccl-cadence",
        "nccl-sync",
    }
    assert sum(f.stat().st_size for f in SESSIONS.rglob("*") if f.is_file()) < 1_000_000


@pytest.mark.parametrize("recorded_run", GOLDEN, indirect=True, ids=[p.name for p in GOLDEN])
def test_a_golden_run_replays_identically_for_the_coordinator_and_every_rank(
    recorded_run: dict[str, Recording],
) -> None:
    assert sorted(recorded_run) == ["coordinator", "rank:0", "rank:1", "rank:2"]
    results = assert_identical(recorded_run)
    assert all(r.replayed > 20 for r in results.values())


@pytest.mark.recorded_run(SESSIONS / "cpu-cadence")
def test_the_cli_prints_one_line_per_process_and_the_same_output_twice(
    recorded_run: dict[str, Recording], capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(SESSIONS / "cpu-cadence")
    assert main([path]) == 0
    first = capsys.readouterr().out
    assert main([path]) == 0
    assert capsys.readouterr().out == first
    lines = first.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["coordinator", "rank", "rank", "rank"]
    assert all("identical (" in ln for ln in lines)
    assert main([path, "--role", "rank:1"]) == 0
    assert capsys.readouterr().out.startswith("identical (")


def test_a_changed_batch_time_diverges_where_the_coordinator_decides_differently(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = load_run(SESSIONS / "cpu-cadence")
    coord = run["coordinator"]
    batch = [e for e in coord.events if (e.get("msg") or {}).get("type") == "Batch"][5]
    batch["msg"]["batch_ms"] = 5000.0
    changed = save_run(run, tmp_path / "changed")
    assert main([str(changed), "--role", "coordinator"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("divergence at event i=")
    assert "expected:" in out and "actual:" in out
    # The slow batch is in the ledger, so the first different decision comes later.
    index = int(out.split("i=")[1].split(" ")[0])
    assert index > batch["i"]
    # Twice the same report.
    assert main([str(changed), "--role", "coordinator"]) == 1
    assert capsys.readouterr().out == out


def test_until_prints_what_each_rank_was_told_and_acked_and_the_gate(
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = SESSIONS / "cpu-cadence"
    coord = load_run(path)["coordinator"]
    nows = [e["now"] for e in coord.core_events() if "now" in e]
    mid = (max(nows) - min(nows)) / 2
    assert main([str(path), "--until", f"{mid}"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"coordinator at t={mid:.3f}s")
    assert "gate: " in out
    for r in range(3):
        assert f"rank {r}" in out
    assert out.count("last told: ") == 3 and out.count("last ack:  ") == 3
    assert main([str(path), "--until", f"{mid}"]) == 0
    assert capsys.readouterr().out == out


def _unpacked_copy(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    for f in (SESSIONS / "cpu-cadence").iterdir():
        (run / f.name.removesuffix(".zst")).write_bytes(record_bytes(f))
    return run


def test_a_record_missing_a_core_event_is_refused_naming_the_line_not_called_identical(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _unpacked_copy(tmp_path)
    path = run / "coordinator.jsonl"
    lines = path.read_text().splitlines()
    i = next(k for k, line in enumerate(lines) if '"event":"dispatch"' in line and k > 20)
    path.write_text("\n".join(lines[:i] + lines[i + 1 :]) + "\n")
    assert main([str(run)]) == DAMAGED
    # The line after the hole (now line i + 1) no longer follows its predecessor.
    assert f"coordinator.jsonl:{i + 1}: the digest does not follow" in capsys.readouterr().err


def test_a_damaged_line_inside_a_record_is_refused_and_a_torn_last_line_is_incomplete(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _unpacked_copy(tmp_path)
    path = run / "rank1.jsonl"
    lines = path.read_text().splitlines()
    # cut mid-line, as a crash in the middle of a write leaves it
    torn = [*lines[:-1], lines[-1][: len(lines[-1]) // 2]]
    path.write_text("\n".join(torn))
    # A torn end line: the record is incomplete, verified up to the line before.
    assert main([str(run), "--role", "rank:1"]) == INCOMPLETE
    err = capsys.readouterr().err
    assert "rank1.jsonl: incomplete" in err and f"1-{len(lines) - 1} verified" in err
    assert main([str(run), "--role", "rank:1", "--allow-incomplete"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("identical (") and f"up to line {len(lines) - 1}" in out
    damaged = [*lines[:10], lines[10][:15], *lines[11:]]
    path.write_text("\n".join(damaged) + "\n")
    assert main([str(run)]) == DAMAGED
    assert "rank1.jsonl:11: no digest" in capsys.readouterr().err


def test_records_without_a_digest_chain_replay_but_never_pass_as_identical(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A record written before the chain (format 1, gzipped) still replays, through the
    same engine, but nothing proves it is what its process wrote."""
    run = _unpacked_copy(tmp_path)
    for f in run.iterdir():
        unchained = [
            orjson.dumps({k: v for k, v in orjson.loads(line).items() if k != "d"})
            for line in f.read_bytes().splitlines()
        ]
        f.with_name(f.name + ".gz").write_bytes(gzip.compress(b"\n".join(unchained) + b"\n"))
        f.unlink()
    assert main([str(run)]) == DAMAGED
    assert "no digest chain" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="no digest chain"):
        assert_identical(load_run(run))
    results = assert_identical(load_run(run), verify=False)
    assert all(r.identical and r.replayed > 20 for r in results.values())
