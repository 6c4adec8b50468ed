"""One set of numbers: a finished ``flodl-bus up`` run read back from every place that
shows it (the console's table and summary, the launcher's record, metrics.csv,
TensorBoard, ``status`` and the dashboard's state) must count the same things the same
way: the batches skipped for a non-finite loss, and the averaging rounds."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from flodl_bus.launch.dashboard import Observer
from flodl_bus.launch.status import read_status
from flodl_bus.record.log import read_records
from tests.e2e.jobs import NAN_DIR_ENV

pytestmark = [pytest.mark.redis, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def _tensorboard(log_dir: Path) -> dict[str, list[tuple[int, float]]] | None:
    """Every scalar the coordinator wrote, as (step, value) by tag; None without the
    tensorboard package."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ModuleNotFoundError:
        return None
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory: pytest.TempPathFactory, redis_server: Any) -> dict[str, Any]:
    """One 2-rank run of a job whose every fifth batch per rank has a NaN loss, skipped."""
    tmp = tmp_path_factory.mktemp("numbers")
    url = os.environ["REDIS_URL"] if redis_server is None else redis_server.url
    nan_dir = tmp / "nan"
    nan_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "FLODL_RUN_SECRET"}
    env[NAN_DIR_ENV] = str(nan_dir)
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    from flodl_bus.coordinator.metrics import TensorBoardScalars

    board = [] if TensorBoardScalars.available() else ["--tensorboard", str(tmp / "tb")]
    proc = subprocess.run(
        [sys.executable, "-m", "flodl_bus.cli", "up", "--no-progress", "--no-plot",
         "--redis-url", url, "--run", "nans", "--workers", "2", "--epochs", "3",
         "--job", "tests.e2e.jobs:every_fifth_nan_job", *board],
        cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout
    run_dir = tmp / "runs" / "nans"
    client = redis.Redis.from_url(url, socket_timeout=10)
    # Read while the run's keys are still there (they expire after the run).
    status = read_status(client, "nans")
    observer = Observer(client, "nans")
    for _ in range(3):  # scan and meta, then every stream from the start
        observer.step(block_ms=None)
    dash = observer.snapshot()
    client.close()
    return {
        "out": proc.stdout,
        "truth": sum(len(p.read_text().split()) for p in nan_dir.iterdir()),
        "rows": list(csv.DictReader((run_dir / "metrics.csv").open())),
        "records": read_records(run_dir / "up.jsonl"),
        "summary": read_records(run_dir / "up.jsonl")[-1],
        "tb": _tensorboard(tmp / "tb") if board else None,
        "status": status,
        "dash": dash,
    }


def test_skipped_batches_are_counted_on_the_console_and_in_the_csv_as_they_happened(
    nan_run: dict[str, Any],
) -> None:
    truth, out, rows = nan_run["truth"], nan_run["out"], nan_run["rows"]
    assert truth > 0, "the job returned no NaN loss: nothing was tested"
    assert sum(int(r["skipped_batches"]) for r in rows) == truth
    assert nan_run["summary"]["skipped"] == truth
    assert f"({truth} skipped: non-finite loss)" in out, out
    # the table says it per epoch, matching the CSV row by row
    per_epoch = {int(r["epoch"]): int(r["skipped_batches"]) for r in rows}
    shown = {int(m[1]): int(m[2]) for m in re.finditer(r"^ *(\d+) .* (\d+) skipped \(", out, re.M)}
    assert shown == {e: n for e, n in per_epoch.items() if n}
    assert [row["skipped"] for row in nan_run["dash"]["epoch_rows"]] == [
        int(r["skipped_batches"]) for r in rows
    ]
    if nan_run["tb"] is not None:
        assert sum(v for _, v in nan_run["tb"]["skipped_batches"]) == truth


def test_every_place_counts_the_same_averaging_rounds(nan_run: dict[str, Any]) -> None:
    rows, summary = nan_run["rows"], nan_run["summary"]
    total = int(rows[-1]["syncs_total"])
    assert total > 0
    assert summary["syncs"] == total
    assert f"  syncs            {total} averaging rounds" in nan_run["out"]
    assert nan_run["status"]["status"] == "finished"
    assert nan_run["status"]["syncs"] == total
    assert nan_run["dash"]["rounds"] == total
    # per epoch: the console's table (the launcher records each row it prints), the
    # CSV, the dashboard and TensorBoard
    table = [r["syncs_total"] for r in nan_run["records"] if r["event"] == "epoch"]
    csv_totals = [int(r["syncs_total"]) for r in rows]
    assert sum(int(r["syncs"]) for r in rows) == total
    assert table == csv_totals
    assert [row["rounds_total"] for row in nan_run["dash"]["epoch_rows"]] == csv_totals
    if nan_run["tb"] is not None:
        assert [int(v) for _, v in nan_run["tb"]["syncs/total"]] == csv_totals
