"""A real digits run over a Redis Cluster of 3 masters + 3 replicas started by the test:
the coordinator spreads the 3 ranks over the 3 masters; the run trains past its target,
every sample of each epoch once, and shuts down clean."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from flodl_bus.bus import cluster as bus_cluster
from flodl_bus.bus.cluster_server import LocalCluster
from flodl_bus.bus.connection import connect
from flodl_bus.bus.keys import RunKeys
from flodl_bus.coordinator.config import CoordinatorConfig
from flodl_bus.replay import replay_run
from tests.e2e.harness import (
    Cluster,
    cluster_fixture,
    epoch_samples,
    final_metric,
    header,
    metrics_rows,
    new_run_id,
    received,
    records,
    sent_plans,
    tiles,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.redis]

EPOCHS = 4
RANKS = 3


@pytest.fixture
def on_cluster(tmp_path: Path) -> Iterator[tuple[Cluster, LocalCluster]]:
    with LocalCluster(masters=3, replicas=1) as local:
        for procs in cluster_fixture(local.url, tmp_path):
            yield procs, local


def test_digits_over_a_redis_cluster_trains_each_sample_once_with_ranks_on_three_masters(
    on_cluster: tuple[Cluster, LocalCluster],
) -> None:
    procs, local = on_cluster
    run = new_run_id("cluster")
    coord = procs.coordinator(
        run, "--mode", "cpu-cadence", "--world-size", str(RANKS), "--epochs", str(EPOCHS)
    )
    workers = procs.ranked_workers(run, RANKS, "--mode", "cpu-cadence")
    codes = procs.wait([coord, *workers], timeout=180)
    assert codes == [0] * (RANKS + 1), procs.tails()

    # The run's meta names the shards; each rank's streams lie on a different master.
    home = connect(local.url, key=RunKeys(run).meta)
    shards = bus_cluster.parse_shards(home.hget(RunKeys(run).meta, "shards").decode())
    keys = RunKeys(run, shards)
    masters = bus_cluster.topology_of(local.url).masters()
    owners = {
        next(i for i, m in enumerate(masters) if m.serves(bus_cluster.slot_of(keys.ctl(r))))
        for r in range(RANKS)
    }
    assert len(owners) == RANKS
    assert all(connect(local.url, key=keys.up(r)).xlen(keys.up(r)) > 0 for r in range(RANKS))

    run_dir = procs.run_dir(run)
    recs = records(run_dir)
    cfg = CoordinatorConfig(
        **{k: v for k, v in header(recs)["config"].items() if k != "max_failure"}
    )
    epoch_size = cfg.epoch_batches(0) * cfg.batch_size
    rows = metrics_rows(run_dir)
    assert [int(r["epoch"]) for r in rows] == list(range(EPOCHS)), procs.tails()
    plans = sent_plans(recs)
    for row in rows:
        e = int(row["epoch"])
        trained = epoch_samples(row, RANKS)
        assert sum(trained) == epoch_size, (e, trained)
        per_rank = plans[e]
        assert tiles([rng for r in per_rank for rng in per_rank[r]], [(0, epoch_size)]), e
        assert trained == [sum(s for _, s in per_rank.get(r, [])) for r in range(RANKS)], e
    assert final_metric(run_dir) > 0.85
    assert sorted(m["rank"] for m in received(recs, "Exiting")) == list(range(RANKS))
    assert recs[-1]["event"] == "end" and recs[-1]["reason"] is None
    # nothing was dead-lettered on any shard
    assert all(connect(local.url, key=d).xlen(d) == 0 for d in keys.dlqs)
    # the records name the shards, and every process replays identically
    assert header(recs)["shards"] == list(shards)
    replays = replay_run(run_dir)
    assert sorted(replays) == ["coordinator", *(f"rank:{r}" for r in range(RANKS))]
    assert {k: r.summary() for k, r in replays.items() if not r.identical} == {}


def test_a_run_goes_on_through_the_failover_of_a_master_that_holds_a_rank(
    on_cluster: tuple[Cluster, LocalCluster],
) -> None:
    """Workers dial in (no --rank: the join stream, on the run's home slot); then the
    master of rank 0's shard is killed mid-run; its replica takes over and the run
    finishes with every sample of each epoch trained once."""
    procs, local = on_cluster
    run = new_run_id("failover")
    epochs = 12
    coord = procs.coordinator(
        run, "--mode", "cpu-cadence", "--world-size", str(RANKS), "--epochs", str(epochs)
    )
    workers = [procs.worker(run, f"w{i}") for i in range(RANKS)]
    run_dir = procs.run_dir(run)
    wait_for(lambda: len(metrics_rows(run_dir)) >= 1, 120, "an epoch", procs)
    home = connect(local.url, key=RunKeys(run).meta)
    keys = RunKeys(run, bus_cluster.parse_shards(home.hget(RunKeys(run).meta, "shards").decode()))
    masters = bus_cluster.topology_of(local.url).masters()
    node = next(m.node for m in masters if m.serves(bus_cluster.slot_of(keys.ctl(0))))
    victim = local.master_of_port(node[1])
    assert victim is not None
    local.nodes[victim].proc.kill()  # type: ignore[union-attr]
    codes = procs.wait([coord, *workers], timeout=240)
    assert codes == [0] * (RANKS + 1), procs.tails()
    recs = records(run_dir)
    cfg = CoordinatorConfig(
        **{k: v for k, v in header(recs)["config"].items() if k != "max_failure"}
    )
    epoch_size = cfg.epoch_batches(0) * cfg.batch_size
    rows = metrics_rows(run_dir)
    assert [int(r["epoch"]) for r in rows] == list(range(epochs)), procs.tails()
    for row in rows:
        assert sum(epoch_samples(row, RANKS)) == epoch_size, row
    assert sorted(m["rank"] for m in received(recs, "Exiting")) == list(range(RANKS))
