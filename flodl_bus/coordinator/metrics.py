"""Per-epoch metrics accumulation and the cross-rank aggregate (reference §4.11)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flodl_bus.coordinator.numeric import ordered_sum
from flodl_bus.protocol.messages import (
    NONFINITE_SKIPPED_TAG,
    EpochMetrics,
    MetricsMsg,
    ResourceSample,
)


@dataclass(slots=True)
class RankAcc:
    """One rank's sums over every plan (chunk) it reported for one epoch."""

    batches: int = 0
    samples: int = 0
    epoch_ms: float = 0.0
    share_ms: float = 0.0
    compute_ms: float = 0.0
    data_ms: float = 0.0
    loss_x_batches: float = 0.0
    loss_batches: int = 0
    scalars: dict[str, list[float]] = field(default_factory=dict)
    #: the newest sample the rank sent for this epoch (a plan's end, not a mean: RSS and
    #: peak memory are levels, and the newest is the one to act on)
    resources: ResourceSample | None = None

    def add(self, m: MetricsMsg) -> None:
        self.batches += m.batches_processed
        self.samples += m.samples_processed
        self.epoch_ms += m.epoch_ms
        self.share_ms += m.share_complete_ms
        self.compute_ms += m.compute_only_ms
        self.data_ms += m.data_starve_ms
        # A NaN loss of one chunk must not poison the epoch mean.
        if m.batches_processed > 0 and math.isfinite(m.avg_loss):
            self.loss_x_batches += m.avg_loss * m.batches_processed
            self.loss_batches += m.batches_processed
        if m.resources is not None:
            self.resources = m.resources
        for tag, (total, count) in m.scalars.items():
            acc = self.scalars.setdefault(tag, [0.0, 0.0])
            acc[0] += total
            acc[1] += count


class EpochBuffer:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._epochs: dict[int, list[RankAcc]] = {}

    def record(self, rank: int, msg: MetricsMsg) -> None:
        accs = self._epochs.get(msg.epoch)
        if accs is None:
            accs = [RankAcc() for _ in range(self.world_size)]
            self._epochs[msg.epoch] = accs
        accs[rank].add(msg)

    def samples(self, epoch: int) -> list[int]:
        accs = self._epochs.get(epoch)
        return [a.samples for a in accs] if accs else [0] * self.world_size

    def pop(self, epoch: int) -> list[RankAcc]:
        return self._epochs.pop(epoch, None) or [RankAcc() for _ in range(self.world_size)]


def aggregate(
    epoch: int,
    accs: Sequence[RankAcc],
    batch_share: Sequence[float],
    epoch_ms: float | None = None,
) -> EpochMetrics:
    """Batch-weighted loss and scalars; ``epoch_ms`` defaults to the slowest rank's sum."""
    total_b = sum(a.loss_batches for a in accs)
    avg_loss = ordered_sum(a.loss_x_batches for a in accs) / total_b if total_b else math.nan
    per_rank: list[dict[str, float]] = []
    tags: list[str] = []
    for a in accs:
        means = {t: s / c for t, (s, c) in a.scalars.items() if c > 0}
        per_rank.append(means)
        tags += [t for t in means if t not in tags]
    # A skipped batch records 1.0 under its tag: the mean says nothing, the count is it.
    skipped = [int(a.scalars.get(NONFINITE_SKIPPED_TAG, [0.0, 0.0])[1]) for a in accs]
    scalars: dict[str, float] = {}
    for t in tags:
        holders = [(pr[t], a.batches) for pr, a in zip(per_rank, accs) if t in pr]
        weight = ordered_sum(b for _, b in holders)
        if weight > 0:
            scalars[t] = ordered_sum(v * b for v, b in holders) / weight
        else:
            scalars[t] = ordered_sum(v for v, _ in holders) / len(holders)
    return EpochMetrics(
        epoch=epoch,
        avg_loss=avg_loss,
        epoch_ms=epoch_ms if epoch_ms is not None else max((a.epoch_ms for a in accs), default=0),
        scalars=scalars,
        per_rank=tuple(per_rank),
        per_rank_throughput=tuple(
            a.samples / (a.share_ms or a.epoch_ms) if (a.share_ms or a.epoch_ms) > 0 else 0.0
            for a in accs
        ),
        per_rank_batch_share=tuple(batch_share),
        per_rank_share_complete_ms=tuple(a.share_ms for a in accs),
        per_rank_compute_only_ms=tuple(a.compute_ms for a in accs),
        per_rank_data_starve_ms=tuple(a.data_ms for a in accs),
        device_indices=tuple(range(len(accs))),
        per_rank_loss=tuple(
            a.loss_x_batches / a.loss_batches if a.loss_batches else None for a in accs
        ),
        per_rank_samples=tuple(a.samples for a in accs),
        # Empty when no rank sent a sample (older ranks, older records): the aggregate
        # is then the one made before resources existed.
        per_rank_resources=tuple(a.resources for a in accs)
        if any(a.resources is not None for a in accs)
        else (),
        per_rank_skipped=tuple(skipped) if any(skipped) else (),
    )


