"""The epoch table, the summary, the CSV and the PNG the launcher writes."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from flodl_bus.launch.display import Progress, Summary, format_row, table_header
from flodl_bus.launch.plot import write_plot, write_rows_csv
from flodl_bus.launch.view import EpochRow, RunView
from flodl_bus.protocol.messages import Batch, EpochAggregated, EpochMetrics


def _row(epoch: int, metric: float | None = 0.9) -> EpochRow:
    return EpochRow(
        epoch=epoch,
        loss=0.5,
        metric=metric,
        throughput=(1200.0, 800.0),
        syncs=3,
        syncs_total=3 * (epoch + 1),
        anchor=None if metric is None else 20,
        epoch_s=0.4,
        at=2.5 + epoch,
    )


def test_rows_line_up_under_the_header() -> None:
    header = table_header(2)
    line = format_row(_row(0))
    assert len(line) == len(header)
    assert line.split() == ["0", "0.5000", "0.9000", "1200", "800", "3", "20", "2.5s"]
    missing = format_row(_row(1, metric=None)).split()
    assert missing[2] == "-" and missing[6] == "-"


def test_rows_without_bars_go_to_the_output_with_one_header() -> None:
    out = io.StringIO()
    progress = Progress(2, 10, bars=False, out=out)
    progress.rows([_row(0), _row(1)])
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == table_header(2)
    assert len(lines) == 3


def test_the_summary_names_the_outcome_target_times_and_record() -> None:
    s = Summary(
        run="r",
        run_dir="runs/r",
        job="digits-mlp",
        mode="cpu-cadence",
        workers=2,
        interrupted=False,
        coordinator_rc=0,
        worker_rcs=(0, 0),
        final_metric=0.95,
        target_metric=0.9,
        wall_s=12.0,
        first_step_s=3.25,
        syncs=7,
        batches=300,
        files=("coordinator.jsonl", "plot.png"),
    )
    text = "\n".join(s.lines())
    assert s.reached_target is True
    assert "finished" in text and "0.9500 (>= target 0.9)" in text
    assert "12.00s (first step after 3.25s)" in text
    assert "7 averaging rounds" in text and "runs/r/ (coordinator.jsonl, plot.png)" in text
    failed = Summary(**{**s.__dict__, "coordinator_rc": 1, "final_metric": 0.5})
    assert failed.reached_target is False
    assert "failed (coordinator exit 1)" in failed.lines()[0]


def test_the_csv_has_one_line_per_row_and_a_throughput_column_per_rank(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    write_rows_csv(path, [_row(0), _row(1, metric=None)], world_size=2)
    rows = list(csv.DictReader(path.open()))
    assert [r["epoch"] for r in rows] == ["0", "1"]
    assert rows[0]["throughput_r1"] == "800.0"
    assert rows[1]["metric"] == ""


def test_the_plot_is_a_png(tmp_path: Path) -> None:
    view = RunView(2, started_at=0.0)
    for i in range(50):
        for r in (0, 1):
            loss = 2.0 * math.exp(-i / 20) + r * 0.1
            view.on_upstream(r, Batch(r, 1.0, 0.0, i, loss), now=i * 0.1)
    for e in range(3):
        m = EpochMetrics(epoch=e, avg_loss=1.0 / (e + 1), epoch_ms=100.0,
                         per_rank_throughput=(1.0, 2.0))  # fmt: skip
        view.on_control(None, EpochAggregated(m), now=1.0 + e)
    rows = view.rows_ready(final=True)
    path = tmp_path / "plot.png"
    write_plot(path, view, rows, "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000
