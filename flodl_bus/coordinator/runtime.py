"""The coordinator's IO loop around the sans-IO core (DESIGN §2, §6).

Two phases:

1. ``form_world`` (``join_desk``): admit workers from the ``join`` stream
   (``membership.Admission``) until the world forms, posting their Assign / Reject answers.
2. ``CoordinatorLoop.run``: read every rank's upstream in one blocking call, hand each
   delivery to ``core.handle`` in order, apply what it returns in that order, ack, then
   ``core.tick`` once per read batch. Every dispatch, and every tick that emits
   something or changes the core's state, is one record line (``DispatchRecorder``);
   ``metrics.csv`` gets one row per ``EpochAggregated`` (``outputs``).

Ordering: effects are applied strictly in the order the core returned them, across
``Send`` and ``Broadcast``, because the bus numbers control entries from one clock in
call order and per-rank order is what the ranks rely on (arm-eval before the snapshot
request, the final reduce before Shutdown). With ``LoopOptions.send_thread`` (opt-in),
the writes go through one sender thread (``sender.SendLane``) in that order while
``run`` runs, and the loop reads on meanwhile;
what the bus refused comes back at the loop's next turn as the recorded core call
(``send_failed``) it was when the loop wrote them itself.

The core never sees a clock: ``now`` is read once per dispatch (and once per tick) here.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import structlog

from flodl_bus.bus.api import CoordinatorBus, Delivery, IngestHung
from flodl_bus.coordinator.core import Coordinator
from flodl_bus.coordinator.effects import Alert, Broadcast, Finished, Out, Send, WriteMeta
from flodl_bus.coordinator.join_desk import (
    Interrupted,
    JoinDesk,
    JoinPort,
    WorldNotFormed,
    form_world,
)
from flodl_bus.coordinator.loop_profile import LoopProfile
from flodl_bus.coordinator.outputs import MetricsTable, write_meta_file
from flodl_bus.coordinator.sender import SendLane
from flodl_bus.coordinator.shadow import CHECK_EVERY_S, NO_STATE, ShadowRecorder
from flodl_bus.coordinator.stall import STALL_CHECK_S, StallWatch
from flodl_bus.coordinator.supervisor import SupervisorFeed
from flodl_bus.exits import CONFIG, FAILED, OK, STOPPED
from flodl_bus.protocol.messages import (
    CoordHeartbeat,
    DeclareDead,
    EpochAggregated,
    EvalBroadcast,
    is_upstream,
)
from flodl_bus.record.dispatch import DispatchRecorder

# Names other modules imported from here before the split; their homes are above.
__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_SAVED",
    "CoordinatorLoop",
    "Interrupted",
    "JoinDesk",
    "JoinPort",
    "LoopOptions",
    "MetricsTable",
    "WorldNotFormed",
    "form_world",
    "write_meta_file",
]

log = structlog.get_logger("flodl_bus.coordinator")
#: ``1``: a sender thread writes the loop's control (``LoopOptions.send_thread``)
SEND_THREAD_ENV: Final = "FLODL_SEND_THREAD"
#: how long the loop stays behind its input before it says so (and again every as long)
BEHIND_NOTE_S: Final = 10.0

#: The loop exited because every live rank said Exiting after a clean Shutdown.
EXIT_OK: Final = OK
#: The run ended with ShutdownWithSave (max failure, all ranks lost, a stalled reduce).
EXIT_SAVED: Final = STOPPED
#: Stopped from outside before the run finished; ``cli`` reports 128 + the signal.
EXIT_INTERRUPTED: Final = 130


@dataclass(frozen=True, slots=True)
class LoopOptions:
    #: BLOCK of one upstream read; bounds how late a tick can run (staleness sweeps,
    #: coordinator heartbeats) and stays far below the bus's socket timeout.
    block_ms: int = 100
    #: After Finished, how long to wait for every live rank's Exiting.
    exit_grace: float = 30.0
    #: Before ``core.start``: how long to wait for every rank's first upstream entry.
    #: Heartbeat staleness counts from ``start``, so a rank still importing torch when
    #: the world formed is not declared dead for being slow to boot.
    first_contact: float = 30.0
    #: How often the join stream is polled for late Hellos once the world formed.
    join_poll_every: float = 0.5
    #: Write the core's Sends and Broadcasts on a thread of their own (``sender``), so
    #: the loop reads on while they travel; False (the default) writes them on the
    #: loop's thread. ``FLODL_SEND_THREAD=1`` turns it on for a run. Opt-in: at 1,024
    #: ranks on the 16-core host it took a quarter of the loop's work off it and made
    #: 37x fewer round trips, but the epoch time did not move and the median dispatch
    #: got 10-15 ms slower (BENCHMARKS.md, 2026-12-06, fifth session).
    send_thread: bool = field(default_factory=lambda: os.environ.get(SEND_THREAD_ENV) == "1")

    def __post_init__(self) -> None:
        if self.block_ms < 1:
            raise ValueError("block_ms must be at least 1")
        if self.exit_grace < 0 or self.first_contact < 0:
            raise ValueError("exit_grace and first_contact must be >= 0")


# ---------------------------------------------------------------------------- loop


def _default_rank_of(stream: str) -> int | None:
    tail = stream.rsplit(":", 1)[-1]
    return int(tail) if tail.isascii() and tail.isdigit() else None


class CoordinatorLoop:
    """Drive ``core`` over ``bus`` until the run is over (see the module docstring)."""

    def __init__(
        self,
        core: Coordinator,
        bus: CoordinatorBus,
        *,
        recorder: DispatchRecorder | None = None,
        metrics: MetricsTable | None = None,
        options: LoopOptions | None = None,
        rank_of: Callable[[str], int | None] = _default_rank_of,
        clock: Callable[[], float] = time.monotonic,
        join: JoinDesk | None = None,
    ) -> None:
        self.core = core
        self.bus = bus
        self.rec = recorder
        #: the recorder that rebuilds the core's states itself (no summaries here)
        self._shadow = (
            recorder if isinstance(recorder, ShadowRecorder) and not recorder.needs_states else None
        )
        self._next_shadow_check = 0.0
        # A record process takes each call's delta, made here, and copies of the whole
        # states it is sent: nothing reads an old summary's lists, so they may be set in
        # place instead of copied at every message (``coordinator.summary``). The record
        # on this thread, and the shadow, read the states themselves: copied as before.
        core.summarizer.mirror = (
            recorder is not None
            and self._shadow is None
            and recorder.in_process
            and recorder.deltas
        )
        self.broadcasts_failed = 0
        #: the core's state summary as of the last recorded call (see _state_before)
        self._state: dict[str, Any] | None = None
        self.metrics = metrics
        self.options = options or LoopOptions()
        self.rank_of = rank_of
        #: ``rank_of`` per stream, asked once (it parses the key)
        self._stream_ranks: dict[str, int | None] = {}
        self.clock = clock
        self.join = join
        self._next_join_poll = 0.0
        self.stop = threading.Event()
        #: a second stop request: do not wait out the exit grace for Exiting
        self.hurry = threading.Event()
        #: child exits reported by the launcher (``--supervisor-fd``), if any
        self.supervisor: SupervisorFeed | None = None
        self._next_unread_check = 0.0
        #: ranks reported gone before ``core.start``: declared dead right after it
        self._gone_early: list[int] = []
        self.finished: Finished | None = None
        self.finished_at: float | None = None
        self.dispatches = 0
        self.sends_failed = 0
        self.evals: list[tuple[int, float]] = []
        self._save_path = core.config.save_path
        #: flodl's stall dump: a run that stops moving logs why at 15 s and 120 s
        self.stall = StallWatch()
        self._next_stall_check = 0.0
        #: since when every read may have left entries waiting (None: caught up)
        self._behind_since: float | None = None
        self._next_behind_note = 0.0
        #: where the loop's time went, stage by stage (``loop_profile``)
        self.profile = LoopProfile()
        #: why the record stopped being written (its process died): the run stops
        self.record_lost: str | None = None
        #: why the upstream stopped being read (a reader process hung): the run stops
        self.ingest_hung: str | None = None
        self._ingest_stopped = False
        #: the thread writing Sends and Broadcasts while ``run`` runs (None: written on
        #: the loop's thread, as before ``run`` and after it)
        self._lane: SendLane | None = None

    # ------------------------------------------------------------------ public

    def run(self) -> int:
        early = self._await_first_contact()
        if self.options.send_thread:
            self._lane = SendLane(self.bus)
        try:
            return self._run(early)
        finally:
            self._close_lane()

    def _run(self, early: list[Delivery]) -> int:
        core = self.core
        prof = self.profile
        pc, tt = time.perf_counter, time.thread_time
        w0, c0 = pc(), tt()
        prof.opened_at = time.monotonic()
        now = self.clock()
        before = self._state_before() if self.rec is not None else None
        outs = core.start(now)
        if self.rec is not None:
            assert before is not None
            after = self._state_after()
            self._core_call("start", before, after, outs, now=now)
        self._apply(outs, now)
        for r in self._gone_early:
            self._declare_dead(r)
        log.info(
            "run_started",
            mode=core.config.mode,
            world_size=core.ws,
            epochs=core.config.num_epochs,
            start_epoch=core.start_epoch,
        )
        if early:
            self._dispatch_all(early)
        interrupted = False
        while True:
            if self.record_lost is None and self.rec is not None and self.rec.failure:
                self._stop_for_record(self.rec.failure)
            if self.ingest_hung is not None and not self._ingest_stopped:
                self._stop_for_ingest(self.ingest_hung)
            if self.stop.is_set() and not interrupted and self.finished is None:
                interrupted = True
                self._interrupt()
            if self._lane is not None:
                self._take_refused()
            if self._done():
                break
            t0, u0 = pc(), tt()
            deliveries = self._read_upstream()
            prof.add_read(pc() - t0, tt() - u0, bool(deliveries))
            if deliveries:
                self._dispatch_all(deliveries)
            self._poll_supervisor()
            if self.finished is None:
                t0, sent = pc(), prof.send
                self._tick()
                prof.tick += pc() - t0 - (prof.send - sent)
                prof.ticks += 1
                self._check_unread()
            self._poll_join()
        self._drain_lane()
        prof.wall_s += pc() - w0
        prof.cpu_s += tt() - c0
        lane = self._lane
        log.info(
            "loop_profile",
            **prof.brief(),
            **({} if lane is None else {"sender_s": round(lane.busy_s, 3), "calls": lane.calls}),
        )
        if self._shadow is not None and self.record_lost is None:
            self._shadow.check(core.state_summary())
        if self.rec is not None and self.record_lost is None:
            self.rec.event(
                "end",
                now=self.clock(),
                reason=None if self.finished is None else self.finished.reason,
                exited=[r for r in range(core.ws) if core.live.exited[r]],
                dead=[r for r in range(core.ws) if core.live.dead[r]],
                dispatches=self.dispatches,
            )
            self.rec.flush()
        if core.refused is not None:
            return CONFIG
        if self.record_lost is not None or self.ingest_hung is not None:
            return FAILED
        if interrupted:
            return EXIT_INTERRUPTED
        if self.finished is not None and self.finished.reason is not None:
            return EXIT_SAVED
        return EXIT_OK

    # --------------------------------------------------------------- internals

    def _await_first_contact(self) -> list[Delivery]:
        """Buffer upstream until every rank has been heard from (bounded)."""
        ws = self.core.ws
        heard = [False] * ws
        early: list[Delivery] = []
        deadline = self.clock() + self.options.first_contact
        next_beat = self.clock()
        gone: set[int] = set()
        while (
            not all(h or r in gone for r, h in enumerate(heard))
            and self.clock() < deadline
            and not self.stop.is_set()
        ):
            if self.supervisor is not None:
                for ex in self.supervisor.take():
                    # A rank whose process is gone will never be heard: no wait for it.
                    if 0 <= ex.rank < ws and ex.rank not in gone:
                        gone.add(ex.rank)
                        self._gone_early.append(ex.rank)
                        log.warning("rank_process_exited", rank=ex.rank, rc=ex.rc)
            if self.clock() >= next_beat:
                # Ranks already up count our silence against their liveness escape
                # hatch; the core's own heartbeats only start with ``core.start``.
                next_beat = self.clock() + self.core.config.coord_heartbeat_every
                self.bus.broadcast(CoordHeartbeat())
            got = self._read_upstream()
            for d in got:
                r = self.rank_of(d.stream)
                if r is not None and 0 <= r < ws:
                    heard[r] = True
            early += got
            self._poll_join()
        if not all(h or r in gone for r, h in enumerate(heard)):
            log.warning(
                "ranks_silent_at_start",
                silent=[r for r in range(ws) if not heard[r]],
                waited_s=self.options.first_contact,
            )
        return early

    def _dispatch_all(self, deliveries: Sequence[Delivery]) -> None:
        core = self.core
        rec = self.rec
        ranks = self._stream_ranks
        prof = self.profile
        pc = time.perf_counter
        # One reading per boundary, each message's end the next one's start; sums in
        # locals, added to the profile once per read.
        t = pc()
        handle = record = apply = 0.0
        handled = 0
        for d in deliveries:
            rank = ranks.get(d.stream, -1)
            if rank == -1:
                rank = ranks[d.stream] = self.rank_of(d.stream)
            if rank is None:
                log.error("upstream_from_unknown_stream", stream=d.stream, entry=d.entry_id)
                continue
            msg = d.msg
            if not is_upstream(msg):
                # The bus decodes upstream entries only; anything else is its bug.
                log.error("not_an_upstream_message", stream=d.stream, type=type(msg).__name__)
                continue
            now = self.clock()
            # a cached summary but for the run's first call (see _state_before): counted
            # with the message's lookup in handle, saving a clock reading per message
            before = self._state_before() if rec is not None else None
            outs = core.handle(rank, msg, now)
            t2 = pc()
            self.dispatches += 1
            if rec is not None:
                assert before is not None
                after = self._state_after()
                rec.dispatch(
                    stream=d.stream,
                    entry_id=d.entry_id,
                    msg=d.msg,
                    now=now,
                    before=before,
                    after=after,
                    out=outs,
                    sender=rank,
                    changes=core.summary_changes(after, before),
                    patches=core.summary_patches(after, before),
                    delta=core.summary_delta(after, before),
                )
            t3, sent = pc(), prof.send
            self._apply(outs, now)
            t4 = pc()
            record += t3 - t2
            handle += t2 - t
            apply += t4 - t3 - (prof.send - sent)
            t = t4
            handled += 1
        self.bus.ack(deliveries)
        prof.ack += pc() - t
        prof.handle += handle
        prof.record += record
        prof.apply += apply
        prof.messages += handled

    def _state_before(self) -> dict[str, Any]:
        if self._shadow is not None:
            return NO_STATE  # type: ignore[return-value]  # rebuilt by the record process
        # The core changes only through the calls recorded here (start, handle, tick,
        # send_failed), each of which refreshes the cache with its "after": so the last
        # "after" is exactly the next "before", and the summary is built once per call.
        if self._state is None:
            self._state = self.core.state_summary()
        return self._state

    def _state_after(self) -> dict[str, Any]:
        if self._shadow is not None:
            return NO_STATE  # type: ignore[return-value]
        self._state = self.core.state_summary(self._state)
        return self._state

    def _tick(self) -> None:
        core = self.core
        now = self.clock()
        self._watch_stall(now)
        behind = self.bus.behind
        self._note_behind(behind)
        if self.rec is None:
            self._apply(core.tick(now, behind=behind), now)
            return
        before = self._state_before()
        outs = core.tick(now, behind=behind)
        after = self._state_after()
        if outs or self._changed(before, after) or self._shadow is not None:
            # Written only where it is true: older records, which never say it, replay
            # as ticks that were not behind (``replay.coordinator``).
            extra: dict[str, Any] = {"behind": True} if behind else {}
            self._core_call("tick", before, after, outs, now=now, **extra)
            if self._shadow is not None and now >= self._next_shadow_check:
                self._next_shadow_check = now + CHECK_EVERY_S
                self._shadow.check(core.state_summary())
        else:
            # Unrecorded, unchanged: keep the very object the recorder holds as its last
            # state, so the next call's "before" is recognised without a comparison.
            self._state = before
        self._apply(outs, now)

    def _core_call(
        self,
        event: str,
        before: dict[str, Any],
        after: dict[str, Any],
        out: list[Out],
        **fields: Any,
    ) -> None:
        """A recorded core call other than a dispatch, with the entries the summarizer
        set in place between its two states (its mirror), which the delta writes."""
        assert self.rec is not None
        self.rec.core_call(
            event,
            before=before,
            after=after,
            out=out,
            patches=self.core.summary_patches(after, before),
            delta=self.core.summary_delta(after, before),
            **fields,
        )

    def _changed(self, before: dict[str, Any], after: dict[str, Any]) -> bool:
        """Whether a call changed the state: its summary differs, or (the summarizer's
        mirror) a list of it was set in place, which the two summaries share."""
        return after != before or bool(self.core.summary_patches(after, before))

    def behind_for(self) -> float | None:
        """Seconds the loop has been behind its input (``CoordinatorBus.behind`` at every
        tick since), None while it keeps up: ``flodl-bus status`` shows it, since a rank's
        silence then may be the coordinator's own backlog."""
        since = self._behind_since
        return None if since is None else max(0.0, time.monotonic() - since)

    def _note_behind(self, behind: bool) -> None:
        """Count the ticks behind the loop's input, and say so when it stays behind: its
        ranks wait on it, and a death is not declared until it catches up."""
        at = time.monotonic()
        if not behind:
            if self._behind_since is not None and at - self._behind_since >= BEHIND_NOTE_S:
                log.info("coordinator_caught_up", behind_s=round(at - self._behind_since, 1))
            self._behind_since = None
            return
        self.profile.ticks_behind += 1
        if self._behind_since is None:
            self._behind_since = at
        elif at - self._behind_since >= BEHIND_NOTE_S and at >= self._next_behind_note:
            self._next_behind_note = at + BEHIND_NOTE_S
            log.warning(
                "coordinator_behind",
                behind_s=round(at - self._behind_since, 1),
                ranks=self.core.ws,
                detail="its ranks' entries wait unread: deaths wait until it catches up; "
                "fewer ranks per coordinator, reader processes (--ingest-procs) or longer "
                "steps let it keep up",
            )

    def _watch_stall(self, now: float) -> None:
        # Once a second, not every tick: the progress key reads every rank's steps.
        if now < self._next_stall_check:
            return
        self._next_stall_check = now + STALL_CHECK_S
        core = self.core
        if not core.training:
            return
        progress = (core.version, core.global_step, core.last_aggregated, tuple(core.ledger.steps))
        waited = self.stall.check(progress, now)
        if waited is None:
            return
        # Everything a shut gate or an empty dispatch waits on, in one line (the state the
        # record keeps, read between two core calls).
        state = core.state_summary()
        log.warning(
            "stall_dump",
            stalled_s=round(waited, 1),
            gate=state["gate"],
            rank_epoch=state["rank_epoch"],
            steps=state["steps"],
            counts=state["counts"],
            in_flight=state["in_flight"],
            pools=state["pools"],
            acks=state["acks"],
            cpu_pending=state["cpu_pending"],
            throttled=state["throttled"],
            dead=state["dead"],
            exited=state["exited"],
            heard_s=core.live.heard_ago(now),
        )

    def _apply(self, outs: Sequence[Out], now: float) -> None:
        pending = list(outs)
        send_batch = getattr(self.bus, "send_batch", None)
        lane = self._lane
        # What consecutive runs of writes carried, observed once the last of them went:
        # an epoch's aggregate (a broadcast) and the plans sent beside it (unicasts) go
        # in back-to-back round trips, not a console line and a metrics.csv write apart.
        written: list[object] = []
        i = 0
        while i < len(pending):
            o = pending[i]
            i += 1
            if written and not (send_batch is not None and isinstance(o, Send | Broadcast)):
                self._observe_all(written)
            if lane is not None and isinstance(o, Send | Broadcast):
                # Handed to the sender thread in the core's order (with whatever else it
                # returned between two effects kept in its place here): observed now,
                # as the core decided it; a refusal comes back through ``_take_refused``.
                j = i
                while j < len(pending) and isinstance(pending[j], Send | Broadcast):
                    j += 1
                writes: list[Send | Broadcast] = pending[i - 1 : j]  # type: ignore[assignment]
                i = j
                t0 = time.perf_counter()
                lane.put(writes)
                self.profile.send += time.perf_counter() - t0
                for w in writes:
                    self._observe(w.msg)
                continue
            if send_batch is not None and isinstance(o, Send | Broadcast):
                # A run of Sends, or of Broadcasts, in one round trip (``send_batch``: the
                # two never share one), in the core's order; other effects keep their place.
                j = i
                while j < len(pending) and type(pending[j]) is type(o):
                    j += 1
                if j > i:
                    run = pending[i - 1 : j]
                    i = j
                    self._send_run(send_batch, run, now, pending, written)
                    continue
            if isinstance(o, Send):
                failed = self._timed_send(self.bus.send, o.rank, o.msg)
                if failed is not None:
                    self._observe_all(written)
                    pending += self._send_failed(o, failed, now)
                    continue
                self.profile.sent += 1
                written.append(o.msg)
            elif isinstance(o, Broadcast):
                failed = self._timed_send(self.bus.broadcast, o.msg)
                if failed is not None:
                    self._observe_all(written)
                    self._broadcast_failed(o, failed, now)
                    continue
                self.profile.broadcasts += 1
                written.append(o.msg)
            elif isinstance(o, WriteMeta):
                self._write_meta(o)
            elif isinstance(o, Alert):
                level = o.level if o.level in ("debug", "info", "warning", "error") else None
                if level is None:
                    level = "critical" if o.level == "critical" else "warning"
                getattr(log, level)(o.event, detail=o.detail)
            elif isinstance(o, Finished) and self.finished is None:
                self.finished = o
                self.finished_at = now
                if self.metrics is not None:
                    self.metrics.on_end(self.core.avg_count)
                log.info(
                    "run_finished",
                    reason=None if o.reason is None else o.reason.snake,
                    epochs=self.core.last_aggregated + 1,
                    version=self.core.version,
                    global_step=self.core.global_step,
                )
        self._observe_all(written)

    def _observe_all(self, msgs: list[object]) -> None:
        """Observe ``msgs`` in order, and empty the list."""
        for m in msgs:
            self._observe(m)
        msgs.clear()

    def _send_run(
        self,
        send_batch: Callable[[Sequence[tuple[int | None, Any]]], object],
        run: Sequence[Out],
        now: float,
        pending: list[Out],
        written: list[object],
    ) -> None:
        """Write ``run`` in one round trip; its messages join ``written``, to be observed
        by the caller. A failure is taken through the core at once, after what was
        written before it is observed (the console reads the core's state)."""
        items = [(o.rank, o.msg) if isinstance(o, Send) else (None, o.msg) for o in run]  # type: ignore[union-attr]
        exc = self._timed_send(send_batch, items)
        if exc is not None:
            self._observe_all(written)
            # The batch is one transaction: none of it was written. Each message fails
            # as it would alone (a Send's chunk rolled back, a broadcast reported).
            for o in run:
                if isinstance(o, Send):
                    pending += self._send_failed(o, exc, now)
                elif isinstance(o, Broadcast):
                    self._broadcast_failed(o, exc, now)
            return
        if items[0][0] is None:
            self.profile.broadcasts += len(items)
        else:
            self.profile.sent += len(items)
        for o in run:
            assert isinstance(o, Send | Broadcast)
            written.append(o.msg)

    def _timed_send(self, call: Callable[..., object], *args: Any) -> Exception | None:
        """One bus write, its time in the profile's ``send``; what it raised, if it did."""
        t0 = time.perf_counter()
        try:
            call(*args)
        except Exception as exc:
            return exc
        finally:
            self.profile.send += time.perf_counter() - t0
            self.profile.send_calls += 1
        return None

    def _take_refused(self) -> None:
        """What the sender thread could not write since the last turn: each refused Send
        goes through the core (a recorded ``send_failed``, its effects applied now), each
        refused broadcast is reported, as when the loop wrote them itself."""
        assert self._lane is not None
        refused = self._lane.take()
        if not refused:
            return
        now = self.clock()
        more: list[Out] = []
        for r in refused:
            if isinstance(r.item, Send):
                more += self._send_failed(r.item, r.error, now)
            else:
                self._broadcast_failed(r.item, r.error, now)
        self._apply(more, now)

    def _drain_lane(self) -> None:
        """Before the run's last record lines: wait for every write handed to the sender
        thread, and take what it refused (a refused Send's rollback may send more)."""
        lane = self._lane
        if lane is None:
            return
        for _ in range(8):
            if not lane.drain(self.options.exit_grace + 5.0):
                log.error(
                    "control_writes_unfinished",
                    pending=lane.pending,
                    detail="Redis did not take the run's last control writes in time",
                )
                return
            if not lane.refused_waiting:
                return
            self._take_refused()

    def _close_lane(self) -> None:
        lane, self._lane = self._lane, None
        if lane is None:
            return
        lane.close(timeout=5.0)
        # counted once the thread is done with them (a write a closing lane still made
        # is in; one still hanging on Redis is not)
        prof = self.profile
        prof.sent += lane.sent
        prof.broadcasts += lane.broadcasts
        prof.send_calls += lane.calls
        prof.sender_s += lane.busy_s

    def _send_failed(self, o: Send, exc: Exception, now: float) -> list[Out]:
        """What the core does about a Send the bus could not write; its effects are
        applied after the current batch, in order (the rollback re-offers on a tick)."""
        self.sends_failed += 1
        log.error("send_failed", rank=o.rank, msg=type(o.msg).__name__, error=repr(exc)[:300])
        before = self._state_before() if self.rec is not None else None
        more = self.core.send_failed(o.rank, o.msg, now)
        if self.rec is not None:
            assert before is not None
            self._core_call(
                "send_failed", before, self._state_after(), more, rank=o.rank, msg=o.msg, now=now
            )
        return more

    def _broadcast_failed(self, o: Broadcast, exc: Exception, now: float) -> None:
        # Best effort (reference §4.16.3): a broadcast the transport could not write
        # (OOM under noeviction, an ACL refusal) is a lost control message to report,
        # not a reason to abandon the run.
        self.broadcasts_failed += 1
        log.error(
            "broadcast_failed",
            msg=type(o.msg).__name__,
            error=repr(exc)[:300],
            total=self.broadcasts_failed,
        )
        if self.rec is not None:
            # A fact of the run the core never sees: the record keeps it for the
            # timeline's LostBroadcast (replay skips free-form lines).
            self.rec.event(
                "lost_broadcast", control=type(o.msg).__name__, now=now, error=repr(exc)[:300]
            )

    def _observe(self, msg: object) -> None:
        """Console progress and metrics.csv from what the core broadcast."""
        core = self.core
        if isinstance(msg, EpochAggregated):
            em = msg.metrics
            if self.metrics is not None:
                self.metrics.on_epoch(
                    em,
                    version=core.version,
                    syncs=core.avg_count,
                    step=core.global_step,
                    anchor=core.elche.anchor,
                )
            log.info(
                "epoch_aggregated",
                epoch=em.epoch,
                avg_loss=round(em.avg_loss, 5) if math.isfinite(em.avg_loss) else None,
                epoch_ms=round(em.epoch_ms, 1),
                samples=list(em.per_rank_samples),
                version=core.version,
                anchor=core.elche.anchor,
            )
        elif isinstance(msg, EvalBroadcast):
            self.evals.append((msg.epoch, msg.metric))
            if self.metrics is not None:
                self.metrics.on_eval(msg.epoch, msg.metric)
            # The eval tagged k scores the model after epoch k - 1: logged by that epoch,
            # the numbering of the table and metrics.csv.
            log.info("eval", after_epoch=msg.epoch - 1, metric=round(msg.metric, 5))
        elif isinstance(msg, DeclareDead):
            log.warning("rank_declared_dead", rank=msg.rank, mono=round(time.monotonic(), 4))

    def _write_meta(self, o: WriteMeta) -> None:
        if self._save_path is None:
            log.warning("meta_without_save_path", reason=o.meta.get("reason"))
            return
        try:
            path = write_meta_file(self._save_path, o.meta)
        except OSError as exc:
            # The run goes on: a missing checkpoint meta costs a resume, not the run.
            log.error("meta_write_failed", path=f"{self._save_path}.meta.json", error=repr(exc))
            return
        log.info(
            "checkpoint_meta",
            path=str(path),
            reason=o.meta.get("reason"),
            version=o.meta.get("version"),
            epoch=o.meta.get("epoch"),
        )

    def _poll_supervisor(self) -> None:
        if self.supervisor is None:
            return
        for ex in self.supervisor.take():
            log.warning("rank_process_exited", rank=ex.rank, rc=ex.rc)
            self._declare_dead(ex.rank)

    def _check_unread(self) -> None:
        """A rank that heartbeats but has not read what it was sent within the heartbeat
        timeout is handled like a death, named with the entry it left unread (DESIGN
        §3 rule 11); checked about once a second."""
        overdue = getattr(self.bus, "overdue", None)
        now = time.monotonic()
        if overdue is None or now < self._next_unread_check:
            return
        if self.bus.behind:
            # Where a rank has read to travels in its heartbeats: behind our input, the
            # heartbeat that says it read may be waiting unread (4,096 simulated ranks
            # on one coordinator: every live rank was declared dead from this check).
            return
        self._next_unread_check = now + 1.0
        for rank, what, age in overdue(self.core.config.heartbeat_timeout):
            if 0 <= rank < self.core.ws and self.core.alive(rank):
                log.error(
                    "rank_not_reading",
                    rank=rank,
                    unread=what,
                    age_s=round(age, 1),
                    detail="alive (heartbeats) but its control is not taken over; "
                    "declared dead, its work handed on",
                )
                self._declare_dead(rank)

    def _declare_dead(self, rank: int) -> None:
        """A death reported from outside the core's sweep (the launcher saw the rank's
        process exit): a recorded core call, so replay reproduces it."""
        if not 0 <= rank < self.core.ws:
            return
        now = self.clock()
        before = self._state_before() if self.rec is not None else None
        outs = self.core.declare_dead(rank, now)
        if self.rec is not None:
            assert before is not None
            after = self._state_after()
            if outs or self._changed(before, after) or self._shadow is not None:
                self._core_call("declare_dead", before, after, outs, rank=rank, now=now)
        self._apply(outs, now)

    def _done(self) -> bool:
        if self.finished is None:
            return False
        core = self.core
        waiting = [r for r in range(core.ws) if not core.live.exited[r] and not core.live.dead[r]]
        if not waiting:
            return True
        if self.hurry.is_set():
            log.warning("exit_wait_cut_short", still_running=waiting)
            return True
        assert self.finished_at is not None
        if self.clock() - self.finished_at > self.options.exit_grace:
            log.warning(
                "exit_grace_expired", still_running=waiting, grace_s=self.options.exit_grace
            )
            return True
        return False

    def _interrupt(self) -> None:
        """Stop from outside: the core shuts the run down (a recorded core call, so a
        replay reproduces it), then the loop waits for Exiting."""
        now = self.clock()
        log.warning("interrupted", detail="broadcasting Shutdown")
        before = self._state_before() if self.rec is not None else None
        outs = self.core.interrupt(now)
        if self.rec is not None:
            assert before is not None
            self._core_call("interrupt", before, self._state_after(), outs, now=now)
        self._apply(outs, now)
        if self.finished is None:
            # Already shut down by the core before the stop request: still leave.
            self.finished = Finished(None)
            self.finished_at = now

    def _stop_for_record(self, why: str) -> None:
        """The record process died (``record.process``): a run that can no longer be
        recorded cannot be replayed, so it stops in order now (Shutdown to every rank,
        the exit grace for their Exiting) and the coordinator exits ``FAILED``."""
        self.record_lost = why
        log.error(
            "run_stopped_record_lost",
            why=why,
            detail="the record ends at its last line on disk (no end line: replay reports "
            "it incomplete); broadcasting Shutdown, exit 1",
        )
        if self.finished is None:
            self._interrupt()

    def _read_upstream(self) -> Sequence[Delivery]:
        try:
            return self.bus.read_upstream(self.options.block_ms)
        except IngestHung as exc:
            # Stopped at the loop's next turn (not here: this may be before the start);
            # the reader was replaced, so the stop still hears its ranks.
            if self.ingest_hung is None:
                self.ingest_hung = str(exc)
            return exc.deliveries

    def _stop_for_ingest(self, why: str) -> None:
        """A reader process hung (``bus.ingest``): its ranks went unheard for a while,
        a fault to look at, so the run stops in order now and the coordinator exits
        ``FAILED``, as when its record is lost."""
        self._ingest_stopped = True
        log.error(
            "run_stopped_ingest_hung",
            why=why,
            detail="broadcasting Shutdown, exit 1",
        )
        if self.finished is None:
            self._interrupt()

    def _poll_join(self) -> None:
        """Late Hellos: a retried one gets its Assign again, anyone else a Reject."""
        if self.join is None:
            return
        now = self.clock()
        if now < self._next_join_poll:
            return
        self._next_join_poll = now + self.options.join_poll_every
        self.join.poll(None, self.rec.event if self.rec is not None else None)
