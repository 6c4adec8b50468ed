"""The stall dump: a run that stops moving says why, at 15 s and at 120 s."""

from __future__ import annotations

import structlog

from flodl_bus.bus.memory import MemoryCoordinatorBus, MemoryHub
from flodl_bus.coordinator.config import CoordinatorConfig
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.coordinator.runtime import CoordinatorLoop
from flodl_bus.coordinator.stall import StallWatch


def test_a_stall_is_dumped_at_15_and_120_seconds_and_movement_re_arms_both() -> None:
    w = StallWatch()
    assert w.check((0,), 0.0) is None
    assert w.check((0,), 14.9) is None
    assert w.check((0,), 15.0) == 15.0
    assert w.check((0,), 60.0) is None  # once per level
    assert w.check((0,), 120.5) == 120.5
    assert w.check((0,), 500.0) is None
    assert w.check((1,), 501.0) is None  # it moved: both dumps re-armed
    assert w.check((1,), 516.0) == 15.0


def test_a_training_run_that_stops_moving_logs_what_its_gate_waits_on() -> None:
    core = Coordinator(
        CoordinatorConfig(
            mode="cpu-cadence",
            world_size=2,
            batch_size=32,
            num_epochs=1,
            total_samples=1024,
            elastic=False,  # nothing heartbeats here: no rank is declared dead
        )
    )
    now = [0.0]
    loop = CoordinatorLoop(core, MemoryCoordinatorBus(MemoryHub(2)), clock=lambda: now[0])
    core.start(0.0)  # plans out; no rank ever reports a step
    with structlog.testing.capture_logs() as logs:
        for t in (0.0, 10.0, 16.0, 60.0, 121.0):
            now[0] = t
            loop._tick()
    dumps = [e for e in logs if e["event"] == "stall_dump"]
    assert [d["stalled_s"] for d in dumps] == [16.0, 121.0]
    first = dumps[0]
    assert first["gate"]["open"] is False and "rank 0 at 0/" in first["gate"]["why"]
    assert first["steps"] == [0, 0] and len(first["heard_s"]) == 2
