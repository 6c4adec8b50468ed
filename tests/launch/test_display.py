"""The epoch table, the summary, the CSV and the PNG the launcher writes."""

from __future__ import annotations

import csv
import io
import math
import sys
from pathlib import Path

import pytest

from flodl_bus.launch.display import (
    Progress,
    Summary,
    format_row,
    rank_totals,
    run_eta_s,
    table_header,
)
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
    progress.set_total(20)  # no bars to size: nothing to do, nothing raised
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
    assert rows[0]["samples_per_s_r1"] == "800.0"
    assert rows[1]["eval_metric"] == ""


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


# ----------------------------------------------------------- widths, late evals, the plot


def _wide_row(epoch: int, world: int) -> EpochRow:
    return EpochRow(epoch=epoch, loss=0.25, metric=0.9612, throughput=tuple(
        1000.0 + 100 * r for r in range(world)), syncs=2, syncs_total=2 * (epoch + 1),
        anchor=40, epoch_s=0.5, at=10.0 + epoch)  # fmt: skip


def _summary(files: int) -> Summary:
    return Summary(
        run="up-20261129-165849-5f1e", run_dir="runs/up-20261129-165849-5f1e",
        job="flodl_bus.examples.charrnn:job", mode="cpu-cadence", workers=8,
        interrupted=False, coordinator_rc=0, worker_rcs=(0,) * 8, final_metric=0.96,
        target_metric=0.9, wall_s=8.3, first_step_s=5.17, syncs=10, batches=352,
        files=tuple(f"rank{r}.jsonl" for r in range(files)),
    )  # fmt: skip


def test_a_narrow_terminal_gets_whole_table_lines_with_the_ranks_folded() -> None:
    for world, width in ((2, 80), (4, 80), (8, 120), (16, 120)):
        header = table_header(world, width)
        row = format_row(_wide_row(3, world), width)
        assert len(header) <= width and len(row) <= width, (world, width)
        assert len(row) == len(header)
        if len(table_header(world)) > width:
            # folded: the sum of samples/s and the slowest rank
            assert "slowest" in header
            assert row.split()[3] == f"{sum(1000 + 100 * r for r in range(world))}"
            assert row.split()[4:6] == ["r0", "1000"]
    # no terminal: every rank has its column, however wide
    assert len(format_row(_wide_row(3, 16), None).split()) == 3 + 16 + 3


def test_the_summary_wraps_within_the_terminal_and_keeps_everything() -> None:
    s = _summary(files=12)
    for width in (80, 120):
        lines = s.lines(width)
        assert all(len(line) <= width for line in lines), [len(x) for x in lines]
        text = " ".join(lines)
        for r in range(12):
            assert f"rank{r}.jsonl" in text
        assert "r7=0" in text
    # not a terminal (or 0 columns): one line per item, nothing cut
    assert len(s.lines(None)) == 6


def test_a_coordinator_stopped_by_a_signal_reads_as_a_stop_not_a_failure() -> None:
    s = Summary(**{**_summary(2).__dict__, "coordinator_rc": 130})
    first = s.lines()[0]
    assert "run up-20261129-165849-5f1e stopped by SIGINT (exit 130):" in first
    assert "failed" not in first


def test_terminal_width_is_none_off_a_terminal_and_for_a_zero_column_pty() -> None:
    import os
    import pty
    import struct
    import termios
    from fcntl import ioctl

    from flodl_bus.launch.display import terminal_width

    assert terminal_width(io.StringIO()) is None
    leader, follower = pty.openpty()
    try:
        with os.fdopen(follower, "w", closefd=False) as tty:
            for cols, want in ((0, None), (120, 120), (80, 80)):
                ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, cols, 0, 0))
                assert terminal_width(tty) == want
    finally:
        os.close(leader)
        os.close(follower)


def test_progress_without_bars_prints_late_evals_under_the_table() -> None:
    out = io.StringIO()
    progress = Progress(2, 10, bars=False, out=out, width=80)
    progress.rows([_row(0, metric=None)])
    progress.late_evals([(0, 0.5012)])
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines[2].split()[:2] == ["0", "0.5012"] and "eval" in lines[2]
    assert all(len(line) <= 80 for line in lines)


