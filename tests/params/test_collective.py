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


# ------------------------------------------- an outer optimizer after a split round


class _SplitOnce:
    """A rank's sessions for the test below: the real pair, but its second round is the
    split one, completed on the survivor alone (``solo``: a one-rank group, its own
    consensus) and kept local on the other (``RoundSplit``: what the session manager
    raises there, ``test_groups`` makes it happen for real)."""

    def __init__(self, real: Any, solo: Any | None) -> None:
        self.real, self.solo, self.calls = real, solo, 0

    def run(self, attempt: Any) -> Any:
        from flodl_bus.params.groups import RoundSplit

        self.calls += 1
        if self.calls != 2:
            return self.real.run(attempt)
        if self.solo is None:
            raise RoundSplit("the round completed on a peer only")
        return self.solo.run(attempt)


def _sync_round(avgs: list[Any], steps: int) -> None:
    from tests.params.test_groups import _both

    got = _both(*(lambda a=a: a.sync_now(steps) for a in avgs))
    assert not any(isinstance(g, Exception) for g in got), got


def _cpu_round(avgs: list[Any], steps: int) -> None:
    for a in avgs:
        a.snapshot(steps)
    for a in avgs:
        assert a.wait_idle(30)
        update = a.updates[-1]
        if update.avg.realized:  # what the rank's loop does with the Update
            with torch.no_grad():
                for p, c in zip(a.params, update.avg.params, strict=True):
                    p.copy_(c)


@pytest.mark.parametrize("plane", ["sync-now", "cpu-bf16"])
def test_a_rank_that_kept_a_split_round_local_restarts_every_outer_optimizer_with_it(
    redis_url: str, plane: str
) -> None:
    """An outer optimizer is replicated: each rank steps its own on the same consensus.
    A round that completed on a survivor and was kept local on the other (a death inside
    the collective) stepped one and not the other, and every later round stepped them
    apart again, so the two ranks never again held the same model. The next realized
    round restarts the outer optimizer on every rank (the consensus as is, momentum
    dropped), after which they step as one."""
    from flodl_bus.params.averaging import Nesterov
    from flodl_bus.params.collective import CollectiveSync
    from flodl_bus.params.cpu_avg import CpuAverager
    from tests.params.test_groups import _manager, _pair

    pair = _pair(redis_url, timeout=20.0, cap=3.0)
    solo = _manager(redis_url)
    weights = [torch.nn.Parameter(torch.full((3,), v)) for v in (9.0, 11.0)]
    sessions = [_SplitOnce(pair[0], solo), _SplitOnce(pair[1], None)]
    avgs: list[Any] = []
    try:
        for r, (w, s) in enumerate(zip(weights, sessions, strict=True)):
            if plane == "sync-now":
                avgs.append(CollectiveSync([w], [], s, outer=Nesterov(), timeout=20.0))  # type: ignore[arg-type]
                continue
            updates: list[Any] = []
            a = CpuAverager(
                [w], [], s, rank=r, inject=updates.append, publish=lambda m: None,  # type: ignore[arg-type]
                outer=Nesterov(), bf16_wire=True, timeout=20.0,
            )  # fmt: skip
            a.updates = updates  # type: ignore[attr-defined]
            avgs.append(a)
        one_round = _sync_round if plane == "sync-now" else _cpu_round
        one_round(avgs, 1)  # the first window: both anchor at the consensus, 10
        with torch.no_grad():
            weights[0].fill_(7.0)
            weights[1].fill_(9.0)
        one_round(avgs, 1)  # split: survivor 0 steps on its own 7; rank 1 keeps its 9
        assert (avgs[0].outer_behind, avgs[1].outer_behind) == (False, True)
        with torch.no_grad():
            weights[0].fill_(5.0)
            weights[1].fill_(7.0)
        one_round(avgs, 1)  # consensus 6 on both: both restart there
        assert [w.tolist() for w in weights] == [[6.0] * 3] * 2
        assert not avgs[1].outer_behind
        with torch.no_grad():
            weights[0].fill_(3.0)
            weights[1].fill_(5.0)
        one_round(avgs, 1)  # consensus 4: one outer step, the same on both
        # g = 6 - 4 = 2, v = 2: new = 6 - 0.7 * (0.9 * 2 + 2) = 3.34
        assert weights[0].tolist() == pytest.approx([3.34] * 3)
        assert weights[0].tolist() == weights[1].tolist()
        outers = [a.outer for a in avgs]
        assert [o.prev[0].tolist() for o in outers] == [weights[0].tolist()] * 2
        assert outers[0].velocity[0].tolist() == outers[1].velocity[0].tolist()
    finally:
        for a in avgs:
            close = getattr(a, "close", None)
            if close is not None:
                close()
        for m in (*pair, solo):
            m.close()
