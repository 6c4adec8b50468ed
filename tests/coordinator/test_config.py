"""Modes, defaults and max-failure thresholds (reference §2.6, §4.7, §7.11)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from flodl_bus.coordinator.config import CoordinatorConfig, MaxFailure, parse_mode
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.replay.coordinator import config_from_header


def cfg(mode: str, **kw: object) -> CoordinatorConfig:
    return CoordinatorConfig(
        mode=mode, world_size=2, total_samples=100, batch_size=4, num_epochs=1, **kw
    )  # type: ignore[arg-type]


def test_nccl_async_is_refused_with_a_one_line_error_naming_the_fix() -> None:
    with pytest.raises(ValueError) as exc:
        cfg("nccl-async")
    text = str(exc.value)
    assert "\n" not in text
    assert "cpu-async" in text and "nccl-cadence" in text


def test_unknown_mode_lists_the_modes() -> None:
    with pytest.raises(ValueError, match="cpu-cadence"):
        parse_mode("gpu-fast")


def test_progressive_defaults_on_for_cadence_and_async_off_for_sync() -> None:
    assert not cfg("nccl-sync").is_progressive
    assert not cfg("cpu-sync").is_progressive
    assert cfg("nccl-cadence").is_progressive
    assert cfg("cpu-async").is_progressive
    assert not cfg("cpu-async", progressive=False).is_progressive


def test_defaults_follow_the_reference() -> None:
    c = cfg("cpu-async")
    assert c.seed == 42 and c.heartbeat_timeout == 30.0
    assert c.guard_threshold == 0.3  # EASGD spread
    assert cfg("cpu-cadence").guard_threshold == 0.05
    assert cfg("nccl-sync").initial_anchor == 1
    assert cfg("nccl-cadence").initial_anchor == 10
    assert c.stall_ceiling == 300.0


def test_epoch_smaller_than_a_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        CoordinatorConfig(
            mode="cpu-sync", world_size=2, total_samples=3, batch_size=4, num_epochs=1
        )


def test_absolute_limit_returns_n_directly() -> None:
    assert MaxFailure(absolute=3).limit(2) == 3


def test_percent_limit_rounds_up() -> None:
    mf = MaxFailure(percent=0.2)
    assert [mf.limit(ws) for ws in (10, 11, 5, 3)] == [2, 3, 1, 1]


def test_percent_zero_is_any_death_and_one_is_all_dead() -> None:
    assert MaxFailure(percent=0.0).breached(1, 4)
    assert not MaxFailure(percent=1.0).breached(3, 4)
    assert MaxFailure(percent=1.0).breached(4, 4)


def test_percent_out_of_range_is_clamped_and_zero_world_is_zero() -> None:
    assert MaxFailure(percent=7.0).limit(4) == 4
    assert MaxFailure(percent=-1.0).limit(4) == 0
    assert MaxFailure(percent=0.5).limit(0) == 0


def test_max_failure_needs_exactly_one_form() -> None:
    with pytest.raises(ValueError):
        MaxFailure()


def test_device_scores_need_one_finite_entry_per_rank() -> None:
    assert cfg("cpu-cadence", device_scores=(884.0, 880.0)).device_scores == (884.0, 880.0)
    for bad in ((884.0,), (884.0, 880.0, 1.0), (884.0, math.nan), (math.inf, 880.0)):
        with pytest.raises(ValueError, match="device_scores"):
            cfg("cpu-cadence", device_scores=bad)


def test_the_coordinators_elche_starts_anchored_on_the_spec_slowest_rank_unless_told() -> None:
    assert Coordinator(cfg("cpu-cadence", device_scores=(884.0, 880.0))).elche.anchor_rank == 1
    assert Coordinator(cfg("cpu-cadence")).elche.anchor_rank is None
    # the user's word outranks the prior: speed hints, or partition ratios
    hinted = cfg("cpu-cadence", device_scores=(884.0, 880.0), speed_hints=(1.0, 2.0))
    assert Coordinator(hinted).elche.anchor_rank == 0
    ratios = cfg("cpu-cadence", device_scores=(884.0, 880.0), partition_ratios=(0.5, 0.5))
    assert Coordinator(ratios).elche.anchor_rank is None


def test_device_scores_are_recorded_in_the_header_and_a_header_without_them_has_no_prior() -> None:
    made = cfg("cpu-cadence", device_scores=(884.0, 880.0))
    # the recorder writes the header as JSON: the tuple comes back a list
    header = json.loads(json.dumps({"config": dataclasses.asdict(made)}))
    assert config_from_header(header) == made
    before = dict(header["config"])
    del before["device_scores"]  # a record made before the field
    old = config_from_header({"config": before})
    assert old.device_scores is None and Coordinator(old).elche.anchor_rank is None
