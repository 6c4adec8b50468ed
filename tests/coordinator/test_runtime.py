"""The coordinator's IO loop, in process: a real rank (``run_rank`` training digits) on
the in-memory bus, the loop on the other end, and what the loop leaves behind."""

from __future__ import annotations

import csv
import dataclasses
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import fakeredis
import pytest

from flodl_bus.bus.ids import format_id
from flodl_bus.bus.join import JoinStream
from flodl_bus.bus.keys import RunKeys
from flodl_bus.bus.memory import MemoryCoordinatorBus, MemoryHub, MemoryRankBus
from flodl_bus.bus.publisher import EPOCH_END, LAZY
from flodl_bus.bus.stream_ops import stream_top
from flodl_bus.coordinator import runtime
from flodl_bus.coordinator.config import CoordinatorConfig
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.coordinator.join_desk import JoinDesk, form_world
from flodl_bus.coordinator.membership import Admission
from flodl_bus.coordinator.outputs import MetricsTable, write_meta_file
from flodl_bus.coordinator.runtime import EXIT_INTERRUPTED, EXIT_OK, CoordinatorLoop, LoopOptions
from flodl_bus.examples import digits
from flodl_bus.protocol.messages import (
    Assign,
    Batch,
    ControlWire,
    EpochAggregated,
    EpochMetrics,
    Hello,
    Reject,
    Shutdown,
    StartEpoch,
    UpstreamMsg,
)
from flodl_bus.protocol.signing import CoordinatorIdentity, new_secret
from flodl_bus.record import states
from flodl_bus.record.dispatch import DispatchRecorder
from flodl_bus.record.log import read_records
from flodl_bus.worker.rank import RankOptions, run_rank

pytestmark = pytest.mark.slow

