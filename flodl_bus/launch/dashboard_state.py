"""What the dashboard shows, folded from a run's entries and its meta (sans-IO).

``launch/dashboard.py`` reads the streams and the ``meta`` hash and hands everything in
here with the time it was written (an entry id's milliseconds) or read (``now_ms``);
``snapshot`` turns the fold into the plain JSON object the page draws. No clock, socket
or thread here, so the fold is tested with entries alone.

Two sources, kept apart on purpose:

- the coordinator's own view in ``meta`` (what ``flodl-bus status`` reads): the status,
  each rank's epoch, the anchor and each rank's window, the averaging gate and why it is
  shut, the rounds, which ranks it declared dead or saw leave, when it last heard from
  each. The coordinator verified every entry behind it, so liveness comes from here;
- the streams, as an observer sees them (no rank keys, so no MAC is checked, as with
  ``flodl-bus tail``): each rank's step, loss and step rate from its ``Batch`` entries,
  the per-epoch aggregate (loss, samples/s per rank), the eval curve, deaths,
  re-formations, exits and the dead letters with their reasons.
"""

from __future__ import annotations

import bisect
import json
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flodl_bus.bus.ids import EntryId
from flodl_bus.protocol import leaving
from flodl_bus.protocol.messages import (
    Batch,
    DeclareDead,
    EpochAggregated,
    EvalBroadcast,
    EvalResult,
    Exiting,
    NewNcclSession,
    SaveReason,
    Shutdown,
    ShutdownWithSave,
    StartEpoch,
    SyncNow,
    WireUpdate,
)

#: a rank's step rate is over its Batch entries of the last this many milliseconds
RATE_WINDOW_MS = 10_000
#: the newest events and dead letters kept for the page (the counts stay whole)
KEEP_EVENTS = 200
KEEP_DEAD_LETTERS = 50
#: the statuses of a run still forming or training: its rates and gate mean something
LIVE_STATUSES = ("joining", "running", "unknown")


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


@dataclass(slots=True)
class _Rank:
    #: the rank's own step counter from its newest Batch (survives stream trimming)
    step: int | None = None
    loss: float | None = None
    epoch: int | None = None
    #: entry-id milliseconds of the Batch entries within the rate window
    batch_ms: deque[int] = field(default_factory=deque)
    #: ids of the SyncNow sent to this rank alone (sorted)
    sync_now: list[EntryId] = field(default_factory=list)
    #: said Exiting (with its reason, if any), or was declared dead
    exited: bool = False
    dead: bool = False


@dataclass(slots=True)
class Event:
    """One line of the run's story; a re-formation's text grows as ranks are told."""

    at_ms: int
    kind: str
    text: str


