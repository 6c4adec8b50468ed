"""A rank's saved state (``worker.resume``): optimizer, outer optimizer, random state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from flodl_bus.examples import digits
from flodl_bus.params.averaging import Nesterov
from flodl_bus.worker.resume import restore_rank_state, save_rank_state, state_path

DATA = digits.train_data()


def _step(model: nn.Module, opt: torch.optim.Optimizer, at: int) -> None:
    x, y = DATA.batch(range(at * 32, at * 32 + 32))
    opt.zero_grad()
    # Dropout draws from torch's random state: restoring it matters.
    out = nn.functional.dropout(model(x), 0.3, training=True)
    nn.functional.cross_entropy(out, y).backward()
    opt.step()


class Plane:
    """The param plane's outer-optimizer surface (``TorchParamPort``'s two methods)
    around a real outer optimizer (None: a plane without one)."""

    def __init__(self, outer: Nesterov | None) -> None:
        self.outer = outer

    def outer_state_dict(self) -> dict[str, Any] | None:
        return None if self.outer is None else self.outer.state_dict()

    def load_outer_state_dict(self, state: dict[str, Any]) -> None:
        if self.outer is None:
            raise ValueError("this rank has no outer optimizer to restore")
        self.outer.load_state_dict(state)


def _outer_rounds(outer: Nesterov, model: nn.Module, rounds: int) -> list[torch.Tensor]:
    consensus = [p.detach().clone() for p in model.parameters()]
    for k in range(rounds):
        consensus = [c - 0.01 * (k + 1) for c in consensus]
        outer.step_(consensus)
    return consensus


def test_a_restored_rank_steps_exactly_as_the_one_that_saved(tmp_path: Path) -> None:
    model = digits.build_model()
    opt = digits.build_optimizer(model)
    for i in range(3):
        _step(model, opt, i)
    stem = tmp_path / "ckpt"
    twin = digits.build_model()  # (seeds torch: built before the save)
    twin.load_state_dict(model.state_dict())
    twin_opt = digits.build_optimizer(twin)
    outer = Nesterov()
    _outer_rounds(outer, model, 3)  # velocity built up over three rounds
    save_rank_state(stem, 1, opt, Plane(outer))
    for i in range(3, 6):  # the rank that never stopped
        _step(model, opt, i)
    after = _outer_rounds(outer, model, 2)
    torch.manual_seed(123)  # a different random state, which the restore replaces
    twin_outer = Nesterov()
    assert restore_rank_state(stem, 1, twin_opt, Plane(twin_outer))
    for i in range(3, 6):
        _step(twin, twin_opt, i)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(after, _outer_rounds(twin_outer, twin, 2)):
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
    outer = Nesterov()
    _outer_rounds(outer, model, 2)
    save_rank_state(stem, 0, opt, Plane(outer))
    other = torch.optim.Adam(nn.Linear(3, 2).parameters())
    with pytest.raises(ValueError, match=r"ckpt\.rank0\.state\.pt: the optimizer state"):
        restore_rank_state(stem, 0, other, None)
    with pytest.raises(ValueError, match="same --outer setting"):
        restore_rank_state(stem, 0, opt, Plane(None))
    torch.save({"schema": 0}, state_path(stem, 0))
    with pytest.raises(ValueError, match="not a rank state of schema"):
        restore_rank_state(stem, 0, opt, None)


class _Planted:
    """What an attacker plants as a rank state: unpickling it would run code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("where", ["state", "model"])
def test_a_planted_checkpoint_is_refused_in_one_line_and_runs_no_code(
    tmp_path: Path, where: str
) -> None:
    from flodl_bus.worker.resume import restore_model

    marker = tmp_path / "ran"
    stem = tmp_path / "ckpt"
    model = digits.build_model()
    opt = digits.build_optimizer(model)
    if where == "state":
        torch.save({"schema": 1, "optimizer": _Planted(marker)}, state_path(stem, 0))
        with pytest.raises(ValueError, match=r"not a readable rank state") as err:
            restore_rank_state(stem, 0, opt, None)
    else:
        torch.save({"w": _Planted(marker)}, Path(f"{stem}.model.pt"))
        with pytest.raises(ValueError, match=r"not a readable model") as err:
            restore_model(stem, model)
    assert "\n" not in str(err.value)
    assert not marker.exists()


def test_a_saved_state_with_an_outer_optimizer_loads_with_the_safe_loader(tmp_path: Path) -> None:
    model = digits.build_model()
    opt = digits.build_optimizer(model)
    _step(model, opt, 0)
    outer = Nesterov()
    _outer_rounds(outer, model, 2)
    stem = tmp_path / "ckpt"
    save_rank_state(stem, 0, opt, Plane(outer))
    # weights_only=True is what restore uses: everything saved must pass it
    torch.load(state_path(stem, 0), weights_only=True)
    assert restore_rank_state(stem, 0, opt, Plane(Nesterov()))
