"""A coordinator that reads its ranks' upstream in reader processes (``--ingest-procs``)
trains digits with real rank processes to a clean end, and its record replays exactly:
the core saw one ordered stream of deliveries, whichever process read them."""

from __future__ import annotations

import pytest

from flodl_bus.replay import replay_run
from tests.e2e.harness import Cluster, assert_each_sample_once, new_run_id, received, records

pytestmark = [pytest.mark.slow, pytest.mark.redis]


def test_a_run_with_two_ingest_processes_ends_clean_and_replays_identically(
    cluster: Cluster,
) -> None:
    run = new_run_id("ingest")
    ranks, epochs = 2, 2
    coord = cluster.coordinator(
        run,
        "--mode", "cpu-cadence",
        "--world-size", str(ranks),
        "--epochs", str(epochs),
        "--ingest-procs", "2",
    )  # fmt: skip
    workers = cluster.ranked_workers(run, ranks, "--mode", "cpu-cadence")
    codes = cluster.wait([coord, *workers], timeout=300)
    assert codes == [0] * (ranks + 1), cluster.tails()
    assert "bus_ingest_started" in coord.output(), cluster.tails()
    assert "bus_ingest_reader_died" not in coord.output()

    run_dir = cluster.run_dir(run)
    recs = records(run_dir)
    assert_each_sample_once(run_dir, ranks, epochs, cluster.tails())
    assert sorted(msg["rank"] for msg in received(recs, "Exiting")) == list(range(ranks))
    assert recs[-1]["event"] == "end" and recs[-1]["reason"] is None

    replays = replay_run(run_dir)
    assert sorted(replays) == ["coordinator", *(f"rank:{r}" for r in range(ranks))]
    assert {k: r.summary() for k, r in replays.items() if not r.identical} == {}
