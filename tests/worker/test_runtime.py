"""The rank's threads: control reader, heartbeats, coordinator liveness (reference §3.12).

Run over the in-process bus (``bus.memory``, through the real wire codec); the same
runtime over a real redis-server is in ``test_integration.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from flodl_bus.bus.memory import MemoryCoordinatorBus, MemoryHub, MemoryRankBus
from flodl_bus.examples import digits
from flodl_bus.protocol.messages import (
    Checkpoint,
    ControlWire,
    CoordHeartbeat,
    DeclareDead,
    EpochFnElapsed,
    EpochPlan,
    Exiting,
    Heartbeat,
    MetricsMsg,
    NewNcclIdGenerated,
    NewNcclSession,
    RequestNewNcclId,
    SetEpochCallbackRole,
    SetGlobalStep,
    Shutdown,
    StartEpoch,
    SyncNow,
    WireUpdate,
)
from flodl_bus.worker.inbox import Closed, Inbox
from flodl_bus.worker.rank import EXIT_COORDINATOR_LOST, RankOptions, run_rank
from flodl_bus.worker.runtime import NEW_SESSION_UID_BYTES, RankRuntime, RuntimeConfig
from tests.worker.rig import ObservedParams


@dataclass
class Harness:
    hub: MemoryHub
    coord: MemoryCoordinatorBus
    bus: MemoryRankBus
    inbox: Inbox
    params: ObservedParams
    runtime: RankRuntime

    def upstream(self, timeout: float = 2.0) -> list[object]:
        deliveries = self.coord.read_upstream(int(timeout * 1000))
        self.coord.ack(deliveries)
        return [d.msg for d in deliveries]

    def inbox_get(self, timeout: float = 2.0) -> object:
        return self.inbox.get(timeout)


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = make_harness(world_size=3, rank=1)
    try:
        yield h
    finally:
        h.runtime.close()


def make_harness(
    *, world_size: int = 1, rank: int = 0, config: RuntimeConfig | None = None
) -> Harness:
    hub = MemoryHub(world_size)
    bus = hub.rank_bus(rank)
    inbox = Inbox()
    params = ObservedParams(digits.build_model(), rank=rank)
    cfg = config or RuntimeConfig(heartbeat_interval=10.0, read_block_ms=20)
    runtime = RankRuntime(bus=bus, inbox=inbox, params=params, world_size=world_size, config=cfg)
    runtime.start()
    return Harness(hub, hub.coordinator_bus(), bus, inbox, params, runtime)


def test_reader_forwards_control_in_send_order_and_acks(harness: Harness) -> None:
    harness.coord.send(1, SetGlobalStep(4))
    harness.coord.broadcast(SyncNow())
    harness.coord.send(1, Checkpoint(version=2, target_rank=1))
    got = [harness.inbox_get() for _ in range(3)]
    assert got == [SetGlobalStep(4), SyncNow(), Checkpoint(version=2, target_rank=1)]
    deadline = time.monotonic() + 2
    while harness.hub._control[1].pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not harness.hub._control[1].pending  # acked once queued


def test_coord_heartbeat_is_absorbed(harness: Harness) -> None:
    harness.coord.broadcast(CoordHeartbeat())
    harness.coord.send(1, SetGlobalStep(1))
    assert harness.inbox_get() == SetGlobalStep(1)
    assert len(harness.inbox) == 0


def test_wire_update_with_a_next_plan_becomes_a_start_epoch(harness: Harness) -> None:
    plan = EpochPlan(epoch=2, partition_offset=64, partition_size=32)
    harness.coord.send(1, WireUpdate(version=3, next_plan=None))
    harness.coord.send(1, WireUpdate(version=4, next_plan=plan))
    assert harness.inbox_get() == StartEpoch(plan)
    assert len(harness.inbox) == 0


def test_declare_dead_updates_the_ledger_and_aborts_the_params_once(harness: Harness) -> None:
    harness.coord.broadcast(DeclareDead(rank=2))
    harness.coord.broadcast(DeclareDead(rank=2))
    harness.coord.send(1, SetGlobalStep(1))
    assert harness.inbox_get() == SetGlobalStep(1)
    assert harness.runtime.dead_ranks == {2}
    assert harness.params.names() == ["abort"]


def test_request_new_nccl_id_publishes_a_fresh_uid(harness: Harness) -> None:
    harness.coord.send(1, RequestNewNcclId())
    harness.coord.send(1, RequestNewNcclId())
    deadline = time.monotonic() + 2
    uids: list[NewNcclIdGenerated] = []
    while len(uids) < 2 and time.monotonic() < deadline:
        uids += [m for m in harness.upstream(0.2) if isinstance(m, NewNcclIdGenerated)]
    assert [u.rank for u in uids] == [1, 1]
    assert all(len(u.uid_bytes) == NEW_SESSION_UID_BYTES for u in uids)
    assert uids[0].uid_bytes != uids[1].uid_bytes
    assert len(harness.inbox) == 0


def test_new_nccl_session_reaches_the_param_plane_off_the_reader_thread() -> None:
    h = make_harness(world_size=1, rank=0)
    try:
        h.coord.send(0, NewNcclSession(uid_bytes=b"u" * 16, new_rank=0, new_world_size=1))
        deadline = time.monotonic() + 2
        while "new_session" not in h.params.names() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert h.params.calls == [("new_session", (b"u" * 16, 0, 1))]
        assert len(h.inbox) == 0
    finally:
        h.runtime.close()


_OLD, _NEW = b"a" * 16, b"b" * 16


@contextlib.contextmanager
def _superseded_while_forming(
    release: threading.Event, **hooks: Any
) -> Iterator[tuple[MemoryCoordinatorBus, threading.Event]]:
    """A rank whose session thread forms ``_OLD`` (its params' ``new_session`` blocks on
    ``release``, as a rendezvous waiting on a member that died): the coordinator's bus
    and the event set once that formation is under way."""
    hub = MemoryHub(1)
    forming = threading.Event()

    class BlockingParams(ObservedParams):
        def new_session(self, uid: bytes, new_rank: int, new_world_size: int) -> None:
            if uid == _OLD:
                forming.set()
                release.wait(30)

    runtime = RankRuntime(
        bus=hub.rank_bus(0),
        inbox=Inbox(),
        params=BlockingParams(digits.build_model(), rank=0),
        world_size=1,
        config=RuntimeConfig(heartbeat_interval=10.0, read_block_ms=20),
        **hooks,
    )
    runtime.start()
    try:
        coord = hub.coordinator_bus()
        coord.send(0, NewNcclSession(uid_bytes=_OLD, new_rank=0, new_world_size=2))
        assert forming.wait(10)
        coord.send(0, NewNcclSession(uid_bytes=_NEW, new_rank=0, new_world_size=1))
        yield coord, forming
    finally:
        release.set()
        runtime.close()


def test_a_newer_session_is_told_to_the_plane_at_once_while_the_session_thread_forms() -> None:
    """The session thread delivers offers one at a time; while it forms one (blocked in
    its rendezvous) the reader tells the plane of a newer session at once
    (``on_offered``), so that formation can give up for it instead of holding the
    session thread for the whole group timeout."""
    release, told = threading.Event(), threading.Event()
    heard: list[tuple[bytes, int, int]] = []

    def on_offered(uid: bytes, rank: int, world: int) -> None:
        heard.append((uid, rank, world))
        if len(heard) == 2:
            told.set()

    with _superseded_while_forming(release, on_offered=on_offered):
        assert told.wait(10)  # while the first is still forming
        assert heard == [(_OLD, 0, 2), (_NEW, 0, 1)]
        assert not release.is_set()


def test_the_jobs_group_skips_a_session_superseded_while_the_plane_formed_it() -> None:
    """The plane gave a session up for a newer one that came meanwhile: the job's default
    group follows the survivors to the newer one at once; forming the superseded one
    would wait the whole timeout on the member that died."""
    release, done = threading.Event(), threading.Event()
    reformed: list[bytes] = []

    def on_session(uid: bytes, rank: int, world: int) -> None:
        reformed.append(uid)
        done.set()

    # The newer session heard of: the plane's formation of the old one gives up.
    hooks: dict[str, Any] = {
        "on_session": on_session,
        "on_offered": lambda uid, rank, world: release.set() if uid == _NEW else None,
    }
    with _superseded_while_forming(release, **hooks):
        assert done.wait(10)
        assert reformed == [_NEW]


def test_heartbeats_are_published_every_interval_with_a_rising_counter() -> None:
    h = make_harness(config=RuntimeConfig(heartbeat_interval=0.05, read_block_ms=20))
    try:
        time.sleep(0.4)
        beats = [m for m in h.upstream(0.1) if isinstance(m, Heartbeat)]
    finally:
        h.runtime.close()
    assert len(beats) >= 3
    assert [b.step_count for b in beats] == list(range(1, len(beats) + 1))


def test_a_silent_coordinator_trips_the_escape_hatch() -> None:
    # Read before the runtime starts its liveness clock: read after, a loaded machine
    # made the measured wait a few ms short of the timeout the runtime did wait.
    start = time.monotonic()
    h = make_harness(
        world_size=4, rank=2, config=RuntimeConfig(coord_liveness_timeout=0.3, read_block_ms=20)
    )
    try:
        # Never before the timeout; how long after it depends on the machine's load, so the
        # wait is generous and not asserted (speed belongs to benches).
        assert h.inbox_get(timeout=30.0) == Shutdown()
        assert time.monotonic() - start >= 0.3
        assert h.runtime.coordinator_lost.is_set()
        assert h.runtime.dead_ranks == {0, 1, 3}
        assert h.params.names() == ["abort"]
        assert isinstance(h.inbox_get(timeout=1.0), Closed)  # the reader is gone
    finally:
        h.runtime.close()


def test_coordinator_entries_keep_the_rank_alive_past_the_timeout() -> None:
    h = make_harness(config=RuntimeConfig(coord_liveness_timeout=0.3, read_block_ms=20))
    try:
        for _ in range(8):
            h.coord.broadcast(CoordHeartbeat())
            time.sleep(0.1)
        assert not h.runtime.coordinator_lost.is_set()
        assert len(h.inbox) == 0
    finally:
        h.runtime.close()


def test_after_a_shutdown_silence_is_not_a_lost_coordinator() -> None:
    h = make_harness(config=RuntimeConfig(coord_liveness_timeout=0.2, read_block_ms=20))
    try:
        h.coord.broadcast(Shutdown())
        assert h.inbox_get() == Shutdown()
        time.sleep(0.5)
        assert not h.runtime.coordinator_lost.is_set()
    finally:
        h.runtime.close()


def test_close_stops_every_thread() -> None:
    before = set(threading.enumerate())
    h = make_harness(config=RuntimeConfig(heartbeat_interval=0.05, read_block_ms=20))
    h.runtime.close()
    assert set(threading.enumerate()) <= before
    assert h.bus.closed


# ----------------------------------------------------------- a whole rank, in process


class Coordinator(threading.Thread):
    """A scripted coordinator: one plan at a time, then Shutdown."""

    def __init__(
        self,
        coord: MemoryCoordinatorBus,
        plans: list[EpochPlan],
        preface: Sequence[ControlWire] = (),
    ) -> None:
        super().__init__(daemon=True)
        self.coord, self.plans = coord, list(plans)
        self.preface = list(preface)
        self.received: list[object] = []

    def run(self) -> None:
        for msg in self.preface:
            self.coord.broadcast(msg)
        self.coord.send(0, StartEpoch(self.plans.pop(0)))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            deliveries = self.coord.read_upstream(50)
            self.coord.ack(deliveries)
            for d in deliveries:
                self.received.append(d.msg)
                if isinstance(d.msg, MetricsMsg):
                    nxt = StartEpoch(self.plans.pop(0)) if self.plans else Shutdown()
                    self.coord.send(0, nxt)
                if isinstance(d.msg, Exiting):
                    return


def test_run_rank_trains_plans_from_a_coordinator_and_exits_cleanly() -> None:
    hub = MemoryHub(1)
    size = len(digits.train_data())
    coordinator = Coordinator(hub.coordinator_bus(), [EpochPlan(e, 0, size) for e in range(2)])
    coordinator.start()
    rc = run_rank(digits.job, hub.rank_bus(0), RankOptions())
    coordinator.join(timeout=10)
    assert rc == 0
    metrics = [m for m in coordinator.received if isinstance(m, MetricsMsg)]
    assert [m.epoch for m in metrics] == [0, 1]
    assert metrics[1].avg_loss < metrics[0].avg_loss
    assert coordinator.received[-1] == Exiting(rank=0)


def test_the_jobs_epoch_fn_fires_once_per_epoch_on_the_role_rank_and_is_timed() -> None:
    hub = MemoryHub(1)
    size = len(digits.train_data())
    plans = [EpochPlan(e, 0, size // 2) for e in range(2)]
    plans.insert(1, EpochPlan(0, size // 2, size // 2))  # a second chunk of epoch 0
    coordinator = Coordinator(hub.coordinator_bus(), plans, [SetEpochCallbackRole(rank=0)])
    coordinator.start()
    fired: list[int] = []
    job = dataclasses.replace(digits.job, epoch_fn=lambda e, model: fired.append(e))
    assert run_rank(job, hub.rank_bus(0), RankOptions()) == 0
    coordinator.join(timeout=10)
    assert fired == [0, 1]  # per epoch change, not per chunk
    timed = [m.epoch for m in coordinator.received if isinstance(m, EpochFnElapsed)]
    assert timed == [0, 1]


def test_a_failing_training_step_exits_1_and_says_why_instead_of_a_clean_exit() -> None:
    hub = MemoryHub(1)
    size = len(digits.train_data())
    coordinator = Coordinator(hub.coordinator_bus(), [EpochPlan(0, 0, size)])
    coordinator.start()

    def broken_loss(model: object, batch: object) -> object:
        raise RuntimeError("loss exploded")

    job = dataclasses.replace(digits.job, loss_fn=broken_loss)  # type: ignore[arg-type]
    assert run_rank(job, hub.rank_bus(0), RankOptions()) == 1
    coordinator.join(timeout=30)  # it returns on the Exiting
    exits = [m for m in coordinator.received if isinstance(m, Exiting)]
    assert exits == [Exiting(0, reason="job_failed: loss_fn raised RuntimeError: loss exploded")]


@pytest.mark.parametrize("builder", ["build_model", "build_optimizer", "train_data"])
def test_a_raising_builder_exits_1_and_says_which_upstream(builder: str) -> None:
    hub = MemoryHub(1)
    coordinator = Coordinator(hub.coordinator_bus(), [EpochPlan(0, 0, 64)])
    coordinator.start()

    def broken(*_args: object) -> object:
        raise OSError("no such file: data.npz")

    job = dataclasses.replace(digits.job, **{builder: broken})
    assert run_rank(job, hub.rank_bus(0), RankOptions()) == 1
    coordinator.join(timeout=30)
    exits = [m for m in coordinator.received if isinstance(m, Exiting)]
    assert exits == [
        Exiting(0, reason=f"job_failed: {builder} raised OSError: no such file: data.npz")
    ]


def test_run_rank_with_a_silent_coordinator_stops_within_the_timeout() -> None:
    hub = MemoryHub(1)
    options = RankOptions(runtime=RuntimeConfig(coord_liveness_timeout=0.5, read_block_ms=20))
    start = time.monotonic()
    rc = run_rank(digits.job, hub.rank_bus(0), options)
    assert rc == EXIT_COORDINATOR_LOST
    assert time.monotonic() - start < 30.0  # it stops rather than hangs; load decides how soon
