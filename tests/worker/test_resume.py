"""A rank's saved state (``worker.resume``): optimizer, outer optimizer, random state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from flodl_bus.examples import digits
from flodl_bus.worker.resume import restore_rank_state, save_rank_state, state_path

DATA = digits.train_data()


def _step(model: nn.Module, opt: torch.optim.Optimizer, at: int) -> None:
    x, y = DATA.batch(range(at * 32, at * 32 + 32))
    opt.zero_grad()
    # Dropout draws from torch's random state: restoring it matters.
    out = nn.functional.dropout(model(x), 0.3, training=True)
    nn.functional.cross_entropy(out, y).backward()
    opt.step()


class Outer:
    """A param plane's outer optimizer surface (``TorchParamPort``'s two methods)."""

    def __init__(self, state: dict[str, Any] | None) -> None:
        self.state = state

    def outer_state_dict(self) -> dict[str, Any] | None:
        return self.state

    def load_outer_state_dict(self, state: dict[str, Any]) -> None:
        if self.state is None:
            raise ValueError("this rank has no outer optimizer to restore")
        self.state = dict(state)


def test_a_restored_rank_steps_exactly_as_the_one_that_saved(tmp_path: Path) -> None:
    model = digits.build_model()
    opt = digits.build_optimizer(model)
    for i in range(3):
        _step(model, opt, i)
    stem = tmp_path / "ckpt"
    twin = digits.build_model()  # (seeds torch: built before the save)
    twin.load_state_dict(model.state_dict())
    twin_opt = digits.build_optimizer(twin)
    save_rank_state(stem, 1, opt, Outer({"momentum": torch.ones(3)}))
    for i in range(3, 6):  # the rank that never stopped
        _step(model, opt, i)
    torch.manual_seed(123)  # a different random state, which the restore replaces
    outer = Outer({"momentum": torch.zeros(3)})
    assert restore_rank_state(stem, 1, twin_opt, outer)
    assert torch.equal(outer.state["momentum"], torch.ones(3))  # type: ignore[index]
    for i in range(3, 6):
        _step(twin, twin_opt, i)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_a_fresh_optimizer_alone_does_not_step_the_same(tmp_path: Path) -> None:
    # The restore is what makes the twin equal (Adam's moments), not the model copy.
    model = digits.build_model()
    opt = digits.build_optimizer(model)
    for i in range(3):
        _step(model, opt, i)
    twin = digits.build_model()
    twin.load_state_dict(model.state_dict())
    twin_opt = digits.build_optimizer(twin)
    state = torch.get_rng_state()
    _step(model, opt, 3)
    torch.set_rng_state(state)
    _step(twin, twin_opt, 3)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_no_saved_state_for_the_rank_starts_fresh_and_says_so(tmp_path: Path) -> None:
    opt = digits.build_optimizer(digits.build_model())
    assert not restore_rank_state(tmp_path / "none", 0, opt, None)


def test_a_state_that_does_not_fit_is_refused_naming_the_file(tmp_path: Path) -> None:
    model = digits.build_model()
    opt = digits.build_optimizer(model)
    _step(model, opt, 0)
    stem = tmp_path / "ckpt"
    save_rank_state(stem, 0, opt, Outer({"momentum": torch.ones(3)}))
    other = torch.optim.Adam(nn.Linear(3, 2).parameters())
    with pytest.raises(ValueError, match=r"ckpt\.rank0\.state\.pt: the optimizer state"):
        restore_rank_state(stem, 0, other, None)
    with pytest.raises(ValueError, match="same --outer setting"):
        restore_rank_state(stem, 0, opt, Outer(None))
    torch.save({"schema": 0}, state_path(stem, 0))
    with pytest.raises(ValueError, match="not a rank state of schema"):
        restore_rank_state(stem, 0, opt, None)
