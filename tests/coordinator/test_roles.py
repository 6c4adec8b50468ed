"""Callback roles, failover and EWMA (reference §4.13, §7.10)."""

from __future__ import annotations

from flodl_bus.coordinator.roles import Roles, ewma


def test_ewma_first_sample_seeds_then_blends() -> None:
    assert ewma(None, 100.0) == 100.0
    assert ewma(100.0, 50.0) == 85.0
    roles = Roles(2)
    roles.observe("checkpoint", 100.0)
    assert roles.observe("checkpoint", 50.0) == 85.0


def test_checkpoint_failure_fails_over_to_lowest_live_untried() -> None:
    roles = Roles(4)
    alive = [True, True, False, True]
    assert roles.checkpoint_failed(0, alive) == 1
    assert roles.checkpoint_failed(1, alive) == 3
    assert roles.checkpoint_failed(3, alive) is None  # all tried: give up


def test_checkpoint_success_after_failure_clears_tried() -> None:
    roles = Roles(3)
    roles.checkpoint_failed(0, [True] * 3)
    roles.checkpoint_succeeded(1)
    assert roles.checkpoint == 1
    assert roles.checkpoint_tried == []


def test_fastest_role_resolves_and_marks_dirty_on_change() -> None:
    roles = Roles(3)
    roles.dirty = False
    roles.elect_fastest(2, [True] * 3)
    assert (roles.checkpoint, roles.eval, roles.epoch_callback) == (2, 2, 2)
    assert roles.dirty
    roles.dirty = False
    roles.elect_fastest(None, [False, True, True])  # uncalibrated: lowest live
    assert roles.epoch_callback == 1


def test_fastest_re_resolve_on_role_rank_death() -> None:
    roles = Roles(3)
    roles.on_death(0, [False, True, True], fastest=2)
    assert (roles.checkpoint, roles.eval, roles.epoch_callback) == (2, 2, 2)


def test_rank_policy_only_fails_over_the_checkpoint_role() -> None:
    roles = Roles(3, pinned=1)
    roles.elect_fastest(2, [True] * 3)
    assert roles.epoch_callback == 1
    roles.on_death(1, [True, False, True], fastest=2)
    assert roles.checkpoint == 0
    assert roles.eval == 1 and roles.epoch_callback == 1
