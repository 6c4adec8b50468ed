"""Epoch metrics aggregation (reference §4.11, §7.9)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from flodl_bus.coordinator.metrics import EpochBuffer, aggregate
from flodl_bus.coordinator.outputs import MetricsTable
from flodl_bus.protocol.messages import (
    NONFINITE_SKIPPED_TAG,
    EpochMetrics,
    MetricsMsg,
    ResourceSample,
)


def msg(rank: int, loss: float, batches: int, **kw: object) -> MetricsMsg:
    base: dict[str, object] = {
        "rank": rank,
        "epoch": 0,
        "avg_loss": loss,
        "batches_processed": batches,
        "epoch_ms": 100.0,
        "samples_processed": batches * 4,
        "share_complete_ms": 80.0,
        "compute_only_ms": 60.0,
        "data_starve_ms": 20.0,
    }
    base.update(kw)
    return MetricsMsg(**base)  # type: ignore[arg-type]


def test_loss_is_batch_weighted_across_ranks() -> None:
    buf = EpochBuffer(2)
    buf.record(0, msg(0, 0.5, 60))
    buf.record(1, msg(1, 0.7, 40))
    em = aggregate(0, buf.pop(0), [0.5, 0.5])
    assert math.isclose(em.avg_loss, 0.58)
    assert em.per_rank_samples == (240, 160)


def test_chunks_of_one_rank_sum_and_epoch_ms_is_the_slowest_rank() -> None:
    buf = EpochBuffer(2)
    buf.record(0, msg(0, 1.0, 10, epoch_ms=700.0))
    buf.record(0, msg(0, 2.0, 10, epoch_ms=500.0))
    buf.record(1, msg(1, 1.0, 5, epoch_ms=1000.0))
    em = aggregate(0, buf.pop(0), [0.5, 0.5])
    assert em.epoch_ms == 1200.0
    assert em.per_rank_loss[0] == 1.5
    assert em.per_rank_throughput[0] == 80 / 160.0
    assert aggregate(0, buf.pop(0), [0.5, 0.5], epoch_ms=42.0).epoch_ms == 42.0


def test_scalars_are_batch_weighted_means_of_rank_means() -> None:
    buf = EpochBuffer(2)
    buf.record(0, msg(0, 1.0, 30, scalars={"acc": (3.0, 3)}))  # mean 1.0
    buf.record(1, msg(1, 1.0, 10, scalars={"acc": (6.0, 2)}))  # mean 3.0
    em = aggregate(0, buf.pop(0), [0.5, 0.5])
    assert em.per_rank == ({"acc": 1.0}, {"acc": 3.0})
    assert em.scalars["acc"] == (1.0 * 30 + 3.0 * 10) / 40


def test_each_ranks_newest_resource_sample_of_the_epoch_is_kept_none_for_a_silent_rank() -> None:
    buf = EpochBuffer(3)
    buf.record(0, msg(0, 1.0, 10, resources=ResourceSample(rss_bytes=100)))
    buf.record(0, msg(0, 1.0, 10, resources=ResourceSample(rss_bytes=300)))
    buf.record(0, msg(0, 1.0, 10))  # a chunk without a sample keeps the newest one
    buf.record(1, msg(1, 1.0, 10))
    buf.record(2, msg(2, 1.0, 10, resources=ResourceSample(rss_bytes=7, device_index=1)))
    em = aggregate(0, buf.pop(0), [0.3, 0.3, 0.4])
    assert em.per_rank_resources == (
        ResourceSample(rss_bytes=300),
        None,
        ResourceSample(rss_bytes=7, device_index=1),
    )


def test_an_epoch_without_any_sample_aggregates_as_before_resources_existed() -> None:
    buf = EpochBuffer(2)
    buf.record(0, msg(0, 1.0, 10))
    buf.record(1, msg(1, 1.0, 10))
    assert aggregate(0, buf.pop(0), [0.5, 0.5]).per_rank_resources == ()


def test_metrics_csv_has_each_ranks_memory_in_mib_and_gpu_blank_on_cpu(tmp_path: Path) -> None:
    table = MetricsTable(tmp_path / "metrics.csv", 2)
    res = (ResourceSample(rss_bytes=300 * 2**20), None)
    table.on_epoch(
        EpochMetrics(0, 0.5, 10.0, per_rank_resources=res), version=1, syncs=1, step=1, anchor=1
    )
    (row,) = csv.DictReader((tmp_path / "metrics.csv").open())
    assert row["rss_mib_r0"] == "300.0" and row["vram_mib_r0"] == ""
    assert row["rss_mib_r1"] == "" and row["gpu_util_r1"] == ""


def test_non_finite_loss_never_poisons_the_mean_and_silent_rank_is_none() -> None:
    buf = EpochBuffer(3)
    buf.record(0, msg(0, float("nan"), 10))
    buf.record(1, msg(1, 0.4, 10))
    em = aggregate(0, buf.pop(0), [1 / 3] * 3)
    assert em.avg_loss == 0.4
    assert em.per_rank_loss[2] is None


def _scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="no tensorboard package (pip install 'flodl_bus[tensorboard]')",
    )
    acc = accumulator.EventAccumulator(log_dir)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_carry_the_consoles_figures_by_epoch(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed")
    from flodl_bus.coordinator.metrics import TensorBoardScalars

    assert TensorBoardScalars.available() is None
    board = TensorBoardScalars(str(tmp_path / "tb"))
    res = (ResourceSample(rss_bytes=3 * 2**20), None)  # rank 1 sent no sample
    for e, syncs in ((0, 3), (1, 5)):
        em = EpochMetrics(epoch=e, avg_loss=1.0 / (e + 1), epoch_ms=10.0,
                          per_rank_throughput=(1.5, 0.5),
                          per_rank_resources=res)  # fmt: skip
        board.on_epoch(em, syncs=syncs, anchor=10 * (e + 1))
    board.on_eval(1, 0.93)
    board.close()
    got = _scalars(str(tmp_path / "tb"))
    assert got["loss"] == [(0, 1.0), (1, 0.5)]
    assert got["samples_per_s/rank0"] == [(0, 1500.0), (1, 1500.0)]
    assert got["samples_per_s/rank1"] == [(0, 500.0), (1, 500.0)]
    assert got["anchor"] == [(0, 10.0), (1, 20.0)]
    assert got["syncs/epoch"] == [(0, 3.0), (1, 2.0)]
    assert got["syncs/total"] == [(0, 3.0), (1, 5.0)]
    assert got["eval/metric"] == [(1, pytest.approx(0.93))]
    # a CPU rank's RSS; no VRAM or GPU figure, and nothing for the rank without a sample
    assert got["resources/rss_mib/rank0"] == [(0, 3.0), (1, 3.0)]
    assert not [t for t in got if t.startswith("resources/") and t != "resources/rss_mib/rank0"]


def test_skipped_batches_are_counted_per_rank_over_every_chunk_and_written_per_epoch(
    tmp_path: Path,
) -> None:
    buf = EpochBuffer(3)
    # a skipped batch records 1.0 under the tag: the count, not the mean, is the number
    buf.record(0, msg(0, 1.0, 10, scalars={NONFINITE_SKIPPED_TAG: (2.0, 2)}))
    buf.record(0, msg(0, 1.0, 10, scalars={NONFINITE_SKIPPED_TAG: (3.0, 3)}))
    buf.record(1, msg(1, 1.0, 10))
    buf.record(2, msg(2, 1.0, 10, scalars={NONFINITE_SKIPPED_TAG: (1.0, 1)}))
    em = aggregate(0, buf.pop(0), [1 / 3] * 3)
    assert em.per_rank_skipped == (5, 0, 1)
    table = MetricsTable(tmp_path / "metrics.csv", 3)
    table.on_epoch(em, version=1, syncs=1, step=1, anchor=1)
    clean = EpochBuffer(3)
    for r in range(3):
        clean.record(r, msg(r, 1.0, 10, epoch=1))
    quiet = aggregate(1, clean.pop(1), [1 / 3] * 3)
    assert quiet.per_rank_skipped == ()  # as before the count existed
    table.on_epoch(quiet, version=2, syncs=2, step=2, anchor=1)
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [r["skipped_batches"] for r in rows] == ["6", "0"]


def test_the_rounds_after_the_last_aggregate_join_the_last_row(tmp_path: Path) -> None:
    table = MetricsTable(tmp_path / "metrics.csv", 1)
    table.on_epoch(EpochMetrics(0, 0.5, 10.0), version=2, syncs=2, step=1, anchor=1)
    table.on_epoch(EpochMetrics(1, 0.4, 10.0), version=3, syncs=3, step=2, anchor=1)
    table.on_end(4)  # the final averaging, after epoch 1's aggregate
    table.on_end(4)  # said twice, counted once
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [(r["syncs"], r["syncs_total"]) for r in rows] == [("2", "2"), ("2", "4")]


def test_metrics_csv_shows_every_later_change_to_a_row_already_written(tmp_path: Path) -> None:
    # Rows are rendered once and kept: an eval, a round or a re-aggregation landing on a
    # row already in the file must still reach the file.
    path = tmp_path / "metrics.csv"
    table = MetricsTable(path, 1)
    table.on_eval(1, 0.25)  # scores epoch 0 before its row exists (async overlap)
    table.on_epoch(EpochMetrics(0, 0.5, 10.0), version=1, syncs=1, step=1, anchor=1)
    table.on_epoch(EpochMetrics(1, 0.4, 10.0), version=2, syncs=2, step=2, anchor=1)
    table.on_eval(2, 0.75)  # scores epoch 1, its row already written
    assert [r["eval_metric"] for r in csv.DictReader(path.open())] == ["0.25", "0.75"]
    table.on_epoch(EpochMetrics(2, 0.3, 10.0), version=3, syncs=3, step=3, anchor=1)
    table.on_epoch(EpochMetrics(1, 0.35, 10.0), version=3, syncs=3, step=3, anchor=1)
    table.on_end(5)  # the final rounds join the last row
    table.on_eval(9, 0.5)  # an epoch never aggregated (a resumed run's first eval)
    rows = list(csv.DictReader(path.open()))
    got = [(r["epoch"], r["avg_loss"], r["eval_metric"], r["syncs_total"]) for r in rows]
    assert got == [
        ("0", "0.5", "0.25", "1"),
        ("1", "0.35", "0.75", "3"),
        ("2", "0.3", "", "5"),
        ("8", "", "0.5", ""),
    ]
    fresh = MetricsTable(tmp_path / "fresh.csv", 1)
    fresh.rows, fresh.evals = table.rows, table.evals
    fresh.write()
    assert path.read_text() == (tmp_path / "fresh.csv").read_text()