class TensorBoardScalars:
    """The run's per-epoch figures as TensorBoard scalars (``--tensorboard DIR``).

    Written by the coordinator, which sees every epoch's aggregate: ``loss``,
    ``eval/metric`` (at the epoch whose model it scored), ``samples_per_s/rank<r>``,
    ``anchor``, ``skipped_batches`` (non-finite losses skipped), ``syncs/epoch`` and
    ``syncs/total``; the step is the epoch. Needs the
    ``tensorboard`` package (``pip install 'flodl_bus[tensorboard]'``), checked by
    ``available`` before the run starts.
    """

    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir)
        self._syncs_before = 0
        #: (epoch, rounds so far) of the newest epoch, not written yet
        self._pending: tuple[int, int] | None = None

    @staticmethod
    def available() -> str | None:
        """None when event files can be written here, else why not (one line)."""
        import importlib.util

        # found, not imported: `up` asks before it starts anything, and importing
        # torch.utils.tensorboard imports torch (seconds)
        if importlib.util.find_spec("tensorboard") is None:
            return (
                "--tensorboard needs the tensorboard package: pip install 'flodl_bus[tensorboard]'"
            )
        return None

    def on_epoch(self, em: EpochMetrics, *, syncs: int, anchor: int) -> None:
        w, e = self.writer, em.epoch
        if math.isfinite(em.avg_loss):
            w.add_scalar("loss", em.avg_loss, e)
        for r, per_ms in enumerate(em.per_rank_throughput):
            w.add_scalar(f"samples_per_s/rank{r}", per_ms * 1000.0, e)  # wire: per ms
        for r, res in enumerate(em.per_rank_resources):
            # flodl's resource telemetry, where the rank could read it (None: not shown)
            for tag, value, scale in (
                ("rss_mib", None if res is None else res.rss_bytes, 1 / 2**20),
                ("vram_mib", None if res is None else res.vram_allocated_bytes, 1 / 2**20),
                ("gpu_util_percent", None if res is None else res.gpu_util_percent, 1.0),
            ):
                if value is not None:
                    w.add_scalar(f"resources/{tag}/rank{r}", value * scale, e)
        w.add_scalar("anchor", anchor, e)
        w.add_scalar("skipped_batches", sum(em.per_rank_skipped), e)
        # An epoch's rounds are written when the next epoch's come, or at the end:
        # the last epoch's take the final averaging's too (``on_end``).
        self._write_pending()
        self._pending = (e, syncs)
        w.flush()

    def on_end(self, last_epoch: int, syncs: int) -> None:
        """metrics.csv's ``on_end``: the final rounds join the last epoch, whose rounds
        are written now, once (a second point at one step would draw as two)."""
        if self._pending is not None and self._pending[0] == last_epoch:
            self._pending = (last_epoch, syncs)
        self._write_pending()
        self.writer.flush()

    def _write_pending(self) -> None:
        if self._pending is None:
            return
        e, total = self._pending
        self.writer.add_scalar("syncs/epoch", max(0, total - self._syncs_before), e)
        self.writer.add_scalar("syncs/total", total, e)
        self._syncs_before = total
        self._pending = None

    def on_events(self, events: Sequence[Mapping[str, Any]]) -> None:
        """flodl's timeline (``record.telemetry``) where it has a figure to plot: each
        round's divergence at its global step, each epoch's summary at its epoch."""
        w = self.writer
        for ev in events:
            kind = ev.get("kind")
            if kind == "Divergence" and ev.get("d_raw") is not None:
                w.add_scalar("divergence/d_raw", float(ev["d_raw"]), int(ev.get("step") or 0))
            elif kind == "DivergenceEpoch":
                for field in ("d_max", "d_mean", "sync_count"):
                    if ev.get(field) is not None:
                        w.add_scalar(f"divergence_epoch/{field}", float(ev[field]), ev["epoch"])

    def on_eval(self, scored_epoch: int, metric: float) -> None:
        if math.isfinite(metric):
            self.writer.add_scalar("eval/metric", metric, scored_epoch)
            self.writer.flush()

    def close(self) -> None:
        self._write_pending()  # a run stopped before its end
        self.writer.close()