def _aggregate(view: RunView, epoch: int, now: float) -> None:
    m = EpochMetrics(epoch=epoch, avg_loss=1.0, epoch_ms=100.0, per_rank_throughput=(1.0, 2.0))
    view.on_control(None, EpochAggregated(m), now=now)


def test_a_row_waits_for_its_due_eval_past_the_next_epoch_and_a_late_one_is_filled() -> None:
    from flodl_bus.protocol.messages import EvalBroadcast

    view = RunView(2, started_at=0.0, eval_every=1)
    view.set_epochs(4)
    _aggregate(view, 0, 1.0)
    _aggregate(view, 1, 2.0)  # async epochs overlap: epoch 1 before epoch 0's eval
    assert view.rows_ready() == []  # epoch 0 still waits for its eval
    view.on_control(None, EvalBroadcast(epoch=1, metric=0.501), now=2.5)
    [row0] = view.rows_ready()
    assert row0.epoch == 0 and row0.metric == 0.501
    # an eval that never comes holds its row only until two later epochs are aggregated
    _aggregate(view, 2, 3.0)
    _aggregate(view, 3, 4.0)
    rows = view.rows_ready()
    assert [r.epoch for r in rows] == [1] and rows[0].metric is None
    # ...and when it comes after all, it is handed out as late, once
    view.on_control(None, EvalBroadcast(epoch=2, metric=0.524), now=4.5)
    assert view.take_late_evals() == [(1, 0.524)] and view.take_late_evals() == []
    # the last epoch's row waits for the run's end; the result is the latest-trained
    # model's score even when an older eval arrives after it
    view.on_control(None, EvalBroadcast(epoch=4, metric=0.603), now=5.0)
    view.on_control(None, EvalBroadcast(epoch=3, metric=0.55), now=5.1)
    assert [(r.epoch, r.metric) for r in view.rows_ready()] == [(2, 0.55)]
    # ...and for the run's end: its total has every round, the final averaging's too
    assert [(r.epoch, r.metric) for r in view.rows_ready(final=True)] == [(3, 0.603)]
    assert view.final_metric == 0.603 and view.last_metric == 0.55


def test_a_row_no_eval_is_due_for_goes_out_at_once() -> None:
    view = RunView(2, started_at=0.0, eval_every=2)
    view.set_epochs(6)
    _aggregate(view, 0, 1.0)  # eval_every 2: epoch 0 is not scored
    assert [r.epoch for r in view.rows_ready()] == [0]


def test_the_plot_has_sane_axes_one_legend_and_integer_epochs(tmp_path: Path) -> None:
    from matplotlib.ticker import MaxNLocator

    from flodl_bus.launch.plot import metric_limits

    view = RunView(2, started_at=0.0)
    for i in range(40):
        for r in (0, 1):
            view.on_upstream(r, Batch(r, 1.0, 0.0, i, 2.0 - i / 40), now=7.25 + i * 0.1)
    rows = [
        EpochRow(
            epoch=e,
            loss=1.0 / (e + 1),
            metric=0.3925 if e == 2 else None,
            throughput=(1000.0, 900.0),
            syncs=1,
            syncs_total=e + 1,
            anchor=10,
            epoch_s=1.0,
            at=8.0 + e,
        )
        for e in range(3)
    ]
    fig = write_plot(tmp_path / "plot.png", view, rows, "t")
    ax_loss, ax_thru, ax_metric = fig.axes
    # from the first training step (7.25s after launch), not from the launch
    assert ax_loss.get_xlim()[0] == 0.0
    xs = [x for line in ax_loss.get_lines() for x in line.get_xdata()]
    assert min(xs) == 0.0 and max(xs) == pytest.approx(7.25 + 3.9 - 7.25)  # the last batch
    assert "7.2s after launch" in ax_loss.get_xlabel()
    # each legend lies outside its axes (so off every line drawn in them), in the figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()  # the figure came back closed
    page = fig.bbox
    for ax in (ax_loss, ax_thru):
        box = ax.get_legend().get_window_extent(renderer)
        assert not box.overlaps(ax.get_window_extent(renderer)), ax.get_title()
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0, ax.get_title()
    lo, hi = ax_metric.get_ylim()
    assert hi - lo >= 0.0999 and lo <= 0.3925 <= hi  # one point: not a 0.04-wide axis
    assert ax_metric.get_legend() is None  # one legend, on the loss axis, for both
    legend = ax_loss.get_legend()
    assert legend is not None
    assert {t.get_text() for t in legend.get_texts()} >= {"epoch mean", "eval metric"}
    assert isinstance(ax_thru.xaxis.get_major_locator(), MaxNLocator)
    ticks = [t for t in ax_thru.get_xticks() if ax_thru.get_xlim()[0] <= t <= ax_thru.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)
    assert metric_limits([0.99, 0.995]) == (0.9, 1.0)


