"""What ``flodl-bus up`` prints: a bar per rank, the epoch table, the closing summary.

Formatting is pure (rows in, strings out); ``Progress`` owns the tqdm bars and is the
only part that writes to the terminal while bars are drawn (``tqdm.write`` keeps table
lines above the bars instead of tearing them).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from tqdm import tqdm

from flodl_bus.launch.view import EpochRow, RunView


def _num(value: float | None, fmt: str, width: int) -> str:
    if value is None or not math.isfinite(value):
        return "-".rjust(width)
    return format(value, fmt).rjust(width)


def table_header(world_size: int) -> str:
    thru = " ".join(f"r{r} smp/s".rjust(10) for r in range(world_size))
    return f"{'epoch':>5} {'loss':>8} {'metric':>7} {thru} {'syncs':>6} {'anchor':>6} {'at':>7}"


def format_row(row: EpochRow) -> str:
    thru = " ".join(_num(t, ".0f", 10) for t in row.throughput)
    anchor = "-" if row.anchor is None else str(row.anchor)
    return (
        f"{row.epoch:>5} {_num(row.loss, '.4f', 8)} {_num(row.metric, '.4f', 7)} {thru} "
        f"{row.syncs:>6} {anchor:>6} {_num(row.at, '.1f', 6)}s"
    )


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

    @property
    def reached_target(self) -> bool | None:
        if self.target_metric is None or self.final_metric is None:
            return None
        return self.final_metric >= self.target_metric

    def lines(self) -> list[str]:
        status = "interrupted" if self.interrupted else "finished"
        if not self.interrupted and self.coordinator_rc not in (0, None):
            status = f"failed (coordinator exit {self.coordinator_rc})"
        metric = _num(self.final_metric, ".4f", 0).strip()
        if self.reached_target is not None:
            mark = ">=" if self.reached_target else "<"
            metric += f" ({mark} target {self.target_metric:g})"
        first = "-" if self.first_step_s is None else f"{self.first_step_s:.2f}s"
        rcs = ", ".join(f"r{r}={rc}" for r, rc in enumerate(self.worker_rcs))
        return [
            f"run {self.run} {status}: {self.job}, {self.workers} workers, {self.mode}",
            f"  final metric     {metric}",
            f"  wall time        {self.wall_s:.2f}s (first step after {first})",
            f"  syncs            {self.syncs} averaging rounds, {self.batches} batches",
            f"  exit codes       coordinator={self.coordinator_rc}, {rcs}",
            f"  record           {self.run_dir}/ ({', '.join(self.files)})",
        ]


class Progress:
    """One tqdm bar per rank (batches run so far) and the table above them."""

    def __init__(
        self,
        world_size: int,
        batches_per_rank: int | None,
        *,
        bars: bool,
        out: TextIO | None = None,
    ) -> None:
        self.out = out or sys.stdout
        self.bars: list[Any] = []
        self._header_done = False
        self.world_size = world_size
        if bars:
            self.bars = [
                tqdm(
                    total=batches_per_rank,
                    desc=f"rank {r}",
                    unit="batch",
                    position=r,
                    leave=False,
                    dynamic_ncols=True,
                    file=sys.stderr,
                )
                for r in range(world_size)
            ]

    def set_total(self, total: int | None) -> None:
        for bar in self.bars:
            bar.total = total
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
        for r, bar in enumerate(self.bars):
            rv = view.ranks[r]
            if rv.batches != bar.n:
                bar.n = rv.batches
                epoch = "-" if rv.epoch < 0 else str(rv.epoch)
                bar.set_postfix_str(f"epoch {epoch} loss {rv.loss:.3f}", refresh=False)
                bar.refresh()

    def rows(self, rows: Sequence[EpochRow]) -> None:
        for row in rows:
            if not self._header_done:
                self.write(table_header(self.world_size))
                self._header_done = True
            self.write(format_row(row))

    def close(self) -> None:
        for bar in self.bars:
            bar.close()
        self.bars = []
