"""``FLODL_RECORD_PROCESS=shadow``: the record process rebuilds the core's states with a
shadow core (``coordinator.shadow``). Its record is the in-thread record, line for line;
it replays; and a shadow that disagrees with the real core stops the record at once."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from flodl_bus.bus.memory import MemoryCoordinatorBus, MemoryHub
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.coordinator.effects import Out
from flodl_bus.coordinator.runtime import EXIT_OK, CoordinatorLoop
from flodl_bus.coordinator.shadow import NO_STATE, ShadowRecorder
from flodl_bus.exits import FAILED
from flodl_bus.protocol import messages as m
from flodl_bus.record import chain
from flodl_bus.record.dispatch import DispatchRecorder
from flodl_bus.record.telemetry import EVENTS_FILE
from flodl_bus.replay import load_run, replay
from tests.coordinator.sim import Cluster
from tests.coordinator.test_runtime import BacklogBus, start_rank
from tests.coordinator.test_runtime import config as rank_config
from tests.record.test_process import Teed, cfg


class TeedShadow(Teed):
    """``Teed`` that also hands every call, states left out, to a shadow recorder."""

    def __init__(self, core: Coordinator, rec: DispatchRecorder, shadow: ShadowRecorder) -> None:
        super().__init__(core, [rec], "shadow")
        self.shadow = shadow

    def start(self, now: float) -> list[Out]:
        outs = super().start(now)
        self.shadow.core_call("start", now=now, before=NO_STATE, after=NO_STATE, out=outs)
        return outs

    def handle(self, rank: int, msg: object, now: float) -> list[Out]:
        outs = super().handle(rank, msg, now)
        self.shadow.dispatch(
            stream=self.keys.up(rank),
            entry_id=f"{self.k}-0",
            msg=msg,
            now=now,
            before=NO_STATE,
            after=NO_STATE,
            out=outs,
            sender=rank,
        )
        return outs

    def tick(self, now: float) -> list[Out]:
        outs = super().tick(now)
        self.shadow.core_call("tick", now=now, before=NO_STATE, after=NO_STATE, out=outs)
        return outs


def test_the_shadow_record_is_the_in_thread_record_and_replays(tmp_path: Path) -> None:
    config = cfg()
    thread = DispatchRecorder(tmp_path / "thread", "coordinator")
    shadow = ShadowRecorder(tmp_path / "shadow", config=config)
    header: dict[str, Any] = {"run": "shadow", "config": dataclasses.asdict(config)}
    for rec in (thread, shadow):
        rec.header(**header)
    teed = TeedShadow(Coordinator(config), thread, shadow)
    sim = Cluster(config, [1, 2, 3], core=teed)  # type: ignore[arg-type]
    sim.run()
    shadow.check(teed.core.state_summary())
    for rec in (thread, shadow):
        rec.event("end", dispatches=teed.k)
        rec.close()
    assert shadow.failure is None
    assert chain.record_bytes(shadow.path) == chain.record_bytes(thread.path)
    events = [(r.run_dir / EVENTS_FILE).read_bytes() for r in (thread, shadow)]
    assert events[0] == events[1] and b"CpuAvgEnd" in events[0]
    (coord,) = load_run(shadow.run_dir).values()
    result = replay(coord)
    assert result.identical and result.replayed > 100, result.summary()


def test_a_shadow_that_disagrees_with_the_core_ends_the_record_before_that_call(
    tmp_path: Path,
) -> None:
    config = cfg(2)
    shadow = ShadowRecorder(tmp_path, config=config)
    shadow.header(run="diverged")
    core = Coordinator(config)
    outs = core.start(0.0)
    shadow.core_call("start", now=0.0, before=NO_STATE, after=NO_STATE, out=outs)
    # the real core saw a Batch the record process was never told about
    core.handle(0, m.Batch(0, 10.0, 0.0, 1, 0.5), 0.001)
    shadow.check(core.state_summary())
    shadow.event("membership", k=1)  # after the divergence: never written
    assert shadow.remote is not None and shadow.remote.dead.wait(30)
    assert shadow.failure is not None and "exit 4" in shadow.failure
    shadow.close()
    st = chain.check(shadow.path, allow_incomplete=True)
    assert st.lines == 2 and not st.ended  # the header and start, nothing after


def _shadow_loop(
    tmp_path: Path, core: Coordinator, bus_of: Callable[[MemoryHub], MemoryCoordinatorBus]
) -> tuple[int, CoordinatorLoop, ShadowRecorder]:
    """One rank training on the in-memory bus, the loop recorded by a shadow."""
    hub = MemoryHub(1)
    world = start_rank(hub)
    rec = ShadowRecorder(tmp_path, config=core.config)
    rec.header(run="loop", config=dataclasses.asdict(core.config))
    loop = CoordinatorLoop(core, bus_of(hub), recorder=rec)
    try:
        code = loop.run()
    finally:
        rec.close()
    world.thread.join(30)
    return code, loop, rec


def test_a_loop_with_a_shadow_record_trains_to_the_end(tmp_path: Path) -> None:
    core = Coordinator(rank_config("cpu-cadence", epochs=2, solo_without_rounds=False))
    code, loop, rec = _shadow_loop(tmp_path, core, MemoryCoordinatorBus)
    assert code == EXIT_OK and rec.failure is None and loop.record_lost is None
    st = chain.check(rec.path)
    assert st.ended
    (coord,) = load_run(tmp_path).values()
    dispatches = [e for e in coord.core_events() if e["event"] == "dispatch"]
    assert len(dispatches) == loop.dispatches > 0
    assert coord.core_events()[-1]["after"] == core.state_summary()
    assert code != FAILED


def test_a_shadow_runs_the_ticks_the_loop_ran_behind_its_input_as_they_ran(
    tmp_path: Path,
) -> None:
    # Every tick would find the rank silent, were the loop not behind its input: a shadow
    # told nothing of it would declare the death and disagree with the real core.
    core = Coordinator(rank_config("cpu-cadence", epochs=1, heartbeat_timeout=1e-6))
    code, loop, rec = _shadow_loop(tmp_path, core, BacklogBus)
    assert code == EXIT_OK and rec.failure is None and loop.record_lost is None
    (coord,) = load_run(tmp_path).values()
    ticks = [e for e in coord.core_events() if e["event"] == "tick"]
    assert ticks and all(e.get("behind") is True for e in ticks)
    assert not core.live.dead[0]


pytestmark = pytest.mark.slow
