"""Admission: ranks in arrival order, dataset signatures, claimed ranks, when the world forms."""

from __future__ import annotations

import pytest

from flodl_bus.coordinator.membership import Admission
from flodl_bus.protocol.messages import Assign, Hello, Reject

SIG = "a1b2c3d4e5f60718"


def hello(wid: str, sig: str = SIG, rank: int | None = None) -> Hello:
    return Hello(worker_id=wid, host="h", dataset_sig=sig, device="cpu", requested_rank=rank)


def test_ranks_follow_arrival_order_and_assigns_wait_for_the_whole_world() -> None:
    adm = Admission(dataset_sig=SIG, world_size=3)
    assert adm.hello(hello("c"), 0.0) == []
    assert adm.hello(hello("a"), 0.1) == []
    assert not adm.formed
    out = adm.hello(hello("b"), 0.2)
    assert out == [Assign("c", 0, 3), Assign("a", 1, 3), Assign("b", 2, 3)]
    assert adm.formed and adm.world_size == 3
    assert [m.worker_id for m in adm.members] == ["c", "a", "b"]


def test_a_dataset_mismatch_is_refused_at_once_naming_both_signatures() -> None:
    adm = Admission(dataset_sig=SIG, world_size=2)
    (out,) = adm.hello(hello("x", sig="ffff000011112222"), 0.0)
    assert isinstance(out, Reject) and out.worker_id == "x"
    assert "ffff000011112222" in out.reason and SIG in out.reason
    assert "does not match" in out.reason
    assert adm.joined == 0  # the refused worker holds no slot


def test_a_model_mismatch_is_refused_naming_both_and_an_unknown_one_is_not_compared() -> None:
    adm = Admission(dataset_sig=SIG, world_size=2, model_sig="m0")
    other = Hello(worker_id="x", host="h", dataset_sig=SIG, model_sig="m1")
    (out,) = adm.hello(other, 0.0)
    assert isinstance(out, Reject) and "model signature m1" in out.reason and "m0" in out.reason
    # a worker before the field, or a build that could not be told: admitted
    assert adm.hello(Hello(worker_id="a", host="h", dataset_sig=SIG), 0.1) == []
    same = Hello(worker_id="b", host="h", dataset_sig=SIG, model_sig="m0")
    assert [type(o) for o in adm.hello(same, 0.2)] == [Assign, Assign]


def test_claimed_ranks_are_kept_and_joiners_fill_the_free_ones() -> None:
    adm = Admission(dataset_sig=SIG, world_size=3)
    adm.hello(hello("j1"), 0.0)
    adm.hello(hello("s0", rank=0), 0.1)
    out = adm.hello(hello("j2"), 0.2)
    assert sorted((a.rank, a.worker_id) for a in out if isinstance(a, Assign)) == [
        (0, "s0"),
        (1, "j1"),
        (2, "j2"),
    ]


@pytest.mark.parametrize(
    ("first", "second", "why"),
    [(1, 1, "already taken by worker s"), (None, 5, "outside the world of 2")],
)
def test_a_bad_claim_is_refused(first: int | None, second: int, why: str) -> None:
    adm = Admission(dataset_sig=SIG, world_size=2)
    adm.hello(hello("s", rank=first), 0.0)
    (out,) = adm.hello(hello("t", rank=second), 0.1)
    assert isinstance(out, Reject) and why in out.reason


def test_a_repeated_hello_is_a_retry_not_a_second_worker() -> None:
    adm = Admission(dataset_sig=SIG, world_size=2)
    adm.hello(hello("a"), 0.0)
    assert adm.hello(hello("a"), 0.1) == []
    assert adm.joined == 1


def test_min_workers_forms_only_after_the_join_timeout() -> None:
    adm = Admission(dataset_sig=SIG, min_workers=2, join_timeout=5.0)
    adm.open(0.0)
    adm.hello(hello("a"), 1.0)
    adm.hello(hello("b"), 2.0)
    assert adm.poll(4.9) == []
    adm.hello(hello("c"), 4.95)
    out = adm.poll(5.0)
    assert [(a.worker_id, a.rank, a.world_size) for a in out if isinstance(a, Assign)] == [
        ("a", 0, 3),
        ("b", 1, 3),
        ("c", 2, 3),
    ]


def test_min_workers_keeps_waiting_past_the_timeout_until_enough_joined() -> None:
    adm = Admission(dataset_sig=SIG, min_workers=2, join_timeout=1.0)
    adm.open(0.0)
    adm.hello(hello("a"), 0.5)
    assert adm.poll(10.0) == []
    out = adm.hello(hello("b"), 11.0)  # the timeout is long past: forms at once
    assert [a.rank for a in out if isinstance(a, Assign)] == [0, 1]


def test_after_forming_a_late_worker_is_refused_and_a_member_gets_its_assign_again() -> None:
    adm = Admission(dataset_sig=SIG, world_size=1)
    adm.hello(hello("a"), 0.0)
    (late,) = adm.hello(hello("z"), 1.0)
    assert isinstance(late, Reject) and "already formed with 1 ranks" in late.reason
    assert adm.hello(hello("a"), 2.0) == [Assign("a", 0, 1)]


def test_a_claim_outside_a_world_formed_at_min_workers_is_refused_and_it_waits_on() -> None:
    adm = Admission(dataset_sig=SIG, min_workers=2, join_timeout=1.0)
    adm.open(0.0)
    adm.hello(hello("a"), 0.1)
    adm.hello(hello("s", rank=4), 0.2)
    out = adm.poll(1.0)
    assert [type(a) for a in out] == [Reject]
    assert not adm.formed and adm.joined == 1
    out = adm.hello(hello("b"), 2.0)
    assert [a.rank for a in out if isinstance(a, Assign)] == [0, 1]


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"world_size": 0}, {"min_workers": 0}, {"world_size": 2, "min_workers": 3}],
)
def test_impossible_worlds_are_refused_up_front(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        Admission(dataset_sig=SIG, **kwargs)  # type: ignore[arg-type]


def scored(wid: str, score: float | None, rank: int | None = None) -> Hello:
    return Hello(worker_id=wid, host="h", dataset_sig=SIG, requested_rank=rank, device_score=score)


def test_device_scores_come_in_rank_order_once_formed_and_only_when_every_member_told_one() -> None:
    adm = Admission(dataset_sig=SIG, world_size=3)
    adm.hello(scored("a", 884.0), 0.0)
    adm.hello(scored("b", 880.0, rank=0), 0.1)  # claims rank 0: "a" and "c" follow it
    assert adm.device_scores is None  # not formed yet
    adm.hello(scored("c", 1039.5), 0.2)
    assert [(m.worker_id, m.rank, m.device_score) for m in adm.members] == [
        ("b", 0, 880.0),
        ("a", 1, 884.0),
        ("c", 2, 1039.5),
    ]
    assert adm.device_scores == (880.0, 884.0, 1039.5)

    # one CPU worker (no score) and the world has no prior
    mixed = Admission(dataset_sig=SIG, world_size=2)
    mixed.hello(scored("a", 884.0), 0.0)
    mixed.hello(scored("b", None), 0.1)
    assert mixed.formed and mixed.device_scores is None
