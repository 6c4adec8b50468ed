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


def chunks_sent(recs: Sequence[dict[str, Any]], rank: int) -> list[tuple[list[int], list[int]]]:
    """The window's steps and counts as the coordinator sent ``rank`` each chunk, whatever
    message the dispatch answered: the state is rebuilt from each dispatch's changes."""
    state: dict[str, Any] = {}
    sent = []
    for rec in recs:
        if "after" in rec:
            state.update(rec["after"])
        state.update(rec.get("changed") or {})
        out = rec.get("out") or []
        if any(o.get("rank") == rank and o["msg"]["type"] == "StartEpoch" for o in out):
            sent.append((list(state["steps"]), list(state["counts"])))
    return sent


def bridges_sent(recs: Sequence[dict[str, Any]], rank: int) -> int:
    """Chunks sent ``rank`` while its window's steps were at its count already."""
    return sum(steps[rank] >= counts[rank] for steps, counts in chunks_sent(recs, rank))


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
    # What the windows looked like at each chunk, should rank 0 never have been full.
    assert bridges_sent(recs, 0) > 0, f"rank 0 never bridged: {chunks_sent(recs, 0)}"
    assert_each_sample_once(run_dir, 2, EPOCHS, cluster.tails())

    replays = replay_run(run_dir)
    assert sorted(replays) == ["coordinator", "rank:0", "rank:1"]
    assert {k: r.summary() for k, r in replays.items() if not r.identical} == {}
