"""The threads around a rank's training loop (reference §3.12).

* **reader**: reads merged control from ``RankBus.read_control``, does what
  ``worker.control.route`` decides for each entry (coordinator heartbeats, dead-rank
  notices and NCCL re-session requests are acted on here; the rest, the wire ``Update``'s
  next plan as a ``StartEpoch``, goes to the local ``Inbox``) and acks.
  It also runs the coordinator-liveness escape hatch.
  With a bus whose control can be taken without waiting (``poll_control``: the rank's
  bus in a process of its own, ``agent.rank_io``) the training thread takes it itself
  between steps (``Inbox.before_poll``) and the reader stands by: it wakes every
  ``POLL_STALE_S`` and reads only while the training thread does not poll (it waits on
  its inbox, or it is away in an eval, a collective, the job's code), so a rank that
  trains is not interrupted by a thread of its own for its control. Reads, their routing
  and their acks are made under one lock, so the two paths keep the read order.
* **heartbeat**: ``Heartbeat`` every second, independent of training, so a rank parked
  in a collective still looks alive.
* **session**: hands the latest ``NewNcclSession`` to the param plane off the reader
  thread (forming a group blocks; the reader must keep reading), then to the job's
  default group (``on_session``), which re-forms over the same survivors.

Publishing upstream is ``RankBus.publish`` (the transport owns the single writer).
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import assert_never

import structlog

from flodl_bus.bus.api import BusLost, Delivery, RankBus
from flodl_bus.bus.ids import ZERO, format_id
from flodl_bus.params.port import ParamPort
from flodl_bus.protocol.messages import (
    ControlMsg,
    Exiting,
    Heartbeat,
    NewNcclIdGenerated,
    NewNcclSession,
    Shutdown,
    is_control_wire,
)
from flodl_bus.worker import control
from flodl_bus.worker.inbox import Inbox, Origin

_log = structlog.get_logger("flodl_bus.worker")

#: Size of the uid a rank generates for a new collective session (the gloo/NCCL store
#: key of the survivors' group; flodl's NCCL ids are 128 bytes, a key needs far fewer).
NEW_SESSION_UID_BYTES = 32

#: a heartbeat's read position before anything was read (the start of a stream)
START_ID = format_id(ZERO)
#: the reader takes over the control a polling training thread has not polled for this
#: long (an eval, a collective, the job's own code between steps)
POLL_STALE_S = 0.05


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    heartbeat_interval: float = 1.0
    #: no control entry (of any kind) for this long = the coordinator is gone
    coord_liveness_timeout: float = 30.0
    #: reader poll; must stay well under the transport's socket timeout
    read_block_ms: int = 250

    def __post_init__(self) -> None:
        if self.heartbeat_interval <= 0:
            raise ValueError("heartbeat_interval must be positive")
        if self.coord_liveness_timeout <= 0:
            raise ValueError("coord_liveness_timeout must be positive")
        if self.read_block_ms < 1:
            raise ValueError("read_block_ms must be at least 1")


@contextlib.contextmanager
def heartbeats_meanwhile(bus: RankBus, interval: float) -> Iterator[None]:
    """Heartbeats from a thread of their own while the rank sets up, before its runtime
    (and its heartbeat thread) starts: the coordinator's liveness clock runs from the
    world's start, and building the model, loading the data and the default group's
    rendezvous (which waits for the slowest peer) may outlast the heartbeat timeout on
    a loaded host."""
    stop = threading.Event()

    def beat() -> None:
        beats = 0
        while not stop.is_set():
            beats += 1
            try:
                bus.publish(Heartbeat(rank=bus.rank, step_count=beats))
            except Exception as exc:  # a rank refused at setup closed its bus meanwhile
                _log.debug("early_heartbeat_failed", rank=bus.rank, error=repr(exc))
            stop.wait(interval)

    thread = threading.Thread(target=beat, name=f"rank{bus.rank}-early-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class RankRuntime:
    def __init__(
        self,
        *,
        bus: RankBus,
        inbox: Inbox,
        params: ParamPort,
        world_size: int,
        config: RuntimeConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_session: Callable[[bytes, int, int], None] | None = None,
        on_offered: Callable[[bytes, int, int], None] | None = None,
    ) -> None:
        self.bus = bus
        self.rank = bus.rank
        self.inbox = inbox
        self.params = params
        self.world_size = world_size
        self.config = config or RuntimeConfig()
        self._clock = clock
        #: called with each new session (uid, new rank, new world size) after the param
        #: plane took it: the job's default group re-forms over the same survivors
        self._on_session = on_session
        #: told of each new session on the reader thread, at once, where the session
        #: thread may still be forming the one before (never blocks): that formation
        #: then stops waiting for a member the newer session left out
        self._on_offered = on_offered
        self._stop = threading.Event()
        self._dead_lock = threading.Lock()
        #: the worker-local dead-rank ledger
        self.dead_ranks: set[int] = set()
        self.shutdown_seen = False
        #: set when the escape hatch fired (coordinator silent, or the reader failed)
        self.coordinator_lost = threading.Event()
        #: set when the coordinator declared *this* rank dead (it was silent too long, e.g.
        #: SIGSTOPped): its work went to the survivors, so it must not go on
        self.declared_dead = threading.Event()
        #: why the rank left mid-run on a request from outside (``leave``), if it did
        self.left: str | None = None
        self._session_cond = threading.Condition()
        self._session: NewNcclSession | None = None
        self._heartbeats = 0
        self._threads: list[threading.Thread] = []
        #: reads, their routing and their acks, on either thread, one at a time, in order
        self._read_lock = threading.Lock()
        #: whether the training thread polls the control itself (``poll_control``)
        self._polls = callable(getattr(bus, "poll_control", None))
        #: when the training thread last polled (its clock)
        self._last_poll = 0.0
        #: set by the training thread before it waits on its inbox: the reader reads
        self._wanted = threading.Event()
        #: when a control entry was last taken (the coordinator-liveness clock)
        self._last_seen = clock()

    # ------------------------------------------------------------------- life

    def start(self) -> RankRuntime:
        if self._polls:
            hurry = self.inbox.before_wait

            def before_wait() -> None:
                if hurry is not None:
                    hurry()
                self._wanted.set()

            self.inbox.before_wait = before_wait
            self.inbox.before_poll = self.poll_control
        for name, target in (
            ("reader", self._reader),
            ("heartbeat", self._heartbeat),
            ("session", self._session_worker),
        ):
            t = threading.Thread(target=target, name=f"rank{self.rank}-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def close(self, flush_timeout: float = 5.0) -> None:
        """Stop every thread, flush upstream, close the bus. Idempotent."""
        self.inbox.before_poll = None
        self._stop.set()
        self._wanted.set()
        with self._session_cond:
            self._session_cond.notify_all()
        for t in self._threads:
            t.join(timeout=max(2.0, 4 * self.config.read_block_ms / 1000.0))
            if t.is_alive():
                _log.error("thread_did_not_stop", rank=self.rank, thread=t.name)
        self._threads = []
        if not self.bus.flush(flush_timeout):
            _log.error("upstream_flush_timeout", rank=self.rank, timeout_s=flush_timeout)
        self.bus.close()

    def __enter__(self) -> RankRuntime:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- reader

    def _reader(self) -> None:
        cfg = self.config
        try:
            while not self._stop.is_set():
                if self._polls and self._polled():
                    # The training thread takes its control between steps: stand by.
                    self._wanted.wait(POLL_STALE_S)
                    if self._silent_too_long():
                        return
                    continue
                with self._read_lock:
                    try:
                        deliveries = self.bus.read_control(cfg.read_block_ms)
                    except BusLost as exc:
                        # Its bus process or host agent is gone (``flodl_bus.agent``):
                        # nothing more can come or go, so stop now instead of after the
                        # liveness timeout.
                        if not self.shutdown_seen:
                            self._escape(f"bus lost: {exc}")
                        return
                    except Exception as exc:
                        # The transport reconnects with backoff on its own; a persistent
                        # failure ends up as silence, which the liveness clock handles.
                        _log.warning("control_read_failed", rank=self.rank, error=repr(exc))
                        self._stop.wait(cfg.read_block_ms / 1000.0)
                        deliveries = ()
                    if deliveries:
                        self._took(deliveries)
                if not deliveries and self._silent_too_long():
                    return
        except Exception as exc:
            _log.exception("control_reader_failed", rank=self.rank)
            if not self.shutdown_seen:
                self._escape(f"control reader failed: {exc!r}")
        finally:
            # Nothing more can arrive: wake a training thread blocked on the inbox.
            self.inbox.close()

    def _polled(self) -> bool:
        """Whether the training thread polls its control now (and does not wait)."""
        return not self._wanted.is_set() and self._clock() - self._last_poll < POLL_STALE_S

    def _silent_too_long(self) -> bool:
        """The coordinator-liveness escape hatch: True once it fired."""
        silent = self._clock() - self._last_seen
        if self.shutdown_seen or silent <= self.config.coord_liveness_timeout:
            return False
        self._escape(f"no coordinator entry for {silent:.1f}s")
        return True

    def _took(self, deliveries: Sequence[Delivery]) -> None:
        """One read taken over (the read lock held): routed in order, then acked."""
        self._last_seen = self._clock()
        self.route(deliveries)
        self.bus.ack(deliveries)

    def poll_control(self) -> None:
        """The training thread, between steps, with nothing queued: take the control
        already there, without waiting. The reader has it while it holds the lock."""
        self._last_poll = self._clock()
        if self._wanted.is_set():
            self._wanted.clear()
        if not self._read_lock.acquire(blocking=False):
            return
        try:
            deliveries = self.bus.poll_control()  # type: ignore[attr-defined]
            if deliveries:
                self._took(deliveries)
        except BusLost:
            self._wanted.set()  # the reader reads, meets the loss and stops the rank
        finally:
            self._read_lock.release()

    def route(self, deliveries: Sequence[Delivery]) -> None:
        """Act on one read of control (``worker.control.route`` decides each entry) and
        queue what the training thread must see. Replay feeds recorded reads here."""
        # One read becomes visible to the training thread at once, so messages the
        # coordinator sent together (a plan and a Throttle) are not split by a batch.
        batch: list[ControlMsg] = []
        origins: list[Origin | None] = []
        try:
            self._route_into(deliveries, batch, origins)
        finally:
            self.inbox.put_many(batch, origins)

    def _route_into(
        self, deliveries: Sequence[Delivery], batch: list[ControlMsg], origins: list[Origin | None]
    ) -> None:
        if self.declared_dead.is_set():
            return  # control for the survivors; this rank is out of the run
        for d in deliveries:
            msg = d.msg
            if not is_control_wire(msg):
                # The transport decodes the control channel only: this is a bug, not an
                # attack. Nothing to act on.
                _log.error("control_not_routable", rank=self.rank, entry_id=d.entry_id)
                continue
            routed = control.route(msg, self.rank)
            if routed is None:
                continue
            if isinstance(routed, control.Deliver):
                if routed.ends_run:
                    self.shutdown_seen = True
                batch.append(routed.msg)
                origins.append((d.stream, d.entry_id))
            elif isinstance(routed, control.PeerDead):
                self._declare_dead((routed.rank,))
            elif isinstance(routed, control.DeclaredDead):
                self._declared_dead_self()
                batch.append(Shutdown())
                origins.append((d.stream, d.entry_id))
                return
            elif isinstance(routed, control.MakeSessionId):
                uid = secrets.token_bytes(NEW_SESSION_UID_BYTES)
                self.bus.publish(NewNcclIdGenerated(rank=self.rank, uid_bytes=uid))
            elif isinstance(routed, control.JoinSession):
                with self._session_cond:
                    self._session = routed.session  # latest wins
                    self._session_cond.notify_all()
                if self._on_offered is not None:
                    s = routed.session
                    self._on_offered(s.uid_bytes, s.new_rank, s.new_world_size)
            else:
                assert_never(routed)

    def _declare_dead(self, ranks: Sequence[int]) -> None:
        with self._dead_lock:
            new = [r for r in ranks if r != self.rank and r not in self.dead_ranks]
            self.dead_ranks.update(new)
        if new:
            # A collective with a dead peer never completes; abort it so the training
            # thread can wait for a new session instead.
            _log.warning("ranks_declared_dead", rank=self.rank, dead=sorted(new))
            try:
                self.params.abort()
            except Exception:
                _log.exception("param_abort_failed", rank=self.rank)

    def _declared_dead_self(self) -> None:
        # A rank revived after the coordinator gave up on it (SIGSTOP/SIGCONT, a long
        # stall): its chunks were re-served and the survivors re-formed without it, so
        # going on would train work twice and enter collectives nobody else is in.
        self.declared_dead.set()
        self.shutdown_seen = True  # the coordinator's silence from now on is expected
        _log.error(
            "declared_dead",
            rank=self.rank,
            detail="the coordinator declared this rank dead (silent past its heartbeat "
            "timeout); its work went to the survivors; stopping",
        )
        try:
            # Its own collective (if any) waits on peers that left.
            self.params.abort()
        except Exception:
            _log.exception("param_abort_failed", rank=self.rank)

    def _escape(self, why: str) -> None:
        # Losing the coordinator means losing the world: a rank parked in a collective
        # never reads control, so mark every peer dead (aborting the collective) and
        # stop the training thread.
        _log.error("coordinator_lost", rank=self.rank, detail=why)
        self.coordinator_lost.set()
        self._declare_dead([r for r in range(self.world_size) if r != self.rank])
        self.inbox.put(Shutdown())

    def leave(self, reason: str) -> None:
        """Stop on a request from outside (a signal), from any thread but the training
        one. The coordinator hears it at once (``Exiting`` with the reason), so it
        re-forms the survivors now instead of after its heartbeat timeout; then the
        training thread stops as on a Shutdown. Idempotent."""
        with self._dead_lock:
            if self.left is not None or self.shutdown_seen:
                return  # already leaving, or told to stop: the run's end is in order
            self.left = reason
        _log.warning("rank_leaving", rank=self.rank, reason=reason)
        try:
            self.bus.publish(Exiting(rank=self.rank, reason=reason))
        except Exception as exc:  # the heartbeat timeout still finds the rank gone
            _log.error("exiting_not_sent", rank=self.rank, error=repr(exc))
        self.inbox.put(Shutdown())

    # -------------------------------------------------------------- heartbeat

    def _heartbeat(self) -> None:
        interval = self.config.heartbeat_interval
        # Where this rank has read its control: the coordinator trims no further (a
        # transport without entry ids has no such thing).
        read = getattr(self.bus, "control_read", None)
        while not self._stop.is_set():
            self._heartbeats += 1
            ctl, bcast = read() if callable(read) else (None, None)
            if callable(read):
                # "Nothing read yet" is a position too: said as the streams' start, so a
                # rank whose control never reaches it is still found not reading (None
                # says nothing, as a rank still setting up does).
                ctl, bcast = ctl or START_ID, bcast or START_ID
            try:
                self.bus.publish(
                    Heartbeat(
                        rank=self.rank, step_count=self._heartbeats, ctl_read=ctl, all_read=bcast
                    )
                )
            except Exception as exc:
                _log.warning("heartbeat_failed", rank=self.rank, error=repr(exc))
            if self._stop.wait(interval):
                return

    # ---------------------------------------------------------------- session

    def _session_worker(self) -> None:
        while True:
            with self._session_cond:
                self._session_cond.wait_for(lambda: self._stop.is_set() or self._session)
                if self._stop.is_set():
                    return
                session, self._session = self._session, None
            assert session is not None
            try:
                self.params.new_session(session.uid_bytes, session.new_rank, session.new_world_size)
            except Exception:
                _log.exception("new_session_failed", rank=self.rank)
            with self._session_cond:
                # A newer session came while the plane took this one (its formation gave
                # up for it): the job's group skips straight to that one, instead of
                # forming over a member that died, for a whole timeout, first.
                superseded = self._session is not None
            if self._on_session is not None and not superseded:
                try:
                    self._on_session(session.uid_bytes, session.new_rank, session.new_world_size)
                except Exception:
                    # The job's group is lost, not the run: its next collective says so.
                    _log.exception("user_group_not_reformed", rank=self.rank)
