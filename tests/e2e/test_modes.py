"""The coordinator and real rank processes train digits in each of the five modes over
a real redis-server: to the target accuracy, every sample of each batch-aligned epoch
trained exactly once, and a clean Shutdown."""

from __future__ import annotations

import time

import pytest

from flodl_bus.coordinator.config import CoordinatorConfig
from flodl_bus.replay import replay_run
from tests.e2e.harness import (
    Cluster,
    assert_each_sample_once,
    final_metric,
    header,
    new_run_id,
    received,
    records,
)

pytestmark = [pytest.mark.slow, pytest.mark.redis]

EPOCHS = 8


@pytest.mark.parametrize(
    ("mode", "ranks"),
    [
        ("nccl-sync", 2),
        ("nccl-cadence", 3),
        ("cpu-sync", 2),
        ("cpu-cadence", 3),
        ("cpu-async", 2),
    ],
)
def test_mode_trains_digits_past_target_each_sample_once_and_shuts_down_clean(
    cluster: Cluster, mode: str, ranks: int
) -> None:
    run = new_run_id(mode)
    started = time.monotonic()
    coord = cluster.coordinator(
        run, "--mode", mode, "--world-size", str(ranks), "--epochs", str(EPOCHS)
    )
    workers = cluster.ranked_workers(run, ranks, "--mode", mode)
    codes = cluster.wait([coord, *workers], timeout=120)
    wall = time.monotonic() - started
    assert codes == [0] * (ranks + 1), cluster.tails()

    run_dir = cluster.run_dir(run)
    recs = records(run_dir)
    cfg = CoordinatorConfig(
        **{k: v for k, v in header(recs)["config"].items() if k != "max_failure"}
    )
    assert (cfg.mode, cfg.world_size, cfg.num_epochs) == (mode, ranks, EPOCHS)
    assert_each_sample_once(run_dir, ranks, EPOCHS, cluster.tails())
    assert not [r for r in recs if r.get("event") == "send_failed"]

    # Clean shutdown: every rank said Exiting, after the coordinator's Shutdown.
    assert sorted(m["rank"] for m in received(recs, "Exiting")) == list(range(ranks))
    assert recs[-1]["event"] == "end" and recs[-1]["reason"] is None

    # The run is replayable: fresh cores fed the recorded entries decide the same.
    replays = replay_run(run_dir)
    assert sorted(replays) == ["coordinator", *(f"rank:{r}" for r in range(ranks))]
    assert {k: r.summary() for k, r in replays.items() if not r.identical} == {}

    metric = final_metric(run_dir)
    print(f"\n{mode} x{ranks}: final accuracy {metric:.4f}, wall {wall:.1f}s")
    assert metric >= 0.9
