"""What ``flodl-bus up`` prints: a bar for the run and one per rank, the epoch table,
the closing summary.

Formatting is pure (rows in, strings out); ``Progress`` owns the tqdm bars and is the
only part that writes to the terminal while bars are drawn (``tqdm.write`` keeps table
lines above the bars instead of tearing them).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from tqdm import tqdm

from flodl_bus.exits import describe, signal_of
from flodl_bus.launch.view import EpochRow, RunView


def _num(value: float | None, fmt: str, width: int) -> str:
    if value is None or not math.isfinite(value):
        return "-".rjust(width)
    return format(value, fmt).rjust(width)


def _fits(world_size: int, width: int | None) -> bool:
    """Whether a column per rank fits the terminal (None: no terminal, no limit)."""
    return width is None or len(_full_header(world_size)) <= width


def _full_header(world_size: int) -> str:
    thru = " ".join(f"r{r} smp/s".rjust(10) for r in range(world_size))
    return f"{'epoch':>5} {'loss':>8} {'metric':>7} {thru} {'syncs':>6} {'anchor':>6} {'at':>7}"


def table_header(world_size: int, width: int | None = None) -> str:
    """The table's header; on a terminal too narrow for a column per rank, the ranks'
    samples per second are summed and the slowest rank shown instead."""
    if _fits(world_size, width):
        return _full_header(world_size)
    return (
        f"{'epoch':>5} {'loss':>8} {'metric':>7} {'smp/s':>8} {'slowest':>10} "
        f"{'syncs':>6} {'anchor':>6} {'at':>7}"
    )


def format_row(row: EpochRow, width: int | None = None) -> str:
    anchor = "-" if row.anchor is None else str(row.anchor)
    if _fits(len(row.throughput), width):
        thru = " ".join(_num(t, ".0f", 10) for t in row.throughput)
    else:
        finite = [(t, r) for r, t in enumerate(row.throughput) if math.isfinite(t)]
        total = sum(t for t, _ in finite) if finite else None
        slow = min(finite) if finite else None
        slowest = "-" if slow is None else f"r{slow[1]} {slow[0]:.0f}"
        thru = f"{_num(total, '.0f', 8)} {slowest:>10}"
    line = (
        f"{row.epoch:>5} {_num(row.loss, '.4f', 8)} {_num(row.metric, '.4f', 7)} {thru} "
        f"{row.syncs:>6} {anchor:>6} {_num(row.at, '.1f', 6)}s"
    )
    # After the columns, not one of them: most runs skip nothing, and a column of zeros
    # would take the width a rank's throughput needs.
    return line + (f"  {row.skipped} skipped (non-finite loss)" if row.skipped else "")


def late_eval_line(epoch: int, metric: float) -> str:
    """An eval that came after its row was shown (the row printed ``-``)."""
    return f"{epoch:>5} {'':>8} {metric:>7.4f}   (epoch {epoch}'s eval, scored after its row)"


def wrap_items(head: str, items: Sequence[str], width: int | None, indent: int) -> list[str]:
    """``head`` then the items comma-separated, wrapped at ``width`` (None: one line)."""
    if width is None:
        return [head + ", ".join(items)]
    lines, line = [], head
    for i, item in enumerate(items):
        piece = item + ("," if i < len(items) - 1 else "")
        if len(line) + 1 + len(piece) > width and line.strip() and line != head:
            lines.append(line)
            line = " " * indent + piece
        else:
            line += ("" if line == head else " ") + piece
    lines.append(line)
    return lines


def terminal_width(stream: TextIO) -> int | None:
    """The columns of the terminal ``stream`` writes to; None when it is no terminal,
    or one that reports no size (a 0-column pty): then nothing is cut."""
    try:
        if not stream.isatty():
            return None
        cols = os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return None
    return cols if cols > 0 else None


@dataclass(frozen=True)
class Summary:
    run: str
    run_dir: str
    job: str
    mode: str
    workers: int
    interrupted: bool
    coordinator_rc: int | None
    worker_rcs: tuple[int | None, ...]
    final_metric: float | None
    target_metric: float | None
    wall_s: float
    first_step_s: float | None
    syncs: int
    batches: int
    files: tuple[str, ...]
    #: batches skipped for a non-finite loss (the coordinator's count, as in metrics.csv)
    skipped: int = 0

    @property
    def reached_target(self) -> bool | None:
        """Whether the final eval reached the job's target; None when there is no target,
        no final metric, or the run was interrupted (its last eval is not a final one)."""
        if self.target_metric is None or self.final_metric is None or self.interrupted:
            return None
        return self.final_metric >= self.target_metric

    def lines(self, width: int | None = None) -> list[str]:
        """The summary, each line within ``width`` columns (None: no limit)."""
        status = "interrupted" if self.interrupted else "finished"
        sig = None if self.coordinator_rc is None else signal_of(self.coordinator_rc)
        if not self.interrupted and sig is not None:
            # someone signalled the coordinator: a stop in order, not a failure
            status = describe(self.coordinator_rc)
        elif not self.interrupted and self.coordinator_rc not in (0, None):
            status = f"failed (coordinator exit {self.coordinator_rc})"
        metric = _num(self.final_metric, ".4f", 0).strip()
        if self.interrupted:
            metric = (
                f"{metric} (the last eval before the interrupt: no final eval, no target check)"
                if self.final_metric is not None
                else "- (interrupted before any eval)"
            )
        elif self.reached_target is not None:
            mark = ">=" if self.reached_target else "<"
            metric += f" ({mark} target {self.target_metric:g})"
        first = "-" if self.first_step_s is None else f"{self.first_step_s:.2f}s"
        codes = [f"coordinator={self.coordinator_rc}"]
        codes += [f"r{r}={rc}" for r, rc in enumerate(self.worker_rcs)]
        if self.interrupted:
            # 0 here is a rank that stopped in order when the coordinator said Shutdown
            codes.append("(stopped in order by the interrupt)")
        head = wrap_items(
            f"run {self.run} {status}: ",
            [self.job, f"{self.workers} workers", self.mode],
            width,
            4,
        )
        files = wrap_items(
            f"  record           {self.run_dir}/ (",
            list(self.files) or [""],
            width,
            19,
        )
        files[-1] += ")"
        return [
            *head,
            f"  final metric     {metric}",
            f"  wall time        {self.wall_s:.2f}s (first step after {first})",
            f"  syncs            {self.syncs} averaging rounds, {self.batches} batches"
            + (f" ({self.skipped} skipped: non-finite loss)" if self.skipped else ""),
            *wrap_items("  exit codes       ", codes, width, 19),
            *files,
        ]


def rank_totals(
    run_batches: int | None, shares: Sequence[float], world_size: int
) -> list[int | None]:
    """Each rank's bar total: its planned share of the run's batches. The shares are
    the coordinator's (ElChe's batch shares of the newest aggregated epoch, which a fast
    rank's are larger than a slow one's); an even split until the first epoch says."""
    if run_batches is None:
        return [None] * world_size
    usable = len(shares) == world_size and all(math.isfinite(x) and x >= 0 for x in shares)
    if not usable or sum(shares) <= 0:
        shares = [1.0] * world_size
    whole = sum(shares)
    return [math.ceil(run_batches * x / whole) for x in shares]


def run_eta_s(done: int, total: int | None, since_first_step_s: float | None) -> float | None:
    """Seconds the run has left at its measured rate: batches of all ranks since the
    first training step (startup is no training, so it is not in the rate); None while
    nothing says."""
    if total is None or since_first_step_s is None or done <= 0 or since_first_step_s <= 0:
        return None
    return max(0, total - done) * since_first_step_s / done


def newest_shares(view: RunView) -> tuple[float, ...]:
    """The batch shares of the newest aggregated epoch (empty before the first)."""
    return view.metrics[max(view.metrics)].per_rank_batch_share if view.metrics else ()


class Progress:
    """One bar for the whole run (every rank's batches of every epoch, with its ETA at
    the run's measured rate), one bar per rank (its planned share) and the table above.

    Table lines are sized to the terminal (``width``; None off a terminal). Bars need a
    terminal that reports its size: under one that says 0 columns (some ptys) they are
    drawn 80 wide rather than not at all.
    """

    def __init__(
        self,
        world_size: int,
        run_batches: int | None,
        *,
        bars: bool,
        out: TextIO | None = None,
        width: int | None = None,
    ) -> None:
        self.out = out or sys.stdout
        self.width = width
        self.bars: list[Any] = []
        self.run_bar: Any = None
        self._header_done = False
        self.world_size = world_size
        self._total = run_batches
        self._shares: tuple[float, ...] = ()
        if bars:
            fixed = terminal_width(sys.stderr) is None

            def bar(desc: str, position: int, **kw: Any) -> Any:
                return tqdm(
                    desc=desc,
                    unit="batch",
                    position=position,
                    leave=False,
                    dynamic_ncols=not fixed,
                    ncols=80 if fixed else None,
                    file=sys.stderr,
                    **kw,
                )

            # tqdm's own ETA would count the startup as training time: the run bar's
            # is the run's own, in its postfix.
            self.run_bar = bar(
                "run", 0, total=run_batches, bar_format="{desc}: {percentage:3.0f}%|{bar}| "
                "{n_fmt}/{total_fmt} [{elapsed}{postfix}]",
            )  # fmt: skip
            totals = rank_totals(run_batches, (), world_size)
            self.bars = [bar(f"rank {r}", r + 1, total=totals[r]) for r in range(world_size)]

    def set_total(self, run_batches: int | None) -> None:
        """The run's batches, all ranks and epochs (None: unknown)."""
        self._total = run_batches
        if self.run_bar is not None:
            self.run_bar.total = run_batches
            self.run_bar.refresh()
        self._set_rank_totals()

    def _set_rank_totals(self) -> None:
        if not self.bars:
            return  # no terminal, no bars
        for bar, total in zip(
            self.bars, rank_totals(self._total, self._shares, self.world_size), strict=True
        ):
            # a rank past its planned share keeps a total: its own count
            bar.total = None if total is None else max(total, bar.n)
            bar.refresh()

    def write(self, line: str) -> None:
        if self.bars:
            tqdm.write(line, file=self.out)
        else:
            self.out.write(line + "\n")
            self.out.flush()

    def update(self, view: RunView) -> None:
        for note in view.take_notes():
            self.write(f"  {note}")
        shares = newest_shares(view)
        if shares != self._shares:
            self._shares = shares
            self._set_rank_totals()
        run = self.run_bar
        if run is not None and view.total_batches != run.n:
            run.n = view.total_batches
            if run.total is not None and run.n > run.total:
                run.total = run.n
            first = view.first_step_at
            eta = run_eta_s(run.n, run.total, None if first is None else time.monotonic() - first)
            run.set_postfix_str("" if eta is None else f"ETA {tqdm.format_interval(eta)}", False)
            run.refresh()
        for r, bar in enumerate(self.bars):
            rv = view.ranks[r]
            if rv.batches != bar.n:
                bar.n = rv.batches
                if bar.total is not None and bar.n > bar.total:
                    bar.total = bar.n
                epoch = "-" if rv.epoch < 0 else str(rv.epoch)
                bar.set_postfix_str(f"epoch {epoch} loss {rv.loss:.3f}", refresh=False)
                bar.refresh()

    def rows(self, rows: Sequence[EpochRow]) -> None:
        for row in rows:
            if not self._header_done:
                self.write(table_header(self.world_size, self.width))
                self._header_done = True
            self.write(format_row(row, self.width))

    def late_evals(self, late: Sequence[tuple[int, float]]) -> None:
        for epoch, metric in late:
            self.write(late_eval_line(epoch, metric))

    def close(self) -> None:
        drew = bool(self.bars)
        for bar in [*self.bars, self.run_bar]:
            if bar is not None:
                bar.close()
        self.bars, self.run_bar = [], None
        if drew:
            # A stop signal can land while a bar is being drawn: clear what is left of
            # it, so the summary starts on a clean line.
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write("\r\x1b[K")
                sys.stderr.flush()
