"""The ``cpu`` backend across two real rank processes: staging, background reduce,
``Update`` then ``SyncAck``, overwrite and EASGD adoption."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.params.procs import start_ranks

pytestmark = [pytest.mark.redis, pytest.mark.slow]

NAN = float("nan")

CASES: dict[str, dict[str, Any]] = {
    # rank 1 snapshots 0.3 s late; rank 0 keeps "training" (w := 1000) meanwhile
    "equal_while_training": {
        "ranks": [
            {"w": [1, 2, 3], "steps": 1, "train_to": 1000.0},
            {"w": [3, 4, 5], "steps": 1, "delay": 0.3},
        ]
    },
    "masses": {
        "ranks": [
            {"w": [1, 1, 1], "steps": 3, "running": [2.0], "count": [7]},
            {"w": [5, 5, 5], "steps": 1, "running": [4.0], "count": [9]},
        ]
    },
    "idle_nan": {"ranks": [{"w": [1, 2, 3], "steps": 2}, {"w": [NAN] * 3, "steps": 0}]},
    "zero_mass": {"ranks": [{"w": [1, 2, 3], "steps": 0}, {"w": [7, 8, 9], "steps": 0}]},
    # consensus 2; rank 0 trained on to 10 before adopting: 10 + 0.5 (2 - 10) = 6
    "easgd": {
        "easgd_alpha": 0.5,
        "ranks": [{"w": [0, 0, 0], "steps": 1, "train_to": 10.0}, {"w": [4, 4, 4], "steps": 1}],
    },
    # consensus 2; rank 0 trained on to 10 during the round and keeps those steps on
    # top of it: 2 + (10 - 0) = 12; rank 1 took none and adopts 2 exactly
    "keep_round_steps": {
        "keep_round_steps": True,
        "ranks": [{"w": [0, 0, 0], "steps": 1, "train_to": 10.0}, {"w": [4, 4, 4], "steps": 1}],
    },
}


@pytest.fixture(scope="module")
def rounds(redis_url: str) -> Iterator[list[dict[str, Any]]]:
    ranks = start_ranks(redis_url, "cpu", 2, {"backend": "cpu", "cases": list(CASES.values())})
    try:
        yield ranks.results()
    finally:
        ranks.kill()


def case(rounds: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    i = list(CASES).index(name)
    return [r["cases"][i] for r in rounds]


def test_snapshot_returns_at_once_and_training_goes_on_during_the_reduce(rounds: Any) -> None:
    r0, r1 = case(rounds, "equal_while_training")
    # rank 0 waited for rank 1's late snapshot inside the background thread, not in
    # snapshot(); its params moved on meanwhile without touching what it contributed
    assert r0["snapshot_returned_s"] < 0.25
    assert r0["before_load"]["w"] == [1000.0] * 3
    assert r0["post"]["w"] == r1["post"]["w"] == [2.0, 3.0, 4.0]


def test_params_are_weighted_by_mass_and_buffers_by_movers(rounds: Any) -> None:
    for r in case(rounds, "masses"):
        assert r["post"]["w"] == [2.0, 2.0, 2.0]
        assert r["post"]["running"] == [3.0]
    r0, r1 = case(rounds, "masses")
    assert (r0["post"]["count"], r1["post"]["count"]) == ([7], [9])


def test_an_idle_rank_with_nan_params_cannot_poison_the_consensus(rounds: Any) -> None:
    for r in case(rounds, "idle_nan"):
        assert r["post"]["w"] == [1.0, 2.0, 3.0]
        assert r["realized"]


def test_zero_total_mass_injects_an_unrealized_update_that_changes_nothing(
    rounds: Any,
) -> None:
    for r in case(rounds, "zero_mass"):
        assert r["realized"] is False
        assert r["post"] == r["pre"]
        assert r["ack"][:3] == [None, None, None]


def test_cpu_async_easgd_blends_the_current_local_params_toward_the_consensus(
    rounds: Any,
) -> None:
    r0, r1 = case(rounds, "easgd")
    assert r0["before_load"]["w"] == [10.0] * 3
    assert r0["post"]["w"] == [6.0] * 3
    assert r1["post"]["w"] == [3.0] * 3  # 4 + 0.5 (2 - 4)


def test_steps_taken_during_the_round_stay_on_top_of_the_consensus(rounds: Any) -> None:
    # cpu-cadence trains through its rounds (issue 27): p <- consensus + (p - snapshot)
    r0, r1 = case(rounds, "keep_round_steps")
    assert r0["before_load"]["w"] == [10.0] * 3
    assert r0["post"]["w"] == [12.0] * 3
    assert r1["post"]["w"] == [2.0] * 3  # no step since its snapshot: the consensus
    for r in (r0, r1):
        assert r["consensus"]["w"] == [2.0] * 3  # what an eval or a save scores


def test_the_plane_keeps_the_realized_consensus_not_the_blend(rounds: Any) -> None:
    # flodl's last_consensus: what a consensus save or eval must use under cpu-async
    for r in case(rounds, "easgd"):
        assert r["consensus"]["w"] == [2.0] * 3
    for r in case(rounds, "masses"):
        assert r["consensus"] == {"w": [2.0] * 3, "running": [3.0]}
    # an unrealized round (zero mass) keeps the previous consensus
    prev = case(rounds, "idle_nan")
    for before, r in zip(prev, case(rounds, "zero_mass")):
        assert r["consensus"] == before["consensus"]


def test_update_is_injected_before_the_sync_ack_is_published(rounds: Any) -> None:
    for r in rounds:
        events = [e.split(" ")[0] for e in r["events"]]
        assert events == ["publish:SnapshotReady", "inject:Update", "publish:SyncAck"] * len(CASES)


def test_sync_ack_carries_rank_zero_step_count_and_the_triple(rounds: Any) -> None:
    for rank, r in enumerate(rounds):
        _div, post, _pre, ack_rank, step_count = r["cases"][list(CASES).index("masses")]["ack"]
        assert (ack_rank, step_count) == (rank, 0)
        assert post == pytest.approx(12**0.5)  # consensus (2,2,2,0)
    div0, _, pre0, _, _ = case(rounds, "masses")[0]["ack"]
    assert pre0 == pytest.approx(3**0.5)
    assert div0 == pytest.approx(3**0.5 / 12**0.5)


def test_staging_buffers_are_allocated_once_and_reused_every_round(rounds: Any) -> None:
    for r in rounds:
        staging = [c["staging"] for c in r["cases"]]
        allocations = [c["allocations"] for c in r["cases"]]
        assert all(s == staging[0] for s in staging)
        assert all(a == allocations[0] for a in allocations)
        # no GPU here: plain host memory, still allocated once
        assert not any(c["pinned"] for c in r["cases"])


def test_versions_count_rounds(rounds: Any) -> None:
    for r in rounds:
        assert [c["version"] for c in r["cases"]] == list(range(1, len(CASES) + 1))


def test_loading_the_wrong_number_of_tensors_is_a_value_error(rounds: Any) -> None:
    assert all(r["wrong_count"] == "ValueError" for r in rounds)
