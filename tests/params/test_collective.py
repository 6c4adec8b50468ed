"""``SyncNow`` (the in-place path) across two real rank processes on gloo."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from flodl_bus.params.averaging import divergence_triple
from tests.params.procs import start_ranks

pytestmark = [pytest.mark.redis, pytest.mark.slow]

NAN = float("nan")

CASES: dict[str, dict[str, Any]] = {
    "equal": {"ranks": [{"w": [1, 2, 3], "steps": 1}, {"w": [3, 4, 5], "steps": 1}]},
    "masses": {
        "ranks": [
            {"w": [1, 1, 1], "b": [1.0], "steps": 3, "running": [2.0], "count": [7]},
            {"w": [5, 5, 5], "b": [5.0], "steps": 1, "running": [4.0], "count": [9]},
        ]
    },
    "idle_nan": {
        "ranks": [
            {"w": [1, 2, 3], "steps": 2, "running": [6.0]},
            {"w": [NAN] * 3, "b": [NAN], "steps": 0, "running": [NAN]},
        ]
    },
    "zero_mass": {"ranks": [{"w": [1, 2, 3], "steps": 0}, {"w": [7, 8, 9], "steps": 0}]},
    "gamma2": {
        "gamma": 2.0,
        "ranks": [{"w": [1, 1, 1], "steps": 3}, {"w": [5, 5, 5], "steps": 1}],
    },
}


@pytest.fixture(scope="module")
def synced(redis_url: str) -> Iterator[dict[str, list[dict[str, Any]]]]:
    """Every case run once, in order, on the same two ranks and group."""
    ranks = start_ranks(redis_url, "sync", 2, {"cases": list(CASES.values())})
    try:
        per_rank = ranks.results()
    finally:
        ranks.kill()
    yield {name: [per_rank[r][i] for r in range(2)] for i, name in enumerate(CASES)}


def test_equal_masses_give_the_plain_mean_on_every_rank(synced: Any) -> None:
    for rank in synced["equal"]:
        assert rank["post"]["w"] == [2.0, 3.0, 4.0]


def test_the_plane_keeps_each_collectives_result_as_the_last_consensus(synced: Any) -> None:
    for name, ranks in synced.items():
        for rank in ranks:
            assert rank["consensus"]["w"] == rank["post"]["w"], name
            assert rank["consensus"]["running"] == rank["post"]["running"], name


def test_params_are_weighted_by_steps_since_the_last_average(synced: Any) -> None:
    # (3*1 + 1*5) / 4 = 2
    for rank in synced["masses"]:
        assert rank["post"]["w"] == [2.0, 2.0, 2.0]
        assert rank["post"]["b"] == [2.0]


def test_f32_buffers_are_averaged_equally_over_movers_and_int_buffers_stay_local(
    synced: Any,
) -> None:
    r0, r1 = synced["masses"]
    assert r0["post"]["running"] == r1["post"]["running"] == [3.0]  # (2 + 4) / 2, not 2.5
    assert (r0["post"]["count"], r1["post"]["count"]) == ([7], [9])


def test_an_idle_rank_cannot_change_the_consensus_even_with_nan_params(synced: Any) -> None:
    for rank in synced["idle_nan"]:
        assert rank["post"]["w"] == [1.0, 2.0, 3.0]
        assert rank["post"]["running"] == [6.0]  # the idle rank did not move: no buffer vote


def test_zero_total_mass_leaves_every_rank_unchanged_and_reports_no_triple(
    synced: Any,
) -> None:
    for rank in synced["zero_mass"]:
        assert rank["post"] == rank["pre"]
        assert rank["triple"] == [None, None, None]


def test_gamma_exponent_reweights_the_masses(synced: Any) -> None:
    # masses 3**2 = 9 and 1**2 = 1: (9*1 + 1*5) / 10 = 1.4
    for rank in synced["gamma2"]:
        assert rank["post"]["w"] == pytest.approx([1.4] * 3)


def _params(obs: dict[str, Any]) -> list[torch.Tensor]:
    return [
        torch.tensor([float(x) for x in obs["w"]]),
        torch.tensor([float(x) for x in obs["b"]]),
    ]


def test_each_rank_reports_the_triple_of_its_own_pre_sync_params(synced: Any) -> None:
    for name in ("equal", "masses"):
        for rank in synced[name]:
            direct = divergence_triple(_params(rank["pre"]), _params(rank["post"]))
            got = rank["triple"]
            assert got == pytest.approx([direct.divergence, direct.post_norm, direct.pre_norm])
    # by hand for rank 0 of "equal": pre (1,2,3,0), post (2,3,4,0)
    div, post, pre = synced["equal"][0]["triple"]
    assert pre == pytest.approx(math.sqrt(14))
    assert post == pytest.approx(math.sqrt(29))
    assert div == pytest.approx(math.sqrt(3) / math.sqrt(29))


def test_outer_nesterov_step_is_replicated_identically_on_every_rank(redis_url: str) -> None:
    windows = [
        {"ranks": [{"w": [9, 9, 9], "steps": 1}, {"w": [11, 11, 11], "steps": 1}]},  # c = 10
        {"ranks": [{"w": [7, 7, 7], "steps": 1}, {"w": [9, 9, 9], "steps": 1}]},  # c = 8
    ]
    ranks = start_ranks(redis_url, "sync", 2, {"cases": windows, "outer": "nesterov"})
    try:
        r0, r1 = ranks.results()
    finally:
        ranks.kill()
    assert r0[0]["post"]["w"] == r1[0]["post"]["w"] == [10.0] * 3  # first window: no step
    # g = 10 - 8 = 2, v = 2: new = 10 - 0.7 * (0.9 * 2 + 2) = 7.34
    assert r0[1]["post"]["w"] == pytest.approx([7.34] * 3)
    assert r0[1]["post"]["w"] == r1[1]["post"]["w"]
    # the divergence is measured against the consensus, before the outer step
    assert r0[1]["triple"][1] == pytest.approx(math.sqrt(3 * 64))
    # DiLoCo: the inner optimizer starts afresh after every adopted consensus
    assert [w["inner_resets"] for w in r0] == [w["inner_resets"] for w in r1] == [1, 2]


def test_slow_momentum_keeps_the_inner_optimizer_and_an_unrealized_round_resets_nothing(
    redis_url: str,
) -> None:
    windows = [
        {"ranks": [{"w": [9, 9, 9], "steps": 1}, {"w": [11, 11, 11], "steps": 1}]},
        {"ranks": [{"w": [7, 7, 7], "steps": 1}, {"w": [9, 9, 9], "steps": 1}]},
    ]
    ranks = start_ranks(redis_url, "sync", 2, {"cases": windows, "outer": "slow-momentum"})
    try:
        r0, _ = ranks.results()
    finally:
        ranks.kill()
    assert [w["inner_resets"] for w in r0] == [0, 0]
    idle = [{"ranks": [{"w": [1, 2, 3], "steps": 0}, {"w": [7, 8, 9], "steps": 0}]}]
    ranks = start_ranks(redis_url, "sync", 2, {"cases": idle, "outer": "nesterov"})
    try:
        r0, _ = ranks.results()
    finally:
        ranks.kill()
    assert [w["inner_resets"] for w in r0] == [0]  # zero mass: nothing adopted


# -------------------------------------------------- the model's tensors live in the flats


@pytest.fixture
def alone(redis_url: str) -> Iterator[Any]:
    """A one-rank gloo group and a CollectiveSync over a linear layer and a buffer."""
    import uuid

    from flodl_bus.params import collective as col
    from flodl_bus.params.forming import store_base
    from flodl_bus.params.groups import SessionManager

    sessions = SessionManager(
        redis_url, store_base(f"alone-{uuid.uuid4().hex[:8]}"), 0, 1, backend="gloo"
    )
    layer = torch.nn.Linear(3, 2)
    running = torch.full((4,), 2.0)
    sync = col.CollectiveSync(list(layer.parameters()), [running], sessions, timeout=20.0)
    try:
        yield sync, layer, running
    finally:
        sessions.close()


def test_a_round_points_the_model_at_the_other_flat_with_no_copy_and_keeps_identities(
    alone: Any,
) -> None:
    sync, layer, running = alone
    weight, bias = layer.weight, layer.bias
    before = [p.detach().clone() for p in (weight, bias)]
    res = sync.sync_now(3)
    # one rank: the consensus is its own params, so the triple is (0, norm, norm)
    norm = math.sqrt(sum(float(t.square().sum()) for t in before))
    assert res.divergence == 0.0
    assert res.post_norm == pytest.approx(norm) and res.pre_norm == pytest.approx(norm)
    assert layer.weight is weight and layer.bias is bias
    assert torch.equal(weight.detach(), before[0]) and torch.equal(bias.detach(), before[1])
    live_p, live_b = sync.live
    first = live_p.data_ptrs()
    assert weight.data_ptr() == live_p.views[0].data_ptr()
    assert running.data_ptr() == live_b.views[0].data_ptr()
    sync.sync_now(1)
    assert sync.live[0].data_ptrs() != first  # the two flats take turns


def test_a_tensor_pointed_elsewhere_between_rounds_is_adopted_with_its_values(
    alone: Any,
) -> None:
    sync, layer, _running = alone
    sync.sync_now(1)
    with torch.no_grad():
        layer.weight.data = torch.full((2, 3), 7.0)  # e.g. a loader that replaces tensors
    sync.sync_now(1)
    assert torch.equal(layer.weight.detach(), torch.full((2, 3), 7.0))
    assert layer.weight.data_ptr() == sync.live[0].views[0].data_ptr()


def test_a_sync_that_completed_on_a_peer_only_leaves_the_model_as_it_was() -> None:
    """``RoundSplit`` from the session manager (the round completed on a survivor before
    the group broke, so nobody will join its retry): the rank keeps its own parameters
    for the round and reports it unrealized, instead of failing."""
    from flodl_bus.params.collective import UNREALIZED, CollectiveSync
    from flodl_bus.params.groups import RoundSplit

    class SplitSessions:
        def run(self, attempt: Any) -> bool:
            raise RoundSplit("the round completed on a peer only")

    w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    sync = CollectiveSync([w], [], SplitSessions())  # type: ignore[arg-type]
    assert sync.sync_now(3) == UNREALIZED
    assert w.tolist() == [1.0, 2.0, 3.0]