class _FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bars_keep_a_total_for_a_fast_rank_and_leave_nothing_half_drawn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    term = _FakeTerminal()
    monkeypatch.setattr(sys, "stderr", term)
    progress = Progress(2, None, bars=True, out=io.StringIO())
    progress.set_total(20)  # the run's: 10 per rank until the coordinator says shares
    view = RunView(2, started_at=0.0)
    for i in range(15):  # rank 0 runs past its even share of 10
        view.on_upstream(0, Batch(0, 1.0, 0.0, i, 1.0), now=0.1 * i)
    view.on_upstream(1, Batch(1, 1.0, 0.0, 0, 1.0), now=0.1)
    progress.update(view)
    fast, slow = progress.bars
    assert (fast.n, fast.total) == (15, 15) and (slow.n, slow.total) == (1, 10)
    assert (progress.run_bar.n, progress.run_bar.total) == (16, 20)
    # the first epoch's aggregate says the planned shares: 3/4 and 1/4 of the run
    view.on_control(
        None, EpochAggregated(EpochMetrics(0, 0.5, 10.0, per_rank_batch_share=(0.75, 0.25))), 2.0
    )
    progress.update(view)
    assert (fast.total, slow.total) == (15, 5)
    progress.close()
    # the last thing on the terminal clears the bar line: a stop mid-draw leaves none
    assert term.getvalue().endswith("\r\x1b[K")


def test_a_ranks_total_is_its_planned_share_of_the_run_even_until_one_is_known() -> None:
    assert rank_totals(None, (0.5, 0.5), 2) == [None, None]
    assert rank_totals(100, (), 4) == [25, 25, 25, 25]
    assert rank_totals(100, (0.6, 0.2, 0.2), 3) == [60, 20, 20]
    assert rank_totals(99, (0.5, 0.5), 2) == [50, 50]  # rounded up: a bar never ends short
    # shares that say nothing (a missing rank, NaN, all zero) fall back to an even split
    for odd in ((0.5,), (math.nan, 0.5), (0.0, 0.0)):
        assert rank_totals(10, odd, 2) == [5, 5]


def test_the_runs_eta_is_at_its_rate_since_the_first_step() -> None:
    assert run_eta_s(0, 100, 5.0) is None  # nothing trained: no rate yet
    assert run_eta_s(10, None, 5.0) is None and run_eta_s(10, 100, None) is None
    assert run_eta_s(25, 100, 10.0) == pytest.approx(30.0)  # 2.5 batches/s, 75 left
    assert run_eta_s(120, 100, 10.0) == 0.0  # past the plan (fast ranks overshoot)


def test_an_interrupted_runs_summary_claims_no_final_metric_and_no_target() -> None:
    """Issue 30: a Ctrl-C'd run said `final metric 0.9941 (>= target 0.9)` and `exit 0`
    for ranks that were stopped; its last eval is not a final one."""
    s = Summary(**{**_summary(2).__dict__, "interrupted": True, "coordinator_rc": 130})
    text = "\n".join(s.lines())
    assert s.reached_target is None
    assert "0.9600 (the last eval before the interrupt: no final eval, no target check)" in text
    assert "target 0.9)" not in text
    assert "(stopped in order by the interrupt)" in text
    none = Summary(**{**s.__dict__, "final_metric": None})
    assert "- (interrupted before any eval)" in "\n".join(none.lines())


def test_skipped_batches_follow_their_row_and_the_summary_and_nothing_when_none() -> None:
    import dataclasses

    row = dataclasses.replace(_row(0), skipped=4)
    line = format_row(row)
    assert line.startswith(format_row(_row(0))) and line.endswith("  4 skipped (non-finite loss)")
    s = _summary(2)
    assert not any("skipped" in line for line in s.lines())
    told = Summary(**{**s.__dict__, "skipped": 7}).lines()
    assert any(line.endswith("batches (7 skipped: non-finite loss)") for line in told)
