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
from typing import Any

from flodl_bus.launch.view import EpochRow, RunView

#: the coordinator's metrics.csv names and units where they overlap (coordinator/runtime.py)
CSV_FIELDS = (
    "epoch", "avg_loss", "eval_metric", "syncs", "syncs_total", "anchor", "epoch_ms", "at_s",
    "skipped_batches",
)  # fmt: skip


def write_outputs(
    run_dir: Path, view: RunView, rows: Sequence[EpochRow], title: str, *, plot: bool
) -> None:
    """``up``'s files at a run's end: ``metrics.csv`` where the coordinator left none, and
    ``plot.png``; a plot that cannot be drawn is said on the console, never a failure."""
    if rows and not (run_dir / "metrics.csv").exists():
        write_rows_csv(run_dir / "metrics.csv", rows, view.world_size)
    if not plot:
        return
    try:
        write_plot(run_dir / "plot.png", view, rows, title)
    except ModuleNotFoundError as exc:
        print(
            f"flodl-bus up: plot not written: {exc.name} is not installed "
            "(pip install 'flodl_bus[plot]', or --no-plot)"
        )
    except Exception as exc:  # a plot must never turn a good run into a failed one
        print(f"flodl-bus up: plot not written ({type(exc).__name__}: {exc})")


def write_rows_csv(path: Path, rows: Sequence[EpochRow], world_size: int) -> None:
    """The epoch table as CSV (used when the coordinator left no metrics.csv)."""
    thru = [f"samples_per_s_r{r}" for r in range(world_size)]
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
                    row.epoch_s * 1000.0,
                    row.at,
                    row.skipped,
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


def metric_limits(values: Sequence[float]) -> tuple[float, float]:
    """The eval axis: never narrower than 0.1 around the points (one point, or a flat
    run, would otherwise span a few thousandths and look like a swing), within [0, 1]
    when the metric is a fraction."""
    lo, hi = min(values), max(values)
    pad = max(0.05, (hi - lo) * 0.1)
    lo, hi = lo - pad, hi + pad
    if min(values) >= 0.0 and max(values) <= 1.0:
        lo, hi = max(0.0, lo), min(1.0, hi)
        if hi - lo < 0.1:  # at an end of [0, 1]
            lo, hi = (hi - 0.1, hi) if hi >= 1.0 else (lo, lo + 0.1)
    return lo, hi


#: a legend under its axes' label, a row of entries, outside what is plotted
_BELOW: dict[str, Any] = {
    "loc": "upper center",
    "bbox_to_anchor": (0.5, -0.18),
    "ncols": 4,
    "frameon": False,
}


def write_plot(path: Path, view: RunView, rows: Sequence[EpochRow], title: str) -> Any:
    """plot.png: loss over time since the first step (batches per rank, epoch means, the
    eval metric on its own axis, one legend), and each rank's samples per second by
    epoch; the legends under their axes.
    Returns the figure, closed (tests read its axes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax_loss, ax_thru) = plt.subplots(2, 1, figsize=(9, 8), constrained_layout=True)
    # From the first training step: the startup before it (seconds of imports and
    # handshakes) is no training, and would squeeze the curves to the right.
    first = view.time_to_first_step() or 0.0
    for r, rv in enumerate(view.ranks):
        pts = [(t - first, v) for t, v in rv.losses if math.isfinite(v)]
        if not pts:
            continue
        ts, vs = zip(*pts)
        ax_loss.plot(ts, _smooth(vs, 20), lw=1, alpha=0.8, label=f"rank {r} (batch, smoothed)")
    handles, labels = ax_loss.get_legend_handles_labels()
    if rows:
        ax_loss.plot(
            [row.at - first for row in rows], [row.loss for row in rows], "ko-", label="epoch mean"
        )
        handles, labels = ax_loss.get_legend_handles_labels()
        evals = [(row.at - first, row.metric) for row in rows if row.metric is not None]
        if evals:
            ax_metric = ax_loss.twinx()
            ax_metric.plot(*zip(*evals), "s--", color="tab:green", label="eval metric")
            ax_metric.set_ylabel("eval metric")
            ax_metric.set_ylim(*metric_limits([m for _, m in evals]))
            more_h, more_l = ax_metric.get_legend_handles_labels()
            handles, labels = handles + more_h, labels + more_l
    ax_loss.set_xlim(left=0.0)
    ax_loss.set_xlabel(f"seconds since the first training step ({first:.1f}s after launch)")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(title)
    if handles:
        # One legend for both axes (two would overlap), under the axes: inside, it sat
        # on the curves wherever it went.
        ax_loss.legend(handles, labels, fontsize="small", **_BELOW)

    epochs = [row.epoch for row in rows]
    for r in range(view.world_size):
        thru = [row.throughput[r] if r < len(row.throughput) else 0.0 for row in rows]
        ax_thru.plot(epochs, thru, "o-", label=f"rank {r}")
    ax_thru.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_thru.set_xlabel("epoch")
    ax_thru.set_ylabel("samples / s")
    ax_thru.set_title("throughput per rank")
    if rows:
        ax_thru.legend(fontsize="small", **_BELOW)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig
