"""``replay.coverage``: every sample of every epoch trained once, read off a run's files.

The run directories here are written by the real recorder (a chained record) and hold
a ``metrics.csv`` as the coordinator writes it; what they say is made up so that each
way of breaking the guarantee can be shown to be caught."""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flodl_bus.coordinator.config import CoordinatorConfig
from flodl_bus.record.log import Recorder
from flodl_bus.replay.coverage import problems, sent_plans, shares, tiles

BATCH = 10
SIZE = 100  # samples of an epoch: 10 batches of 10


def _plan(rank: int, epoch: int, offset: int, size: int) -> dict[str, Any]:
    plan = {"epoch": epoch, "partition_offset": offset, "partition_size": size}
    return {"kind": "Send", "rank": rank, "msg": {"type": "StartEpoch", "plan": plan}}


def _run(
    tmp_path: Path,
    sends: Sequence[dict[str, Any]],
    trained: Sequence[Sequence[int]],
    mode: str = "cpu-cadence",
) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = CoordinatorConfig(
        mode=mode, world_size=3, total_samples=SIZE, batch_size=BATCH, num_epochs=2
    )
    rec = Recorder(tmp_path / "coordinator.jsonl")
    rec.record("run", role="coordinator", config=dataclasses.asdict(cfg))
    for out in sends:
        if out.get("kind") == "heard":  # a Batch the coordinator read from a rank
            rec.record("dispatch", msg={"type": "Batch", "rank": out["rank"]}, out=[])
        else:
            rec.record("dispatch", out=[out])
    rec.close()
    with (tmp_path / "metrics.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["epoch", "samples_r0", "samples_r1", "samples_r2"])
        for e, row in enumerate(trained):
            w.writerow([e, *row])
    return tmp_path


def _whole_epochs() -> list[dict[str, Any]]:
    return [
        _plan(0, 0, 0, 40),
        _plan(1, 0, 40, 30),
        _plan(2, 0, 70, 30),
        _plan(0, 1, 0, 50),
        _plan(1, 1, 50, 50),
    ]


def test_a_run_that_trained_each_sample_once_has_no_problem(tmp_path: Path) -> None:
    run = _run(tmp_path, _whole_epochs(), [[40, 30, 30], [50, 50, 0]])
    assert problems(run, 3, 2) == []


def test_a_range_sent_twice_is_caught_even_when_the_counts_add_up(tmp_path: Path) -> None:
    sends = _whole_epochs()
    sends[4] = _plan(1, 1, 40, 50)  # overlaps rank 0's 0..50 and leaves 90..100 out
    run = _run(tmp_path, sends, [[40, 30, 30], [50, 50, 0]])
    assert problems(run, 3, 2) == ["epoch 1: the ranges sent do not cover the epoch exactly once"]


def test_samples_lost_or_counted_twice_are_named_with_their_epoch(tmp_path: Path) -> None:
    run = _run(tmp_path, _whole_epochs(), [[40, 30, 20], [50, 60, 0]])
    found = problems(run, 3, 2)
    assert "epoch 0: the ranks trained 90 samples of 100 [40, 30, 20]" in found
    assert "epoch 1: the ranks trained 110 samples of 100 [50, 60, 0]" in found


def _heard(rank: int, n: int) -> list[dict[str, Any]]:
    return [{"kind": "heard", "rank": rank}] * n


def _death(resent: int, heard: int, cfg: str = "cpu-sync") -> list[dict[str, Any]]:
    """Rank 2 is sent 70..100, is heard train ``heard`` batches, dies; 100 - resent..100
    goes to rank 1 again."""
    return [
        *_whole_epochs()[:3],
        *_heard(2, heard),
        _plan(1, 0, 100 - resent, resent),
        *_whole_epochs()[3:],
    ]


def test_an_epoch_a_rank_died_in_keeps_what_the_coordinator_heard_it_train(
    tmp_path: Path,
) -> None:
    # Without progressive dispatch (cpu-sync): rank 2 trained one batch of its three
    # and never reported; its other two went to rank 1. metrics.csv's counts fall short
    # by the dead rank's batch, which the coordinator heard and kept as trained.
    run = _run(tmp_path, _death(20, 1), [[40, 50, 0], [50, 50, 0]], "cpu-sync")
    assert problems(run, 3, 2, dead=[2]) == []
    # A dead rank that reported more than it was heard train is caught.
    liar = _run(tmp_path / "b", _death(20, 1), [[40, 50, 20], [50, 50, 0]], "cpu-sync")
    assert "epoch 0: dead rank 2 reported 20, more than it trained" in problems(
        liar, 3, 2, dead=[2]
    )
    # Without knowing of the death the re-sent range is an overlap.
    assert problems(run, 3, 2) != []


def test_a_dead_ranks_batch_neither_heard_nor_sent_again_is_a_loss(tmp_path: Path) -> None:
    run = _run(tmp_path, _death(10, 1), [[40, 40, 0], [50, 50, 0]], "cpu-sync")
    # Rank 1 was sent 90..100 only: 80..90 is neither re-sent nor heard trained.
    assert problems(run, 3, 2, dead=[2]) == [
        "epoch 0: the survivors were not sent 20 samples, but the dead rank(s) [2] "
        "trained 10 of them"
    ]


def test_with_progressive_dispatch_a_dead_ranks_chunk_in_flight_is_not_its_own(
    tmp_path: Path,
) -> None:
    # cpu-cadence: the chunk rank 2 died in is forfeited whole and served again, so the
    # batch it was heard train there is not kept: the whole chunk went to rank 1.
    good = _run(tmp_path / "a", _death(30, 1), [[40, 60, 0], [50, 50, 0]], "cpu-cadence")
    assert problems(good, 3, 2, dead=[2]) == []
    # Served again only in part: the batch heard does not make up for the rest.
    short = _run(tmp_path / "b", _death(20, 1), [[40, 50, 0], [50, 50, 0]], "cpu-cadence")
    assert problems(short, 3, 2, dead=[2]) == [
        "epoch 0: the survivors were not sent 10 samples, but the dead rank(s) [2] "
        "trained 0 of them"
    ]


def test_a_missing_epoch_row_is_a_problem(tmp_path: Path) -> None:
    run = _run(tmp_path, _whole_epochs(), [[40, 30, 30]])
    assert problems(run, 3, 2) == ["metrics.csv holds epochs [0], not 0..1"]


def test_plans_riding_an_update_and_extensions_count_for_their_rank() -> None:
    plan = {"epoch": 3, "partition_offset": 0, "partition_size": 10}
    recs = [
        {"event": "dispatch", "out": [_plan(0, 3, 10, 5)]},
        {
            "event": "tick",
            "out": [{"kind": "Send", "rank": 1, "msg": {"type": "Update", "next_plan": plan}}],
        },
        {
            "event": "dispatch",
            "out": [
                {
                    "kind": "Send",
                    "rank": 0,
                    "msg": {"type": "ExtendPartition", "partition_offset": 15, "partition_size": 5},
                }
            ],
        },
    ]
    assert sent_plans(recs) == {3: {0: [(10, 5), (15, 5)], 1: [(0, 10)]}}
    assert tiles([(10, 5), (15, 5), (0, 10)], [(0, 20)])
    assert not tiles([(0, 10), (5, 10)], [(0, 15)])


def test_shares_are_each_ranks_part_of_the_epoch() -> None:
    assert shares({"samples_r0": "75", "samples_r1": "25"}, 2) == [0.75, 0.25]
    assert shares({"samples_r0": "", "samples_r1": "0"}, 2) == [0.0, 0.0]


def test_a_rank_credited_with_samples_it_was_not_sent_is_caught(tmp_path: Path) -> None:
    run = _run(tmp_path, _whole_epochs(), [[30, 40, 30], [50, 50, 0]])
    assert problems(run, 3, 2) == ["epoch 0: trained [30, 40, 30], sent [40, 30, 30]"]
