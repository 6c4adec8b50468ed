"""``worker.rank``: what a rank does around its loop (the inner optimizer's reset)."""

from __future__ import annotations

import torch
from torch import nn

from flodl_bus.worker.rank import reset_optimizer_state


def test_an_inner_reset_forgets_the_moments_keeps_the_settings_and_trains_on() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 4), torch.randn(8, 2)

    def step() -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    step()
    step()
    assert all(int(s["step"]) == 2 for s in opt.state.values())
    reset_optimizer_state(opt)
    assert len(opt.state) == 0 and opt.param_groups[0]["lr"] == 0.01
    step()  # a fresh optimizer's first step
    assert all(int(s["step"]) == 1 for s in opt.state.values())
