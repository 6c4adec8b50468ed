"""The averaging math against hand-computed values (reference §5)."""

from __future__ import annotations

import math

import pytest
import torch

from flodl_bus.params.averaging import (
    Nesterov,
    OuterAvg,
    SlowMomentum,
    divergence_triple,
    easgd_blend_,
    gamma_mass,
    is_realized,
    make_outer,
    mover_mass,
    sq_sum,
    weight,
)
from flodl_bus.params.flat import FlatBuffers, FlatLayout


def test_gamma_mass_is_the_step_count_at_gamma_one() -> None:
    assert gamma_mass(7) == 7.0
    assert gamma_mass(1, 1.0) == 1.0


def test_gamma_mass_raises_steps_to_gamma() -> None:
    assert gamma_mass(3, 2.0) == 9.0
    assert gamma_mass(4, 0.5) == 2.0


@pytest.mark.parametrize("gamma", [1.0, 0.0, 2.0, -1.0, 0.5])
def test_an_idle_rank_weighs_zero_for_every_gamma(gamma: float) -> None:
    # 0**0 == 1 and 0**-1 == inf: an idle rank must never vote.
    assert gamma_mass(0, gamma) == 0.0
    assert gamma_mass(-3, gamma) == 0.0


def test_mover_mass_is_one_for_any_rank_that_moved() -> None:
    assert mover_mass(0) == 0.0
    assert mover_mass(1) == 1.0
    assert mover_mass(250) == 1.0


def test_a_round_is_realized_only_with_positive_mass() -> None:
    assert not is_realized(0.0)
    assert not is_realized(-1.0)
    assert is_realized(1e-9)


def test_weight_is_own_share_and_zero_without_mass() -> None:
    assert weight(3.0, 4.0) == 0.75
    assert weight(0.0, 4.0) == 0.0
    assert weight(1.0, 0.0) == 0.0


def test_divergence_triple_matches_a_direct_computation() -> None:
    gen = torch.Generator().manual_seed(3)
    pre = [torch.randn(5, 4, generator=gen), torch.randn(7, generator=gen)]
    post = [torch.randn(5, 4, generator=gen), torch.randn(7, generator=gen)]
    flat_pre = torch.cat([t.reshape(-1) for t in pre]).double()
    flat_post = torch.cat([t.reshape(-1) for t in post]).double()
    got = divergence_triple(pre, post)
    assert got.pre_norm == pytest.approx(flat_pre.norm().item(), rel=1e-6)
    assert got.post_norm == pytest.approx(flat_post.norm().item(), rel=1e-6)
    expected = ((flat_pre - flat_post).norm() / flat_post.norm()).item()
    assert got.divergence == pytest.approx(expected, rel=1e-6)


def test_sq_sum_of_mixed_precisions_is_each_norm_widened_exactly_then_summed() -> None:
    gen = torch.Generator().manual_seed(5)
    ts = [
        torch.randn(9, 3, generator=gen),
        torch.randn(11, generator=gen).to(torch.bfloat16),
        torch.randn(4, generator=gen).to(torch.float16),
        torch.arange(6),  # integer buffers count as floats
        torch.empty(0),  # empty tensors count for nothing
    ]
    # the per-tensor double of each float32 norm, summed in order: the old spelling
    norms = [t.float().norm() if not t.is_floating_point() else t.norm() for t in ts[:4]]
    expected = sum(n.double().item() ** 2 for n in norms)
    assert sq_sum(ts) == pytest.approx(expected, rel=1e-12)
    assert sq_sum([torch.empty(0)]) == 0.0


def test_divergence_triple_by_hand() -> None:
    got = divergence_triple([torch.tensor([3.0, 0.0])], [torch.tensor([0.0, 4.0])])
    assert (got.divergence, got.post_norm, got.pre_norm) == (pytest.approx(5 / 4), 4.0, 3.0)


def test_divergence_is_zero_when_the_consensus_norm_is_below_the_floor() -> None:
    got = divergence_triple([torch.tensor([1.0])], [torch.tensor([1e-12])])
    assert got.divergence == 0.0
    assert got.pre_norm == 1.0


def test_easgd_blend_moves_local_alpha_of_the_way_to_the_consensus() -> None:
    local = [torch.tensor([0.0, 10.0]), torch.tensor([4.0])]
    easgd_blend_(local, [torch.tensor([2.0, 2.0]), torch.tensor([0.0])], 0.5)
    assert local[0].tolist() == [1.0, 6.0]
    assert local[1].tolist() == [2.0]
    other = [torch.tensor([8.0])]
    easgd_blend_(other, [torch.tensor([0.0])], 0.25)
    assert other[0].tolist() == [6.0]