BS = digits.job.batch_size
N = len(digits.train_data())
EPOCH = (N // BS) * BS


def config(mode: str, epochs: int = 2, **kw: object) -> CoordinatorConfig:
    fields: dict[str, object] = {"final_eval": True, **kw}
    return CoordinatorConfig(
        mode=mode,
        world_size=1,
        total_samples=N,
        batch_size=BS,
        num_epochs=epochs,
        **fields,  # type: ignore[arg-type]
    )


class FailingBus(MemoryCoordinatorBus):
    """Refuses the first ``StartEpoch`` it is asked to send (a write Redis rejected)."""

    def __init__(self, hub: MemoryHub) -> None:
        super().__init__(hub)
        self.refused: list[ControlWire] = []

    def send(self, rank: int, msg: ControlWire) -> None:
        if isinstance(msg, StartEpoch) and not self.refused:
            self.refused.append(msg)
            raise ConnectionError("refused once")
        super().send(rank, msg)


@dataclass
class World:
    hub: MemoryHub
    thread: threading.Thread
    result: list[int]


def start_rank(hub: MemoryHub) -> World:
    result: list[int] = []

    def body() -> None:
        result.append(run_rank(digits.job, hub.rank_bus(0), RankOptions(world_size=1)))

    t = threading.Thread(target=body, name="rank0", daemon=True)
    t.start()
    return World(hub, t, result)


def run_loop(
    core: Coordinator, bus: MemoryCoordinatorBus, run_dir: Path, **opts: float
) -> tuple[int, CoordinatorLoop]:
    rec = DispatchRecorder(run_dir, "coordinator")
    loop = CoordinatorLoop(
        core,
        bus,
        recorder=rec,
        metrics=MetricsTable(run_dir / "metrics.csv", core.ws),
        options=LoopOptions(**opts),  # type: ignore[arg-type]
    )
    try:
        return loop.run(), loop
    finally:
        rec.close()


@pytest.mark.parametrize("send_thread", [False, True], ids=["loop-thread", "sender-thread"])
def test_loop_trains_a_rank_to_the_end_recording_every_dispatch_and_the_metrics(
    tmp_path: Path, send_thread: bool
) -> None:
    stem = tmp_path / "ckpt" / "run"
    core = Coordinator(config("cpu-cadence", save_path=str(stem)))
    hub = MemoryHub(1)
    world = start_rank(hub)
    code, loop = run_loop(core, MemoryCoordinatorBus(hub), tmp_path, send_thread=send_thread)
    world.thread.join(30)
    assert code == EXIT_OK and world.result == [0]

    raw = read_records(tmp_path / "coordinator.jsonl")
    # after the first core event, every line holds what changed, not whole states
    assert all("changed" in r and "after" not in r for r in raw[2:] if "i" in r)
    recs = list(states.expand(raw))
    dispatches = [r for r in recs if r["event"] == "dispatch"]
    assert len(dispatches) == loop.dispatches > 0
    assert [r["i"] for r in recs if "i" in r] == list(range(len([r for r in recs if "i" in r])))
    assert all(r["before"] and r["after"] and r["sender"] == 0 for r in dispatches)
    assert recs[0]["event"] == "start" and recs[-1]["event"] == "end"
    assert recs[-1]["exited"] == [0]
    # Ticks are recorded only when they emit or change something.
    assert all(r["out"] or r["before"] != r["after"] for r in recs if r["event"] == "tick")
    assert recs[-2]["after"] == core.state_summary()  # the deltas add up to the end state
    # The loop's own accounting: nonnegative stages within its wall time, a message per
    # dispatch, and a write per Send/Broadcast the core returned (one call each here: the
    # in-memory bus has no send_batch).
    prof = loop.profile
    assert all(v >= 0 for v in prof.stages().values()) and prof.other >= 0
    assert sum(prof.stages().values()) <= prof.wall_s
    assert prof.messages == loop.dispatches
    effects = [o["kind"] for r in recs for o in r.get("out") or ()]
    assert (prof.sent, prof.broadcasts) == (effects.count("Send"), effects.count("Broadcast"))
    assert prof.send_calls == prof.sent + prof.broadcasts > 0

    lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert lines[0].startswith("epoch,avg_loss,epoch_ms,samples,version")
    rows = [dict(zip(lines[0].split(","), ln.split(","))) for ln in lines[1:]]
    assert [r["epoch"] for r in rows] == ["0", "1"]
    assert [int(r["samples"]) for r in rows] == [EPOCH, EPOCH]
    assert float(rows[-1]["eval_metric"]) > 0.5  # the final eval, on the last epoch's row

    meta = json.loads(Path(f"{stem}.meta.json").read_text())
    assert meta["reason"] == "graceful_shutdown" and meta["coverage"]["next_epoch"] == 2
    assert not list(stem.parent.glob("*.tmp"))


@pytest.mark.parametrize("send_thread", [True, False], ids=["sender-thread", "loop-thread"])
def test_a_send_the_bus_refuses_goes_back_through_send_failed_and_is_retrained(
    tmp_path: Path, send_thread: bool
) -> None:
    core = Coordinator(config("cpu-cadence", epochs=1))
    hub = MemoryHub(1)
    bus = FailingBus(hub)
    world = start_rank(hub)
    code, loop = run_loop(core, bus, tmp_path, send_thread=send_thread)
    world.thread.join(30)
    assert code == EXIT_OK and world.result == [0]
    assert len(bus.refused) == 1 and loop.sends_failed == 1 and core.lost_sends == 1
    recs = read_records(tmp_path / "coordinator.jsonl")
    (failed,) = [r for r in recs if r["event"] == "send_failed"]
    assert failed["msg"]["type"] == "StartEpoch"
    lines = (tmp_path / "metrics.csv").read_text().splitlines()
    row = dict(zip(lines[0].split(","), lines[1].split(",")))
    assert int(row["samples"]) == EPOCH  # the refused chunk was offered again


class RefusingBroadcastBus(MemoryCoordinatorBus):
    """Refuses the first ``EpochAggregated`` broadcast (a write Redis rejected)."""

    def __init__(self, hub: MemoryHub) -> None:
        super().__init__(hub)
        self.refused = 0

    def broadcast(self, msg: ControlWire) -> None:
        if isinstance(msg, EpochAggregated) and not self.refused:
            self.refused += 1
            raise ConnectionError("refused once")
        super().broadcast(msg)


class BacklogBus(MemoryCoordinatorBus):
    """Says every read left entries waiting (a coordinator far behind its ranks)."""

    behind = True


def test_a_loop_behind_its_input_declares_no_rank_dead_and_records_its_ticks_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import structlog

    # A heartbeat timeout shorter than any gap between two reads: every tick would find
    # the rank silent, were it not that the loop is behind its input.
    core = Coordinator(config("cpu-cadence", epochs=1, heartbeat_timeout=1e-6))
    hub = MemoryHub(1)
    world = start_rank(hub)
    rec = DispatchRecorder(tmp_path, "coordinator")
    loop = CoordinatorLoop(core, BacklogBus(hub), recorder=rec)
    monkeypatch.setattr(runtime, "BEHIND_NOTE_S", 0.0)  # say so at once, not after 10 s
    try:
        with structlog.testing.capture_logs() as logs:
            code = loop.run()
    finally:
        rec.close()
    world.thread.join(30)
    assert code == EXIT_OK and world.result == [0]
    assert not core.live.dead[0]
    ticks = [r for r in read_records(tmp_path / "coordinator.jsonl") if r["event"] == "tick"]
    assert ticks and all(r["behind"] is True for r in ticks)
    # the loop counts it and says it, naming what to do
    assert loop.profile.ticks_behind == loop.profile.ticks > 0
    said = [e for e in logs if e["event"] == "coordinator_behind"]
    assert said and "--ingest-procs" in said[0]["detail"]
    behind = loop.behind_for()  # what the loop publishes for `flodl-bus status`
    assert behind is not None and behind >= 0.0


def test_a_loop_that_keeps_up_is_not_behind_and_one_that_catches_up_no_longer_is() -> None:
    loop = CoordinatorLoop(Coordinator(config("cpu-cadence")), MemoryCoordinatorBus(MemoryHub(1)))
    assert loop.behind_for() is None
    loop._note_behind(True)
    first = loop.behind_for()
    assert first is not None
    loop._note_behind(True)  # still behind: counted from the first tick behind
    again = loop.behind_for()
    assert again is not None and again >= first
    loop._note_behind(False)
    assert loop.behind_for() is None


def test_a_refused_broadcast_is_counted_and_the_run_goes_on(tmp_path: Path) -> None:
    core = Coordinator(config("cpu-cadence", epochs=2))
    hub = MemoryHub(1)
    bus = RefusingBroadcastBus(hub)
    world = start_rank(hub)
    code, loop = run_loop(core, bus, tmp_path)
    world.thread.join(30)
    assert code == EXIT_OK and world.result == [0]
    assert bus.refused == 1 and loop.broadcasts_failed == 1


def test_without_exiting_ranks_the_loop_leaves_after_the_grace(tmp_path: Path) -> None:
    # Zero epochs: the core finishes at start; no rank exists to say Exiting.
    core = Coordinator(config("cpu-sync", epochs=0, final_eval=False))
    hub = MemoryHub(1)
    code, loop = run_loop(
        core, MemoryCoordinatorBus(hub), tmp_path, first_contact=0.0, exit_grace=0.2
    )
    assert code == EXIT_OK and loop.finished is not None
    sent = [d.msg for d in hub.rank_bus(0).read_control(0)]
    assert any(isinstance(m, Shutdown) for m in sent)


def test_a_stop_request_broadcasts_shutdown_and_exits_interrupted(tmp_path: Path) -> None:
    core = Coordinator(config("nccl-cadence"))
    hub = MemoryHub(1)
    rec = DispatchRecorder(tmp_path, "coordinator")
    loop = CoordinatorLoop(
        core,
        MemoryCoordinatorBus(hub),
        recorder=rec,
        options=LoopOptions(first_contact=0.0, exit_grace=0.2),
    )
    loop.stop.set()
    assert loop.run() == EXIT_INTERRUPTED
    rec.close()
    sent = [d.msg for d in hub.rank_bus(0).read_control(0)]
    assert isinstance(sent[-1], Shutdown)
    # The stop is a core call in the record (replay reproduces it), not a side event.
    assert [r["event"] for r in read_records(tmp_path / "coordinator.jsonl")][-2:] == [
        "interrupt",
        "end",
    ]


def metrics(epoch: int, samples: Sequence[int]) -> EpochMetrics:
    return EpochMetrics(
        epoch=epoch,
        avg_loss=0.5,
        epoch_ms=10.0,
        per_rank_throughput=tuple(1.0 for _ in samples),
        per_rank_batch_share=tuple(1 / len(samples) for _ in samples),
        per_rank_loss=tuple(0.5 for _ in samples),
        per_rank_samples=tuple(samples),
    )


def test_an_eval_lands_on_the_row_of_the_epoch_it_scores_even_when_it_comes_first(
    tmp_path: Path,
) -> None:
    table = MetricsTable(tmp_path / "metrics.csv", 2)
    table.on_eval(2, 0.91)  # scheduled at the start of epoch 2: scores epoch 1
    table.on_epoch(metrics(0, [64, 32]), version=1, syncs=1, step=3, anchor=10)
    table.on_epoch(metrics(1, [32, 64]), version=2, syncs=2, step=6, anchor=10)
    lines = (tmp_path / "metrics.csv").read_text().splitlines()
    rows = [dict(zip(lines[0].split(","), ln.split(","))) for ln in lines[1:]]
    assert [(r["epoch"], r["eval_metric"], r["samples"]) for r in rows] == [
        ("0", "", "96"),
        ("1", "0.91", "96"),
    ]
    assert rows[1]["samples_r1"] == "64" and rows[1]["version"] == "2"


def test_the_csv_speaks_the_consoles_units_samples_per_second_and_syncs_per_epoch(
    tmp_path: Path,
) -> None:
    table = MetricsTable(tmp_path / "metrics.csv", 2)
    em = dataclasses.replace(metrics(0, [64, 32]), per_rank_throughput=(1.74789, 0.5))
    table.on_epoch(em, version=3, syncs=3, step=3, anchor=10)
    table.on_epoch(metrics(1, [32, 64]), version=5, syncs=5, step=6, anchor=10)
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert rows[0]["samples_per_s_r0"] == "1747.89" and rows[0]["samples_per_s_r1"] == "500"
    assert [(r["syncs"], r["syncs_total"]) for r in rows] == [("3", "3"), ("2", "5")]
    assert not any(c.startswith("throughput") for c in rows[0])


def test_meta_file_is_replaced_whole(tmp_path: Path) -> None:
    stem = str(tmp_path / "deep" / "stem")
    write_meta_file(stem, {"version": 1})
    path = write_meta_file(stem, {"version": 2})
    assert json.loads(path.read_text()) == {"version": 2}
    assert sorted(p.name for p in path.parent.iterdir()) == ["stem.meta.json"]


def test_form_world_admits_hellos_already_waiting_and_answers_on_the_join_stream() -> None:
    client = fakeredis.FakeRedis()
    secret = new_secret()
    ident = CoordinatorIdentity.generate().signing
    worker_side = JoinStream(client, "run-x", secret, answers=ident.public)
    worker_side.post(Hello("w1", "h", "sig"))
    worker_side.post(Hello("w2", "h", "other"))
    worker_side.post(Hello("w3", "h", "sig"))
    coord_side = JoinStream(client, "run-x", secret, signer=ident)
    adm = Admission(dataset_sig="sig", world_size=2)
    form_world(JoinDesk(coord_side, adm), block_ms=10)
    answers = [m for _, m in worker_side.read("0", None)[0] if not isinstance(m, Hello)]
    refused = answers[0]
    assert isinstance(refused, Reject) and refused.worker_id == "w2"
    assert "other" in refused.reason
    assert answers[1:] == [Assign("w1", 0, 2), Assign("w3", 1, 2)]


def test_hellos_from_before_the_coordinators_identity_take_no_rank() -> None:
    """A worker says Hello only after reading the identity the coordinator publishes, so
    Hellos older than that belong to an earlier incarnation of the run: its workers are
    gone, and their keys were agreed with a coordinator that is gone too."""
    client = fakeredis.FakeRedis()
    secret = new_secret()
    earlier = CoordinatorIdentity.generate().signing
    old_run = JoinStream(client, "run-y", secret, signer=earlier)
    old_run.post(Hello("gone0", "h", "sig"))
    old_run.post(Hello("gone1", "h", "sig"))
    old_run.post(Assign("gone0", 0, 2))  # the previous coordinator answered this one
    published_at = format_id(stream_top(client, RunKeys("run-y").join))
    old_run.post(Hello("live", "h", "sig"))
    adm = Admission(dataset_sig="sig", world_size=2)
    ours = CoordinatorIdentity.generate().signing
    desk = JoinDesk(JoinStream(client, "run-y", secret, signer=ours), adm, after=published_at)
    assert desk.poll(None) == []
    assert adm.joined == 1
    old_run.post(Hello("live2", "h", "sig"))
    assert desk.poll(None) == [Assign("live", 0, 2), Assign("live2", 1, 2)]


class UnreadBus(MemoryCoordinatorBus):
    """Says rank 0 left a ``StartEpoch`` unread past the budget once it trained a bit."""

    def __init__(self, hub: MemoryHub) -> None:
        super().__init__(hub)
        self.asked: list[float] = []

    def overdue(self, budget_s: float) -> list[tuple[int, str, float]]:
        self.asked.append(budget_s)
        return [(0, "StartEpoch", budget_s + 1.0)] if len(self.asked) >= 2 else []


def test_a_rank_that_leaves_its_control_unread_is_named_and_declared_dead(
    tmp_path: Path,
) -> None:
    import structlog

    core = Coordinator(config("cpu-cadence", epochs=400, heartbeat_timeout=7.0))
    hub = MemoryHub(1)
    bus = UnreadBus(hub)
    world = start_rank(hub)
    with structlog.testing.capture_logs() as logs:
        run_loop(core, bus, tmp_path, exit_grace=5.0)
    world.thread.join(30)
    assert bus.asked and set(bus.asked) == {7.0}  # the heartbeat timeout is the budget
    named = [e for e in logs if e["event"] == "rank_not_reading"]
    assert named and named[0]["rank"] == 0 and named[0]["unread"] == "StartEpoch"
    assert core.live.dead[0]
    recs = read_records(tmp_path / "coordinator.jsonl")
    assert [r["rank"] for r in recs if r["event"] == "declare_dead"] == [0]


class BehindUnreadBus(UnreadBus):
    """``UnreadBus`` behind its input for its first ``behind_s`` seconds."""

    def __init__(self, hub: MemoryHub, behind_s: float) -> None:
        super().__init__(hub)
        self.until = time.monotonic() + behind_s
        self.asked_behind = 0

    @property  # type: ignore[override]
    def behind(self) -> bool:
        return time.monotonic() < self.until

    def overdue(self, budget_s: float) -> list[tuple[int, str, float]]:
        self.asked_behind += self.behind
        return super().overdue(budget_s)


def test_a_loop_behind_its_input_takes_no_rank_for_one_leaving_its_control_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import structlog

    # The heartbeat that says where a rank read may be in the backlog: while behind,
    # nobody is judged by it; once caught up, the rank still unread is named as before.
    core = Coordinator(config("cpu-cadence", epochs=400, heartbeat_timeout=7.0))
    hub = MemoryHub(1)
    bus = BehindUnreadBus(hub, behind_s=2.5)
    world = start_rank(hub)
    monkeypatch.setattr(runtime, "BEHIND_NOTE_S", 0.0)
    with structlog.testing.capture_logs() as logs:
        run_loop(core, bus, tmp_path, exit_grace=5.0)
    world.thread.join(30)
    assert bus.asked_behind == 0
    assert bus.asked and core.live.dead[0]  # judged, once the loop caught up
    assert [e["event"] for e in logs if e["event"].startswith("coordinator_")][-1] == (
        "coordinator_caught_up"
    )


class BatchingBus(MemoryCoordinatorBus):
    """The in-memory bus with ``send_batch`` (one call a run, as Redis's bus), noting
    each call's message types in ``events``."""

    def __init__(self, hub: MemoryHub, events: list[tuple[str, object]]) -> None:
        super().__init__(hub)
        self.events = events

    def send_batch(self, items: Sequence[tuple[int | None, ControlWire]]) -> list[str]:
        self.events.append(("write", tuple(type(msg).__name__ for _, msg in items)))
        for rank, msg in items:
            if rank is None:
                super().broadcast(msg)
            else:
                super().send(rank, msg)
        return [str(i) for i in range(len(items))]

    def send(self, rank: int, msg: ControlWire) -> None:
        self.events.append(("write", (type(msg).__name__,)))
        super().send(rank, msg)

    def broadcast(self, msg: ControlWire) -> None:
        self.events.append(("write", (type(msg).__name__,)))
        super().broadcast(msg)


def test_an_epochs_aggregate_and_the_plans_beside_it_are_written_before_metrics_csv(
    tmp_path: Path,
) -> None:
    # One tick returns the epoch's aggregate (a broadcast) and the plans sent beside it
    # (unicasts): they go back to back, the console line and metrics.csv after both,
    # not between them.
    events: list[tuple[str, object]] = []

    class NotedMetrics(MetricsTable):
        def on_epoch(self, em: EpochMetrics, **kw: int) -> None:  # type: ignore[override]
            events.append(("csv", em.epoch))
            super().on_epoch(em, **kw)

    core = Coordinator(config("cpu-cadence", epochs=3, eval_every=1))
    hub = MemoryHub(1)
    world = start_rank(hub)
    rec = DispatchRecorder(tmp_path, "coordinator")
    loop = CoordinatorLoop(
        core,
        BatchingBus(hub, events),
        recorder=rec,
        metrics=NotedMetrics(tmp_path / "metrics.csv", 1),
        options=LoopOptions(),
    )
    try:
        code = loop.run()
    finally:
        rec.close()
    world.thread.join(30)
    assert code == EXIT_OK and world.result == [0]
    at = events.index(("csv", 0))
    assert events[at - 2 : at] == [
        ("write", ("EpochAggregated",)),
        ("write", ("ArmEpochEval", "StartEpoch")),
    ], events[at - 6 : at + 2]
    assert [e for e in events if e[0] == "csv"] == [("csv", 0), ("csv", 1), ("csv", 2)]
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [r["epoch"] for r in rows] == ["0", "1", "2"]


class HoldingRankBus(MemoryRankBus):
    """A world of one's publisher, as ``bus.publisher`` makes it with
    ``publish_epoch_end_lazy`` and a linger that never ends: what may wait (``LAZY``,
    ``EPOCH_END``) waits for a step report, an urgent message or ``hurry``, in order."""

    def __init__(self, hub: MemoryHub) -> None:
        super().__init__(hub, 0)
        self.held: list[UpstreamMsg] = []
        self.hurried = 0

    def publish(self, msg: UpstreamMsg) -> None:
        self.held.append(msg)
        if isinstance(msg, Batch) or type(msg) not in LAZY | EPOCH_END:
            self._release()

    def hurry(self) -> None:
        self.hurried += 1
        self._release()

    def flush(self, timeout: float) -> bool:
        self._release()
        return super().flush(timeout)

    def _release(self) -> None:
        held, self.held = self.held, []
        for msg in held:
            super().publish(msg)


def test_a_rank_hurries_what_its_bus_holds_back_before_it_waits_for_control(
    tmp_path: Path,
) -> None:
    # The last epoch's MetricsMsg is what the coordinator ends the run on: held back on a
    # rank that then waits for the coordinator's answer, the run would never end.
    hub = MemoryHub(1)
    bus = HoldingRankBus(hub)
    result: list[int] = []
    rank = threading.Thread(
        target=lambda: result.append(run_rank(digits.job, bus, RankOptions(world_size=1))),
        daemon=True,
    )
    rank.start()
    core = Coordinator(config("cpu-cadence", epochs=2, eval_every=1))
    loop_result: list[int] = []
    loop = threading.Thread(
        target=lambda: loop_result.append(run_loop(core, MemoryCoordinatorBus(hub), tmp_path)[0]),
        daemon=True,
    )
    loop.start()
    loop.join(60)
    rank.join(30)
    assert loop_result == [EXIT_OK] and result == [0]
    assert bus.hurried > 0
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [r["epoch"] for r in rows] == ["0", "1"] and rows[-1]["eval_metric"]