class DashboardState:
    """The fold of one run: entries in stream order per stream, meta whenever read."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.meta: dict[str, str] = {}
        self.meta_read_ms: int | None = None
        self._ranks: dict[int, _Rank] = {}
        #: (id, version) of every Update seen, and the ids of broadcast SyncNow, sorted:
        #: the rounds before an epoch's aggregate are counted by id, so they do not
        #: depend on the order the streams were read in (one found late is read late)
        self._updates: list[tuple[EntryId, int]] = []
        self._sync_all: list[EntryId] = []
        #: EpochAggregated by epoch (loss, samples/s per rank), and its entry id
        self._epochs: dict[int, tuple[EntryId, dict[str, Any]]] = {}
        #: eval metric by the epoch it scored (the eval tagged k scores epoch k - 1, the
        #: numbering of metrics.csv and the console's table)
        self.evals: dict[int, float] = {}
        self.events: deque[Event] = deque(maxlen=KEEP_EVENTS)
        self.event_count = 0
        #: re-formations by session id: their event and each told rank's new rank
        self._sessions: dict[bytes, tuple[Event, dict[int, int]]] = {}
        self.dead_letters: deque[dict[str, Any]] = deque(maxlen=KEEP_DEAD_LETTERS)
        self.dead_letter_count = 0
        #: entries an observer could not read (bad fields, undecodable), by reason
        self.unreadable = 0
        self.shutdown_seen = False
        #: bumped on every change, so a server pushes a snapshot only when there is news
        self.revision = 0

    # ------------------------------------------------------------------ input
    def _rank(self, r: int) -> _Rank:
        if r not in self._ranks:
            self._ranks[r] = _Rank()
        return self._ranks[r]

    def _event(self, at_ms: int, kind: str, text: str) -> Event:
        ev = Event(at_ms, kind, text)
        self.events.append(ev)
        self.event_count += 1
        return ev

    def on_control(self, rank: int | None, eid: EntryId, msg: object) -> None:
        """An entry of ``ctl:<rank>`` (``rank`` None: ``ctl:all``) at ``eid``."""
        self.revision += 1
        at_ms = eid[0]
        if isinstance(msg, SyncNow):
            bisect.insort(self._sync_all if rank is None else self._rank(rank).sync_now, eid)
        elif isinstance(msg, WireUpdate):
            bisect.insort(self._updates, (eid, msg.version))
            if msg.next_plan is not None and rank is not None:
                self._advance(rank, msg.next_plan.epoch)
        elif isinstance(msg, StartEpoch) and rank is not None:
            self._advance(rank, msg.plan.epoch)
        elif isinstance(msg, EpochAggregated):
            m = msg.metrics
            self._epochs[m.epoch] = (
                eid,
                {
                    "epoch": m.epoch,
                    "loss": _finite(m.avg_loss),
                    "epoch_s": m.epoch_ms / 1000.0,
                    # the wire's unit is samples per millisecond
                    "samples_per_s": [t * 1000.0 for t in m.per_rank_throughput],
                    # batches skipped for a non-finite loss, as metrics.csv counts them
                    "skipped": sum(m.per_rank_skipped),
                },
            )
        elif isinstance(msg, EvalBroadcast):
            if math.isfinite(msg.metric):
                self.evals[msg.epoch - 1] = msg.metric
        elif isinstance(msg, DeclareDead):
            self._rank(msg.rank).dead = True
            self._event(at_ms, "death", f"rank {msg.rank} declared dead by the coordinator")
        elif isinstance(msg, NewNcclSession) and rank is not None:
            self._reformed(rank, at_ms, msg)
        elif isinstance(msg, ShutdownWithSave):
            if msg.reason is not SaveReason.GRACEFUL_SHUTDOWN:
                self._event(at_ms, "stop", f"run stopped by the coordinator: {msg.reason.snake}")
        elif isinstance(msg, Shutdown) and not self.shutdown_seen:
            self.shutdown_seen = True
            self._event(at_ms, "end", "the coordinator shut the run down")

    def _advance(self, rank: int, epoch: int) -> None:
        rv = self._rank(rank)
        rv.epoch = epoch if rv.epoch is None else max(rv.epoch, epoch)

    def _reformed(self, rank: int, at_ms: int, msg: NewNcclSession) -> None:
        """One event per new session, naming each survivor's new rank as it is told."""
        known = self._sessions.get(msg.uid_bytes)
        if known is None:
            known = (self._event(at_ms, "reform", ""), {})
            self._sessions[msg.uid_bytes] = known
        ev, moves = known
        moves[rank] = msg.new_rank
        told = ", ".join(f"{r}->{n}" for r, n in sorted(moves.items()))
        ev.text = f"re-formed: world of {msg.new_world_size} (rank->new rank: {told})"

    def on_upstream(self, rank: int, eid: EntryId, msg: object) -> None:
        """An entry of ``up:<rank>`` at ``eid`` (its milliseconds: when it was written)."""
        self.revision += 1
        at_ms = eid[0]
        rv = self._rank(rank)
        if isinstance(msg, Batch):
            rv.step = msg.step_count
            rv.loss = _finite(msg.batch_loss)
            rv.batch_ms.append(at_ms)
            while rv.batch_ms and rv.batch_ms[0] < at_ms - RATE_WINDOW_MS:
                rv.batch_ms.popleft()
        elif isinstance(msg, EvalResult) and msg.error is not None:
            why = f"the eval scheduled at epoch {msg.epoch} failed: {msg.error}"
            self._event(at_ms, "eval", f"rank {rank}: {why}")
        elif isinstance(msg, Exiting) and not rv.exited:
            rv.exited = True
            if msg.reason is not None:
                if leaving.kind_of(msg.reason) == leaving.JOB_FAILED:
                    text = f"rank {rank}: {leaving.detail_of(msg.reason)}"
                else:
                    text = f"rank {rank} left: {msg.reason}"
                self._event(at_ms, "exit", text)

    def on_dead_letter(self, eid: EntryId, fields: Mapping[bytes, bytes]) -> None:
        """An entry of the run's ``dlq`` stream (what a reader refused, and why)."""
        self.revision += 1
        self.dead_letter_count += 1

        def text(key: bytes) -> str:
            return fields.get(key, b"?").decode(errors="replace")

        self.dead_letters.append(
            {
                "at_ms": eid[0],
                "stream": text(b"stream"),
                "entry": text(b"entry"),
                "reason": text(b"reason"),
                "by": text(b"by"),
            }
        )

    def on_unreadable(self) -> None:
        self.revision += 1
        self.unreadable += 1

    def on_meta(self, meta: Mapping[str, str], now_ms: int) -> None:
        """The ``meta`` hash as read at ``now_ms`` (the run's secret never reaches it)."""
        fresh = {k: v for k, v in meta.items() if k != "secret"}
        if fresh != self.meta:
            self.revision += 1
        self.meta = fresh
        self.meta_read_ms = now_ms

    # ----------------------------------------------------------------- output
    @property
    def rounds(self) -> int:
        """Averaging rounds seen on the wire (see ``rounds_before``)."""
        return self.rounds_before(None)

    def rounds_before(self, eid: EntryId | None) -> int:
        """Rounds completed before entry ``eid`` (None: all seen): the highest ``Update``
        version (CPU rounds), or the most ``SyncNow`` any rank was sent, broadcast or
        its own (NCCL rounds). The coordinator's ids come from one counter, so an id
        orders its entries across streams exactly."""

        def upto(ids: list[EntryId]) -> int:
            return len(ids) if eid is None else bisect.bisect_left(ids, eid)

        # (eid,) sorts before every (eid, version): the Updates strictly before eid
        cut = len(self._updates) if eid is None else bisect.bisect_left(self._updates, (eid,))
        version = max((v for _, v in self._updates[:cut]), default=0)
        shared = upto(self._sync_all)
        own = max((upto(r.sync_now) for r in self._ranks.values()), default=0)
        return max(version, shared + own)

    def _world(self) -> int:
        size = _int(self.meta.get("world_size"))
        if size:
            return size
        return max(self._ranks, default=-1) + 1

    def snapshot(self, now_ms: int) -> dict[str, Any]:
        """Everything the page shows, as one JSON-able object."""
        meta = self.meta
        status = meta.get("status", "unknown") if meta else "unknown"
        live = status in LIVE_STATUSES
        world = self._world()
        rank_epoch = json_list(meta.get("rank_epoch"))
        window = json_list(meta.get("counts"))
        heard = json_list(meta.get("heard_s"))
        state_at = _float(meta.get("state_at"))
        state_age = None if state_at is None else max(0.0, now_ms / 1000 - state_at)
        dead = set(json_list(meta.get("dead")))
        exited = set(json_list(meta.get("exited")))
        last_row = self._epochs[max(self._epochs)][1] if self._epochs else None
        ranks = []
        for r in range(world):
            rv = self._ranks.get(r, _Rank())
            epoch = rank_epoch[r] if r < len(rank_epoch) else rv.epoch
            age = heard[r] if r < len(heard) else None
            if r in dead or rv.dead:
                state = "dead"
            elif r in exited or rv.exited:
                state = "left" if live else "done"
            else:
                state = "alive" if live else "done"
            rate = None
            recent = [ms for ms in rv.batch_ms if ms >= now_ms - RATE_WINDOW_MS]
            if live and len(recent) >= 2 and recent[-1] > recent[0]:
                rate = (len(recent) - 1) / ((recent[-1] - recent[0]) / 1000)
            per_s = last_row["samples_per_s"] if last_row else []
            ranks.append(
                {
                    "rank": r,
                    "state": state,
                    "epoch": epoch,
                    "step": rv.step,
                    "loss": rv.loss,
                    "steps_per_s": rate,
                    "samples_per_s": per_s[r] if r < len(per_s) else None,
                    "window": window[r] if r < len(window) else None,
                    "heard_s": (
                        float(age) + state_age
                        if isinstance(age, int | float) and state_age is not None and live
                        else None
                    ),
                }
            )
        rounds = _int(meta.get("syncs"))
        epochs = _int(meta.get("epochs"))
        epoch = min((e for e in rank_epoch if isinstance(e, int)), default=None)
        if epoch is None:
            epoch = min(
                (rv.epoch for rv in self._ranks.values() if rv.epoch is not None), default=None
            )
        if status == "finished" and epochs is not None:
            epoch = epochs  # every epoch trained (the last index is epochs - 1)
        gate_open = meta.get("gate_open")
        rows = []
        for e in sorted(set(self._epochs) | set(self.evals)):
            row: dict[str, Any] = {"epoch": e}
            if e in self._epochs:
                eid, aggregate = self._epochs[e]
                # the final averaging, after the last aggregate, is the last epoch's
                # (metrics.csv's rule): a finished run's last row has every round
                last = status == "finished" and epochs is not None and e == epochs - 1
                total = self.rounds if rounds is None else rounds
                row.update(aggregate, rounds_total=total if last else self.rounds_before(eid))
            row["eval"] = self.evals.get(e)
            rows.append(row)
        return {
            "run": self.run,
            "status": status,
            "live": live,
            "mode": meta.get("mode"),
            "job": meta.get("job"),
            "world_size": world,
            "epochs": epochs,
            "epoch": epoch,
            "phase": meta.get("phase") or None,
            "anchor": _int(meta.get("anchor")),
            "gate": (
                None
                if gate_open is None or not live
                else {"open": gate_open == "1", "why": meta.get("gate_why") or None}
            ),
            "rounds": self.rounds if rounds is None else rounds,
            "state_age_s": state_age,
            "ranks": ranks,
            "epoch_rows": rows,
            "evals": [{"epoch": e, "metric": m} for e, m in sorted(self.evals.items())],
            "events": [{"at_ms": ev.at_ms, "kind": ev.kind, "text": ev.text} for ev in self.events],
            "event_count": self.event_count,
            "dead_letters": {"count": self.dead_letter_count, "recent": list(self.dead_letters)},
            "unreadable": self.unreadable,
            "now_ms": now_ms,
        }


def _int(raw: str | None) -> int | None:
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


def _float(raw: str | None) -> float | None:
    try:
        return float(raw) if raw else None
    except ValueError:
        return None


def json_list(raw: str | None) -> list[Any]:
    """A JSON list field of the run's meta; anything else (absent, damaged) is empty."""
    try:
        got = json.loads(raw or "[]")
    except ValueError:
        return []
    return got if isinstance(got, list) else []
