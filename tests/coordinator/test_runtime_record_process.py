"""The coordinator loop recorded by a record process (``record.process``): a real rank
(``run_rank`` training digits) on the in-memory bus, as in ``test_runtime``; and the
record process killed mid-run, or hung (stopped) with the pipe full, either of which
stops the run in order with exit 1."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import orjson
import pytest

from flodl_bus.bus.memory import MemoryCoordinatorBus, MemoryHub
from flodl_bus.coordinator.config import CoordinatorConfig
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.coordinator.runtime import EXIT_OK, CoordinatorLoop, LoopOptions
from flodl_bus.exits import FAILED
from flodl_bus.protocol.messages import Batch
from flodl_bus.record import chain, states
from flodl_bus.record.dispatch import DispatchRecorder
from flodl_bus.record.log import read_records
from flodl_bus.record.process import RecordProcess
from flodl_bus.record.telemetry import EVENTS_FILE, derive
from tests.coordinator.test_runtime import config, start_rank

pytestmark = pytest.mark.slow


def test_a_run_recorded_by_a_record_process_is_whole_chained_and_its_events_live(
    tmp_path: Path,
) -> None:
    core = Coordinator(config("cpu-cadence", epochs=2, solo_without_rounds=False))
    hub = MemoryHub(1)
    world = start_rank(hub)
    rec = DispatchRecorder(tmp_path, "coordinator", process=True)
    assert rec.in_process
    loop = CoordinatorLoop(core, MemoryCoordinatorBus(hub), recorder=rec)
    try:
        code = loop.run()
    finally:
        rec.close()
    world.thread.join(30)
    assert code == EXIT_OK and world.result == [0] and rec.failure is None

    assert chain.check(rec.path).ended
    raw = read_records(rec.path)
    recs = list(states.expand(raw))
    dispatches = [r for r in recs if r["event"] == "dispatch"]
    assert len(dispatches) == loop.dispatches > 0
    numbered = [r["i"] for r in recs if "i" in r]
    assert numbered == list(range(len(numbered)))  # every core call, in call order
    assert recs[-1]["event"] == "end" and recs[-1]["dispatches"] == loop.dispatches
    assert recs[-2]["after"] == core.state_summary()  # the deltas add up to the end state
    live = [orjson.loads(x) for x in (tmp_path / EVENTS_FILE).read_bytes().splitlines()]
    assert live == list(derive(raw)) and any(e["kind"] == "CpuAvgEnd" for e in live)


def test_with_a_record_process_the_summary_sets_lists_in_place_and_the_loop_still_sees_it(
    tmp_path: Path,
) -> None:
    """The loop's summaries share their lists with a record process recording (the
    summarizer's mirror): a Batch leaves two summaries equal, so the loop's "did the call
    change anything" must ask the summarizer, or an unrecorded tick would lose a change."""
    cfg = CoordinatorConfig(
        mode="nccl-cadence", world_size=20, total_samples=800, batch_size=1, num_epochs=1
    )
    core = Coordinator(cfg)
    rec = DispatchRecorder(tmp_path, "coordinator", process=True)
    try:
        loop = CoordinatorLoop(core, MemoryCoordinatorBus(MemoryHub(20)), recorder=rec)
        assert core.summarizer.mirror
        core.start(0.0)
        first = core.state_summary()
        before = core.state_summary(first)
        core.handle(3, Batch(rank=3, batch_ms=5.0, data_ms=0.1, step_count=1, batch_loss=0.5), 0.01)
        after = core.state_summary(before)
        assert after["steps"] is before["steps"] and after["steps"][3] == 1
        assert after == before  # the same lists: equality cannot tell
        assert loop._changed(before, after)
        assert core.summary_patches(after, before) == {"steps": [3, 1], "last_step_count": [3, 1]}
        again = core.state_summary(after)
        assert not loop._changed(after, again)
    finally:
        rec.close()
    # recorded on this thread (FLODL_RECORD_PROCESS=0, --tensorboard): lists copied
    thread = DispatchRecorder(tmp_path / "thread", "coordinator", process=False)
    try:
        other = Coordinator(cfg)
        CoordinatorLoop(other, MemoryCoordinatorBus(MemoryHub(20)), recorder=thread)
        assert not other.summarizer.mirror
    finally:
        thread.close()


class CuttingRecorder(DispatchRecorder):
    """At the ``at``-th dispatch, puts every line so far on disk, then ``cut``s its
    record process; the loop's next turn finds ``failure`` set."""

    at = 20

    def dispatch(self, **kw: Any) -> None:
        super().dispatch(**kw)
        self.at -= 1
        if self.at == 0:
            assert self.remote is not None
            self.flush()  # every line so far on disk: the cut is after them
            self.flushed = self.lines
            self.cut(self.remote)

    def cut(self, remote: RecordProcess) -> None:
        raise NotImplementedError


class KillingRecorder(CuttingRecorder):
    """Kills its record process and returns once the watcher saw it die."""

    def cut(self, remote: RecordProcess) -> None:
        os.kill(remote.pid, signal.SIGKILL)
        assert remote.dead.wait(30)


class HangingRecorder(CuttingRecorder):
    """Stops its record process (SIGSTOP: alive, taking nothing) and records on until
    the pipe is full for ``stall_s``: the record process then counts as hung."""

    def cut(self, remote: RecordProcess) -> None:
        remote.stall_s = 1.0
        os.kill(remote.pid, signal.SIGSTOP)
        # well past the pipe's capacity, as a long run's lines would come
        while not remote.dead.is_set():
            self.event("membership", pad="x" * 10_000)


def _run_cut(
    rec: CuttingRecorder,
) -> tuple[int, CoordinatorLoop, Coordinator, Any]:
    """A one-rank cpu-cadence run recorded by ``rec``, until the loop returns."""
    core = Coordinator(config("cpu-cadence", epochs=3))
    hub = MemoryHub(1)
    world = start_rank(hub)
    pid = rec.remote.pid if rec.remote is not None else 0
    loop = CoordinatorLoop(
        core, MemoryCoordinatorBus(hub), recorder=rec, options=LoopOptions(exit_grace=30.0)
    )
    try:
        code = loop.run()
    finally:
        rec.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)  # a stopped process would outlive the test
    world.thread.join(60)
    return code, loop, core, world


def _assert_stopped_in_order(rec: CuttingRecorder, core: Coordinator, world: Any) -> None:
    # stopped in order: the rank was told to shut down and left before the run's end
    assert not world.thread.is_alive() and world.result == [0]
    assert core.last_aggregated < 2 and core.live.exited[0]
    # the record verifies up to its cut and says it was cut (no end line)
    st = chain.check(rec.path, allow_incomplete=True)
    assert not st.ended and rec.flushed <= st.lines < rec.lines


def test_a_killed_record_process_stops_the_run_in_order_with_exit_1(tmp_path: Path) -> None:
    rec = KillingRecorder(tmp_path, "coordinator", process=True)
    code, loop, core, world = _run_cut(rec)
    assert code == FAILED
    assert loop.record_lost is not None and "SIGKILL" in loop.record_lost
    _assert_stopped_in_order(rec, core, world)
    with pytest.raises(chain.IncompleteRecord):
        chain.check(rec.path)


def test_a_hung_record_process_stops_the_run_in_order_with_exit_1(tmp_path: Path) -> None:
    rec = HangingRecorder(tmp_path, "coordinator", process=True)
    code, loop, core, world = _run_cut(rec)
    assert code == FAILED
    assert loop.record_lost is not None and "took nothing for 1 s" in loop.record_lost
    _assert_stopped_in_order(rec, core, world)
