"""The coordinator loop's accounting (``LoopProfile``): how a read splits, and that the
stages and the rest partition the wall time."""

from __future__ import annotations

import pytest

from flodl_bus.coordinator.loop_profile import STAGES, LoopProfile, busiest


def test_a_read_splits_into_cpu_and_a_wait_that_is_idle_only_when_it_found_nothing() -> None:
    p = LoopProfile()
    p.add_read(0.100, 0.002, got=False)
    p.add_read(0.010, 0.004, got=True)
    # a CPU clock coarser than the wall one never makes a wait negative
    p.add_read(0.001, 0.003, got=True)
    assert p.idle == pytest.approx(0.098)
    assert p.read_wait == pytest.approx(0.006)
    assert p.read_cpu == pytest.approx(0.002 + 0.004 + 0.001)
    assert (p.reads, p.empty_reads) == (3, 1)


def test_the_stages_and_the_rest_partition_the_wall_and_the_largest_is_work() -> None:
    p = LoopProfile(wall_s=1.0, idle=0.5, read_wait=0.2, handle=0.05, record=0.1, messages=100)
    p.add_read(0.0, 0.0, got=True)
    assert p.other == pytest.approx(0.15)
    per = p.per_message_us()
    assert sum(per.values()) * p.messages / 1e6 == pytest.approx(p.wall_s)
    assert per["record"] == pytest.approx(1000.0)
    # the waits are larger, but they are not work
    assert busiest({**p.stages(), "other": p.other}) == "other"
    assert busiest(p.stages()) == "record"
    # more stage time than wall (a window not closed yet) leaves no negative rest
    assert LoopProfile(wall_s=0.0, handle=1.0).other == 0.0
    assert set(p.to_dict()) >= {*STAGES, "other", "messages", "send_calls"}