def test_easgd_rejects_an_alpha_outside_zero_one() -> None:
    with pytest.raises(ValueError):
        easgd_blend_([torch.zeros(1)], [torch.zeros(1)], 1.5)


def test_outer_avg_is_the_identity() -> None:
    c = [torch.tensor([1.0, 2.0])]
    OuterAvg().step_(c)
    OuterAvg().step_(c)
    assert c[0].tolist() == [1.0, 2.0]


def test_nesterov_takes_no_step_in_the_first_window_then_follows_diloco() -> None:
    opt = Nesterov()  # lr 0.7, momentum 0.9
    assert (opt.lr, opt.momentum) == (0.7, 0.9)
    c1 = [torch.tensor([10.0], dtype=torch.float64)]
    opt.step_(c1)
    assert c1[0].item() == 10.0  # first window: prev := consensus, no step
    c2 = [torch.tensor([8.0], dtype=torch.float64)]
    opt.step_(c2)
    # g = 10 - 8 = 2; v = 2; new = 10 - 0.7 * (0.9*2 + 2) = 7.34
    assert c2[0].item() == pytest.approx(7.34)
    c3 = [torch.tensor([7.0], dtype=torch.float64)]
    opt.step_(c3)
    # g = 7.34 - 7 = 0.34; v = 0.9*2 + 0.34 = 2.14; new = 7.34 - 0.7*(0.9*2.14 + 0.34) = 5.7538
    assert c3[0].item() == pytest.approx(5.7538)


def test_slow_momentum_steps_by_the_velocity() -> None:
    opt = SlowMomentum(lr=1.0, momentum=0.9)
    opt.step_([torch.tensor([10.0], dtype=torch.float64)])
    c2 = [torch.tensor([8.0], dtype=torch.float64)]
    opt.step_(c2)
    assert c2[0].item() == pytest.approx(8.0)  # v = 2; 10 - 2
    c3 = [torch.tensor([8.0], dtype=torch.float64)]
    opt.step_(c3)
    assert c3[0].item() == pytest.approx(6.2)  # g = 0; v = 1.8; 8 - 1.8


def test_outer_momentum_survives_a_state_dict_round_trip() -> None:
    windows = [torch.tensor([10.0]), torch.tensor([8.0]), torch.tensor([7.0]), torch.tensor([9.0])]
    straight = Nesterov()
    expected = []
    for w in windows:
        c = [w.clone()]
        straight.step_(c)
        expected.append(c[0].item())
    first = Nesterov()
    for w in windows[:2]:
        first.step_([w.clone()])
    restored = Nesterov(lr=0.1, momentum=0.1)  # hyper-parameters come from the state too
    restored.load_state_dict(first.state_dict())
    got = []
    for w in windows[2:]:
        c = [w.clone()]
        restored.step_(c)
        got.append(c[0].item())
    assert got == pytest.approx(expected[2:])


def test_outer_state_of_another_optimizer_is_refused() -> None:
    with pytest.raises(ValueError):
        Nesterov().load_state_dict(SlowMomentum().state_dict())


def test_make_outer_by_name() -> None:
    assert make_outer(None) is None
    assert make_outer("none") is None
    assert isinstance(make_outer("avg"), OuterAvg)
    nesterov = make_outer("nesterov", lr=0.5)
    assert isinstance(nesterov, Nesterov) and nesterov.lr == 0.5
    with pytest.raises(ValueError):
        make_outer("adam")


def test_flat_buffers_group_by_dtype_and_views_alias_the_buffers() -> None:
    tensors = [torch.ones(2, 3), torch.zeros(4, dtype=torch.float64), torch.full((1,), 5.0)]
    layout = FlatLayout(tensors)
    assert layout.groups() == [(torch.float32, 7), (torch.float64, 4)]
    bufs = FlatBuffers(layout, torch.device("cpu"))
    bufs.load_from(tensors)
    assert bufs.flats[0].tolist() == [1.0] * 6 + [5.0]
    bufs.flats[0].mul_(2)
    out = [torch.empty_like(t) for t in tensors]
    bufs.store_into(out)
    assert out[0].tolist() == [[2.0] * 3] * 2 and out[2].item() == 10.0
    assert bufs.views[0].data_ptr() == bufs.flats[0].data_ptr()
    with pytest.raises(ValueError):
        bufs.load_from(tensors[:2])
    assert not math.isnan(bufs.flats[1].sum().item())
