"""cpu-cadence bridges on real processes (issue 27): a coordinator and two gloo ranks,
rank 1 several times slower. Rank 0, its window full while rank 1 still owes steps, is
sent bridge chunks and trains through the round; every sample of each epoch is still
trained exactly once and the record replays."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from flodl_bus.replay import replay_run
from tests.e2e.harness import Cluster, assert_each_sample_once, header, new_run_id, records

pytestmark = [pytest.mark.slow, pytest.mark.redis]

EPOCHS = 3
SLOWED = "tests.e2e.jobs:rank1_slowed_job"


def bridges_sent(recs: Sequence[dict[str, Any]], rank: int) -> int:
    """Chunks the coordinator sent ``rank`` on its report while its window's steps were
    at its count already: the state is rebuilt from each dispatch's changes."""
    state: dict[str, Any] = {}
    sent = 0
    for rec in recs:
        if "after" in rec:
            state.update(rec["after"])
        state.update(rec.get("changed") or {})
        msg = rec.get("msg") or {}
        if msg.get("type") != "Metrics" or rec.get("sender") != rank:
            continue
        out = rec.get("out") or []
        to_rank = [o for o in out if o.get("rank") == rank and o["msg"]["type"] == "StartEpoch"]
        if to_rank and state["steps"][rank] >= state["counts"][rank]:
            sent += 1
    return sent


def test_a_full_window_bridges_each_sample_trained_once_and_the_record_replays(
    cluster: Cluster,
) -> None:
    run = new_run_id("bridges")
    mode = ("--mode", "cpu-cadence")
    coord = cluster.coordinator(
        run, *mode, "--world-size", "2", "--epochs", str(EPOCHS), job=SLOWED
    )
    workers = cluster.ranked_workers(run, 2, *mode)
    codes = cluster.wait([coord, *workers], timeout=120)
    assert codes == [0, 0, 0], cluster.tails()

    run_dir = cluster.run_dir(run)
    recs = records(run_dir)
    assert header(recs)["config"]["cpu_bridges"] is True
    assert bridges_sent(recs, 0) > 0, "rank 0 never bridged"
    assert_each_sample_once(run_dir, 2, EPOCHS, cluster.tails())

    replays = replay_run(run_dir)
    assert sorted(replays) == ["coordinator", "rank:0", "rank:1"]
    assert {k: r.summary() for k, r in replays.items() if not r.identical} == {}
