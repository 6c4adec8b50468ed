"""The run's picture: loss over time and per-rank throughput per epoch, one PNG.

matplotlib is imported here, with the Agg backend, only when a plot is written: the
launcher must work on a machine with no display, and must not pay for matplotlib before
the first training step.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path

from flodl_bus.launch.view import EpochRow, RunView

CSV_FIELDS = ("epoch", "loss", "metric", "syncs", "syncs_total", "anchor", "epoch_s", "at_s")


def write_rows_csv(path: Path, rows: Sequence[EpochRow], world_size: int) -> None:
    """The epoch table as CSV (used when the coordinator left no metrics.csv)."""
    thru = [f"throughput_r{r}" for r in range(world_size)]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*CSV_FIELDS, *thru])
        for row in rows:
            w.writerow(
                [
                    row.epoch,
                    row.loss,
                    "" if row.metric is None else row.metric,
                    row.syncs,
                    row.syncs_total,
                    "" if row.anchor is None else row.anchor,
                    row.epoch_s,
                    row.at,
                    *row.throughput,
                ]
            )


def _smooth(values: Sequence[float], window: int) -> list[float]:
    out: list[float] = []
    acc = 0.0
    kept: list[float] = []
    for v in values:
        kept.append(v)
        acc += v
        if len(kept) > window:
            acc -= kept[-window - 1]
        n = min(len(kept), window)
        out.append(acc / n)
    return out


def write_plot(path: Path, view: RunView, rows: Sequence[EpochRow], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_thru) = plt.subplots(2, 1, figsize=(9, 7), constrained_layout=True)
    for r, rv in enumerate(view.ranks):
        pts = [(t, v) for t, v in rv.losses if math.isfinite(v)]
        if not pts:
            continue
        ts, vs = zip(*pts)
        ax_loss.plot(ts, _smooth(vs, 20), lw=1, alpha=0.8, label=f"rank {r} (batch, smoothed)")
    if rows:
        ax_loss.plot(
            [row.at for row in rows], [row.loss for row in rows], "ko-", label="epoch mean"
        )
        evals = [(row.at, row.metric) for row in rows if row.metric is not None]
        if evals:
            ax_metric = ax_loss.twinx()
            ax_metric.plot(*zip(*evals), "s--", color="tab:green", label="eval metric")
            ax_metric.set_ylabel("eval metric")
            ax_metric.legend(loc="upper center", fontsize="small")
    ax_loss.set_xlabel("seconds since launch")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(title)
    ax_loss.legend(loc="upper right", fontsize="small")

    epochs = [row.epoch for row in rows]
    for r in range(view.world_size):
        thru = [row.throughput[r] if r < len(row.throughput) else 0.0 for row in rows]
        ax_thru.plot(epochs, thru, "o-", label=f"rank {r}")
    ax_thru.set_xlabel("epoch")
    ax_thru.set_ylabel("samples / s")
    ax_thru.set_title("throughput per rank")
    if rows:
        ax_thru.legend(loc="lower right", fontsize="small")
    fig.savefig(path, dpi=100)
    plt.close(fig)
