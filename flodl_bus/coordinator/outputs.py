"""What the coordinator writes beside the run: ``<save_path>.meta.json`` and
``metrics.csv``, each replaced atomically."""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flodl_bus.protocol.messages import EpochMetrics


def write_meta_file(save_path: str, meta: Mapping[str, Any]) -> Path:
    """``<save_path>.meta.json``, atomically: a resume never reads a torn file."""
    path = Path(f"{save_path}.meta.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1, sort_keys=True, allow_nan=False))
    os.replace(tmp, path)
    return path


def _num(x: float | None) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return ""
    return f"{x:.6g}"


def _mib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**20:.1f}"


class MetricsTable:
    """``metrics.csv``: one row per aggregated epoch, the eval metric merged in.

    An eval scheduled at the transition into epoch ``e`` (and the final eval, scheduled
    as epoch ``num_epochs``) scores the model after epoch ``e - 1``, so its metric lands
    on row ``e - 1`` (it may arrive before that row: async epochs overlap). The file is
    replaced atomically on every change, so a reader never sees a torn row. Each row is
    rendered once and again only when it changes: the writes are on the coordinator's
    loop thread, twice an epoch, and rendering every row each time made a run's cost
    grow with the square of its epochs (2 ms a write at 500 epochs on a 2-core machine).
    """

    def __init__(self, path: str | Path, world_size: int) -> None:
        self.path = Path(path)
        self.ws = world_size
        self.rows: dict[int, dict[str, str]] = {}
        self.evals: dict[int, float] = {}
        self._syncs_before = 0
        #: each row's CSV line as last rendered, by epoch (dropped when the row changes)
        self._lines: dict[int, str] = {}

    #: Units and counts are the console's (launch/display.py): samples per second, and
    #: ``syncs`` the averaging rounds of that epoch beside ``syncs_total`` for the run;
    #: ``skipped_batches`` the epoch's batches (all ranks) skipped for a non-finite loss.
    @property
    def columns(self) -> list[str]:
        cols = ["epoch", "avg_loss", "epoch_ms", "samples", "version", "syncs", "syncs_total"]
        cols += ["global_step", "anchor"]
        for r in range(self.ws):
            cols += [f"samples_r{r}", f"samples_per_s_r{r}", f"batch_share_r{r}", f"loss_r{r}"]
        # Each rank's newest resource sample of the epoch, in MiB (GPU: empty on CPU).
        for r in range(self.ws):
            cols += [f"rss_mib_r{r}", f"vram_mib_r{r}", f"vram_peak_mib_r{r}", f"gpu_util_r{r}"]
        # skipped_batches last: added after the others, it moves none of them
        return [*cols, "eval_metric", "skipped_batches"]

    def on_epoch(
        self, em: EpochMetrics, *, version: int, syncs: int, step: int, anchor: int
    ) -> None:
        def at(seq: Sequence[Any], r: int) -> Any:
            return seq[r] if r < len(seq) else None

        row = {
            "epoch": str(em.epoch),
            "avg_loss": _num(em.avg_loss),
            "epoch_ms": _num(em.epoch_ms),
            "samples": str(sum(em.per_rank_samples)),
            "skipped_batches": str(sum(em.per_rank_skipped)),
            "version": str(version),
            "syncs": str(max(0, syncs - self._syncs_before)),
            "syncs_total": str(syncs),
            "global_step": str(step),
            "anchor": str(anchor),
        }
        for r in range(self.ws):
            samples = at(em.per_rank_samples, r)
            row[f"samples_r{r}"] = "" if samples is None else str(samples)
            per_ms = at(em.per_rank_throughput, r)  # the wire's unit: samples per ms
            row[f"samples_per_s_r{r}"] = _num(None if per_ms is None else per_ms * 1000.0)
            row[f"batch_share_r{r}"] = _num(at(em.per_rank_batch_share, r))
            row[f"loss_r{r}"] = _num(at(em.per_rank_loss, r))
            res = at(em.per_rank_resources, r)
            row[f"rss_mib_r{r}"] = _mib(None if res is None else res.rss_bytes)
            row[f"vram_mib_r{r}"] = _mib(None if res is None else res.vram_allocated_bytes)
            row[f"vram_peak_mib_r{r}"] = _mib(None if res is None else res.vram_reserved_peak_bytes)
            row[f"gpu_util_r{r}"] = _num(None if res is None else res.gpu_util_percent)
        row["eval_metric"] = _num(self.evals.get(em.epoch))
        self.rows[em.epoch] = row
        self._lines.pop(em.epoch, None)
        self._syncs_before = syncs
        self.write()

    def on_end(self, syncs: int) -> None:
        """The run is over after ``syncs`` rounds. The rounds after the last epoch's
        aggregate (the final averaging, which the final eval scores) are that epoch's:
        the last row's ``syncs_total`` is then the run's, as the console and ``status``
        say it."""
        if not self.rows:
            return
        row = self.rows[max(self.rows)]
        added = syncs - int(row["syncs_total"])
        if added <= 0:
            return
        row["syncs"] = str(int(row["syncs"]) + added)
        row["syncs_total"] = str(syncs)
        self._lines.pop(max(self.rows), None)
        self._syncs_before = syncs
        self.write()

    def on_eval(self, scheduled_epoch: int, metric: float) -> None:
        row_epoch = scheduled_epoch - 1
        self.evals[row_epoch] = metric
        row = self.rows.get(row_epoch)
        if row is not None:
            row["eval_metric"] = _num(metric)
        self._lines.pop(row_epoch, None)
        self.write()

    def write(self) -> None:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=self.columns, lineterminator="\n")
        w.writeheader()
        head = buf.getvalue()

        def line(row: Mapping[str, str]) -> str:
            buf.seek(0)
            buf.truncate()
            w.writerow(row)
            return buf.getvalue()

        lines = self._lines
        parts = [head]
        for e in sorted(self.rows):
            text = lines.get(e)
            if text is None:
                text = lines[e] = line(self.rows[e])
            parts.append(text)
        for e in sorted(set(self.evals) - set(self.rows)):
            # An eval of an epoch never aggregated (a resumed run's first eval).
            parts.append(line({"epoch": str(e), "eval_metric": _num(self.evals[e])}))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(parts))
        os.replace(tmp, self.path)
