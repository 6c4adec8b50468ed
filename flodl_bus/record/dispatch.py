"""The record of one process: what it read, what its core decided, what it emitted.

One JSON object per line in ``runs/<run>/coordinator.jsonl.zst`` or
``runs/<run>/rank<r>.jsonl.zst`` (plain ``.jsonl`` with ``FLODL_RECORD_COMPRESS=0``;
``.jsonl.gz`` is read too). Every core-facing event carries ``i``, numbered from one
counter per process in the order the events happened; replay walks them in ``i``.

Common to both roles:

``{"event": "run", "role", "rank", "run", ...}``
    first line: everything needed to rebuild the core (config, world size, mode, job,
    model-port capabilities). Never a secret.
``{"event": "dispatch", "i", "stream", "id", "sender", "msg", "now", "before", "after", "out"}``
    one decoded entry handed to the core. ``msg`` and the messages inside ``out`` are wire
    maps (``flodl_bus.protocol.wire.to_map``); ``before``/``after`` are the core's
    decision-relevant state (``Coordinator.state_summary()``, ``WorkerControl.state()``);
    ``now`` is the clock reading the core acted on. A rank's dispatch adds ``stop``,
    ``throttled``, ``calls`` (every port call made during it, with its answer), ``logs``
    (warnings/errors the core logged, e.g. ``one_chunk_in_flight_violated``) and ``raised``
    when the core raised. ``stream``/``id`` are None for a message that did not come from
    a stream (the param plane's in-process ``Update``, whose ``msg`` is
    ``{"type": "Update", "local": true, "version", "realized", "tensors"}``).
``{"event": <other>, ...}``
    free-form runtime events (membership, reconnects, alerts); replay ignores them.
    ``{"event": "lost_broadcast", "control", "now", "error"}``: a broadcast the bus
    refused (the timeline's ``LostBroadcast``).

A coordinator's recorder also folds each core call it records into flodl's timeline
events (``record.telemetry``) and appends them to ``events.jsonl`` in the same
directory, so what a watcher reads live is what ``flodl-bus events`` derives later.
``{"event": "end", "records", ...}``
    the last line (``DispatchRecorder.end``): without it the record is incomplete.

Every line also ends in ``"d"``, its link in the record's digest chain (``record.chain``).

Coordinator only:

Its core events (below, and ``dispatch``) carry ``before``/``after`` whole only in the
first one; every later one carries ``changed`` (and ``patched``) instead: what differs
from the previous event's ``after`` (``record.states``, which ``replay`` expands back).

``{"event": "start", "i", "now", "before", "after", "out"}``
    ``Coordinator.start(now)``.
``{"event": "tick", "i", "now", "before", "after", "out"[, "behind": true]}``
    a tick that emitted something or changed state; ``behind``: the runtime's last read
    may have left entries waiting, so the tick judged no rank silent
    (``Coordinator.tick``). Absent means not behind (every record before it).
``{"event": "send_failed", "i", "rank", "msg", "now", "before", "after", "out"}``
    ``Coordinator.send_failed``: the runtime could not deliver ``msg``.
``{"event": "declare_dead", "i", "rank", "now", "before", "after", "out"}``
    ``Coordinator.declare_dead``: a death reported from outside the sweep.
``{"event": "port", "i", "call", "args", "result"}``
    what a port answered (kept for runtimes that consult one outside a dispatch).

Rank only (the training loop's side of the state machine, so a replay needs no model):

``{"event": "read", "i", "now", "entries": [{"stream", "id", "msg"}, ...]}``
    one read of the control streams by the reader thread: the input of the rank.
``{"event": "take", "i", "stream", "id", "msg", "why"}``
    a message the loop consumed without dispatching it: ``drop``, discarded at teardown.
    Records made before every plan went through the core's mailbox also hold ``plan`` (a
    StartEpoch taken while idle), ``shutdown`` and ``skip``; replay still reads them.
``{"event": "plan", "i", "source", "plan", "now", "partition_len", "after"}``
    ``begin_plan``; ``source`` is ``pending`` (the core's mailbox; ``taken`` in the older
    records above).
``{"event": "step", "i", "args": [loss, batch_ms, data_ms, lr], "calls", "out", "after", "now"}``
    one optimizer step (``step_done``): its measured values are inputs of the record.
    ``now`` is the rank's clock when the step was done (replay does not read it: it
    dates the step for ``bench.breakdown``; records before it have none).
``{"event": "closed", "i", "out"}``
    ``channel_closed``: the reader died while the rank was throttled.

Recording is synchronous and runs on the thread that dispatched: arguments may be
mutated right after the call returns, except a coordinator's states, of which the last
``after`` is the base of the next delta (the loop hands in a fresh summary each call),
and a rank's ``step``: its values must not change after the call (they are fresh or
frozen), because a compressed record encodes that line on its writer thread
(``Recorder.record_settled``). Every line is sealed into the chain by the sink, in
order (a compressed record's on that thread too).

Where the lines are built (``process``): by default on that same thread. With
``DispatchRecorder(..., process=True)`` (coordinator only) the thread keeps only the
state delta and hands each call to a record process (``record.process``), which builds,
chains, compresses and folds the lines there, off the dispatching thread's GIL: the
record is the same, line for line. The ``flodl-bus coordinator`` command records that way
unless ``FLODL_RECORD_PROCESS=0`` (or ``--tensorboard``, whose scalars come from the live
events in the coordinator's process); ``FLODL_RECORD_PROCESS=shadow`` (opt-in) leaves
the thread not even the states: the record process rebuilds them with a checked shadow
core (``coordinator.shadow``). A record process that cannot start leaves the record on
the thread (``record_process_unavailable`` in the log), one that dies stops the run
(``failure``; see ``record.process``).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Final, get_args

import orjson
import structlog

from flodl_bus.protocol import wire
from flodl_bus.protocol.messages import EpochPlan, SyncAck, Update, WireMsg
from flodl_bus.record import log, process, states
from flodl_bus.record.log import Recorder
from flodl_bus.record.process import RecordProcess, RecordProcessUnavailable
from flodl_bus.record.telemetry import EVENTS_FILE, LOST_BROADCAST, Timeline

_WIRE_CLASSES: Final[frozenset[type]] = frozenset(get_args(WireMsg))
_PLAIN: Final = (bool, int, float, str, bytes)


def local_update(msg: Update) -> dict[str, Any]:
    """The in-process Update without its tensors: what a replay needs of it."""
    avg = msg.avg
    return {
        "type": "Update",
        "local": True,
        "version": avg.version,
        "realized": avg.realized,
        "tensors": [len(avg.params), len(avg.buffers)],
    }


def record_value(value: Any) -> Any:
    """A JSON-ready form of a message, an effect, or plain data."""
    t = type(value)
    if value is None or t in _PLAIN:
        return value
    if t is dict:
        return {str(k): record_value(v) for k, v in value.items()}
    if t is list or t is tuple:
        return [record_value(v) for v in value]
    if t in _WIRE_CLASSES:
        return wire.to_map(value)
    if t is Update:
        return local_update(value)
    if t is EpochPlan:
        return wire.plan_to_map(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, _PLAIN):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {"kind": t.__name__}
        for f in dataclasses.fields(value):
            out[f.name] = record_value(getattr(value, f.name))
        return out
    if isinstance(value, Mapping):
        return {str(k): record_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [record_value(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(record_value(v) for v in value)
    return repr(value)


def dumps(value: Any) -> bytes:
    """``value`` as a record line holds it: messages, effects and dataclasses included."""
    return log.dumps(value, record_value)


#: ``0`` writes plain ``*.jsonl`` records; anything else (the default) ``*.jsonl.zst``.
ENV_COMPRESS: Final = "FLODL_RECORD_COMPRESS"


def compress_default() -> bool:
    return os.environ.get(ENV_COMPRESS, "1").strip().lower() not in ("0", "no", "false", "off")


def record_path(
    run_dir: str | Path, role: str, rank: int | None = None, *, compress: bool = False
) -> Path:
    name = "coordinator" if role == "coordinator" else f"rank{rank}"
    return Path(run_dir) / f"{name}.jsonl{'.zst' if compress else ''}"


def _taken(run_dir: Path, role: str, rank: int | None) -> bool:
    stem = record_path(run_dir, role, rank)
    return any(stem.with_name(stem.name + s).exists() for s in ("", ".zst", ".gz"))


def fresh_run_dir(run_dir: str | Path, role: str, rank: int | None = None) -> Path:
    """``run_dir`` if it holds no record of this process yet, else the first of
    ``run_dir.2``, ``run_dir.3``... that does not: one run per record, never appended
    to an earlier one (a run id reused with ``--reset-run``). Every process of the rerun
    makes the same choice, so its records land together."""
    base = Path(run_dir)
    candidate, k = base, 1
    while _taken(candidate, role, rank):
        k += 1
        candidate = base.with_name(f"{base.name}.{k}")
    return candidate


class DispatchRecorder:
    """Thin, allocation-light writer of the events above for one process.

    Every line reaches the OS as it is written (a compressed record: within
    ``record.chain.FLUSH_S``), so a process that hangs, crashes or is killed leaves its
    record up to its last core call: that is the run a replay reproduces.

    ``run_dir`` is the directory the record went to: the one asked for, or a fresh
    sibling (``rotated_from`` says which was asked) when it already held a record of
    this process.
    """

    def __init__(
        self,
        run_dir: str | Path,
        role: str,
        rank: int | None = None,
        *,
        compress: bool | None = None,
        deltas: bool | None = None,
        events: bool | None = None,
        process: bool = False,
    ) -> None:
        self.role = role
        #: core events carry state deltas (``record.states``): the coordinator's, whose
        #: state grows with the world; a rank's few fields are written whole
        self.deltas = role == "coordinator" if deltas is None else deltas
        #: the last ``after`` recorded: the base of the next delta (never mutated)
        self._state: Mapping[str, Any] | None = None
        self.rank = rank
        asked = Path(run_dir)
        self.run_dir = fresh_run_dir(asked, role, rank)
        self.rotated_from: Path | None = asked if self.run_dir != asked else None
        if compress is None:
            compress = compress_default()
        self.path = record_path(self.run_dir, role, rank, compress=compress)
        #: the record process writing this record (``record.process``), if any
        self._remote: RecordProcess | None = None
        self._lines = 0
        self._ended = False
        if process:
            if role != "coordinator":
                raise ValueError("only a coordinator's record is written by a record process")
            self._remote = self._start_process(compress, events)
        self._rec: Recorder | None = (
            Recorder(self.path, encoder=record_value) if self._remote is None else None
        )
        # next() on itertools.count is atomic under the GIL: the reader and the training
        # thread of a rank share the numbering without a lock.
        self._counter = itertools.count()
        #: flodl's timeline events as they happen (``record.telemetry``): the coordinator's,
        #: folded from the very calls recorded here, so they equal a derivation from the
        #: record; written to ``events.jsonl`` once there is one
        self.timeline: Timeline | None = (
            Timeline()
            if (role == "coordinator" if events is None else events) and self._remote is None
            else None
        )
        self._events: BinaryIO | None = None
        self._on_events: Callable[[Sequence[Mapping[str, Any]]], None] | None = None
        if self.rotated_from is not None:
            structlog.get_logger("flodl_bus.record").warning(
                "record_rotated",
                asked=str(asked),
                record=str(self.path),
                why="the run directory already holds a record of this process "
                "(a reused run id): this run is recorded beside it, never appended",
            )

    # ------------------------------------------------------------------ both roles

    def _start_process(self, compress: bool, events: bool | None) -> RecordProcess | None:
        spec = {
            "run_dir": str(self.run_dir),
            "role": self.role,
            "rank": self.rank,
            "compress": compress,
            "deltas": self.deltas,
            "events": events,
        }
        try:
            remote = RecordProcess(spec, self.process_module)
        except (OSError, RecordProcessUnavailable) as exc:
            structlog.get_logger("flodl_bus.record").warning(
                "record_process_unavailable",
                error=repr(exc)[:300],
                detail="recording on the dispatching thread instead",
            )
            return None
        if remote.path != self.path:
            remote.close()
            raise RuntimeError(f"the record process chose {remote.path}, not {self.path}")
        structlog.get_logger("flodl_bus.record").info(
            "record_process_started",
            pid=remote.pid,
            record=str(self.path),
            module=self.process_module,
        )
        return remote

    @property
    def remote(self) -> RecordProcess | None:
        """The record process writing this record, if any."""
        return self._remote

    #: the module the record process runs (``python -m``)
    process_module = "flodl_bus.record.process"
    #: whether the caller hands in the core's states (``before``/``after``); a recorder
    #: that rebuilds them itself (``coordinator.shadow``) says False
    needs_states: bool = True

    @property
    def in_process(self) -> bool:
        """Whether a record process writes this record (``record.process``)."""
        return self._remote is not None

    @property
    def failure(self) -> str | None:
        """Why the record process is gone (None: recording): the record stops there."""
        return None if self._remote is None else self._remote.failure

    @property
    def on_events(self) -> Callable[[Sequence[Mapping[str, Any]]], None] | None:
        """Also handed each batch of timeline events as it is written (TensorBoard);
        in-thread recording only: the events of a record process stay in that process."""
        return self._on_events

    @on_events.setter
    def on_events(self, fn: Callable[[Sequence[Mapping[str, Any]]], None] | None) -> None:
        if fn is not None and self._remote is not None:
            raise ValueError("on_events needs the in-thread recorder (process=False)")
        self._on_events = fn

    def _send(self, item: tuple[Any, ...]) -> None:
        assert self._remote is not None
        if self._ended:
            return
        self._lines += 1
        self._remote.send(item)

    def header(self, **config: Any) -> None:
        fields = record_value(config)
        if self._remote is not None:
            self._send((process.HEADER, fields))
            return
        assert self._rec is not None
        self._rec.record("run", role=self.role, rank=self.rank, **fields)
        if self.timeline is not None:
            cfg = fields.get("config")
            self.timeline = Timeline(cfg if isinstance(cfg, Mapping) else None)

    def dispatch(
        self,
        *,
        stream: str | None,
        entry_id: str | None,
        msg: object,
        now: float,
        before: Mapping[str, Any],
        after: Mapping[str, Any],
        out: Sequence[object],
        sender: int | None = None,
        changes: Mapping[str, Sequence[int] | None] | None = None,
        patches: Mapping[str, list[Any]] | None = None,
        delta: dict[str, Any] | None = None,
        **extra: Any,
    ) -> None:
        """One upstream message's line. ``changes``: where ``after``'s lists differ from
        ``before``'s when one was built from the other (``Coordinator.summary_changes``),
        so the delta need not look for it; ``patches``: the entries set in place between
        them (``Coordinator.summary_patches``, ``Summarizer.mirror``); ``delta``: the
        delta itself, from whoever built ``after`` from ``before`` knowing it
        (``Coordinator.summary_delta``). None of them is recorded itself."""
        i = next(self._counter)
        st = self._states(before, after, sender, changes, patches, delta)
        if self._remote is not None:
            k, values = process.pack_msg(msg, record_value)
            self._send(
                (
                    process.DISPATCH, i, stream, entry_id, sender, k, values, now, st,
                    record_value(out) if out else [], record_value(extra) if extra else {},
                )
            )  # fmt: skip
            return
        self.write_dispatch(i, stream, entry_id, sender, msg, now, st, out, extra, before, after)

    def write_dispatch(
        self,
        i: int,
        stream: str | None,
        entry_id: str | None,
        sender: int | None,
        msg: object,
        now: float,
        st: Mapping[str, Any],
        out: Sequence[object],
        extra: Mapping[str, Any],
        before: Mapping[str, Any],
        after: Mapping[str, Any],
    ) -> None:
        """The line of ``dispatch`` once its number and state fields are known (the
        record process writes through here)."""
        assert self._rec is not None
        self._rec.record_core(
            "dispatch",
            i=i,
            stream=stream,
            id=entry_id,
            sender=sender,
            msg=msg,
            now=now,
            **st,
            out=out,
            **extra,
        )
        if self.timeline is not None:
            self._observe("dispatch", i, now, before, after, out, msg, sender)

    def _states(
        self,
        before: Mapping[str, Any],
        after: Mapping[str, Any],
        hint: int | None,
        changes: Mapping[str, Sequence[int] | None] | None = None,
        patches: Mapping[str, list[Any]] | None = None,
        delta: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """``before`` and ``after`` as the line holds them: whole, or (``deltas``) what
        changed since the last recorded ``after`` when ``before`` is that state, as it
        always is in the coordinator loop (its cache hands back the same object). With
        ``patches`` (a summarizer that sets lists in place), whole states are copied:
        their lists change after the call, before a record process takes them. A
        ``delta`` handed in is taken as it is, where it is one from ``last``."""
        last = self._state
        if self.deltas:
            self._state = after
            if delta is not None and before is last:
                # A fresh dict of each build, never written again: no copy needed.
                return delta
            if last is not None and (before is last or (patches is None and before == last)):
                # ``changes`` is ``after`` against ``before``, which equals ``last``.
                return states.delta(last, after, hint, changes, patches)
        if patches is not None:
            return {"before": states.copy_state(before), "after": states.copy_state(after)}
        return {"before": before, "after": after}

    def event(self, name: str, **fields: Any) -> None:
        if name == "end":
            self.end(**fields)
            return
        values = record_value(fields)
        if self._remote is not None:
            self._send((process.EVENT, name, values))
            return
        self.write_event(name, values)

    def write_event(self, name: str, values: Mapping[str, Any]) -> None:
        assert self._rec is not None
        self._rec.record(name, **values)
        if self.timeline is not None and name == LOST_BROADCAST:
            self._write_events(
                self.timeline.runtime_event(name, float(values.get("now") or 0.0), values)
            )

    # ------------------------------------------------------------------ live events

    def _observe(
        self,
        event: str,
        i: int,
        now: float,
        before: Mapping[str, Any],
        after: Mapping[str, Any],
        out: Sequence[object],
        msg: object = None,
        sender: int | None = None,
    ) -> None:
        """The timeline's events of one recorded call. A dispatch with no effect, no
        anchor or round change and no ``SyncAck`` implies none (``Timeline.core_call`` says the
        same of its record form): most Batches stop here, before any conversion."""
        tl = self.timeline
        assert tl is not None
        if (
            not out
            and event == "dispatch"
            and type(msg) is not SyncAck
            and before.get("anchor") == after.get("anchor")
            and before.get("avg_count") == after.get("avg_count")
        ):
            tl.state = after
            return
        rmsg = record_value(msg)
        evs = tl.core_call(
            event,
            i,
            now,
            before,
            after,
            record_value(list(out)),
            rmsg if isinstance(rmsg, Mapping) else None,
            sender,
        )
        if evs:
            self._write_events(evs)

    def _write_events(self, evs: Sequence[Mapping[str, Any]]) -> None:
        if not evs:
            return
        if self._events is None:
            self._events = (self.run_dir / EVENTS_FILE).open("ab")
        self._events.write(b"".join(orjson.dumps(e) + b"\n" for e in evs))
        # Decisions only (a few per window): each reaches the OS as it happens, so a
        # watcher reading the file sees it now, and a crash leaves it behind.
        self._events.flush()
        if self._on_events is not None:
            self._on_events(evs)

    def end(self, **fields: Any) -> None:
        """The record's closing line (``record.chain``): nothing is recorded after it."""
        if self._remote is not None:
            self._send((process.END, record_value(fields)))
            self._ended = True
            return
        assert self._rec is not None
        self._rec.end(**record_value(fields))

    @property
    def lines(self) -> int:
        return self._lines if self._rec is None else self._rec.lines

    # ------------------------------------------------------------------ coordinator

    def port(self, *, call: str, args: Mapping[str, Any], result: Any) -> None:
        i = next(self._counter)
        if self._remote is not None:
            self._send((process.PORT, i, call, record_value(args), record_value(result)))
            return
        self.write_port(i, call, args, result)

    def write_port(self, i: int, call: str, args: Mapping[str, Any], result: Any) -> None:
        assert self._rec is not None
        self._rec.record_core("port", i=i, call=call, args=args, result=result)

    def core_call(
        self,
        event: str,
        *,
        now: float,
        before: Mapping[str, Any],
        after: Mapping[str, Any],
        out: Sequence[object],
        patches: Mapping[str, list[Any]] | None = None,
        delta: dict[str, Any] | None = None,
        **extra: Any,
    ) -> None:
        """A coordinator core call other than an upstream dispatch: ``start``, ``tick``,
        ``send_failed`` (with ``rank``, ``msg``), ``declare_dead`` (``rank``),
        ``interrupt``. Replay re-issues each by its event name. ``patches``, ``delta``:
        as for ``dispatch`` (never recorded)."""
        rank = extra.get("rank")
        i = next(self._counter)
        hint = rank if type(rank) is int else None
        st = self._states(before, after, hint, None, patches, delta)
        if self._remote is not None:
            self._send(
                (process.CORE, event, i, now, st, record_value(out) if out else [],
                 record_value(extra))
            )  # fmt: skip
            return
        self.write_core(event, i, now, st, out, extra, before, after)

    def write_core(
        self,
        event: str,
        i: int,
        now: float,
        st: Mapping[str, Any],
        out: Sequence[object],
        extra: Mapping[str, Any],
        before: Mapping[str, Any],
        after: Mapping[str, Any],
    ) -> None:
        """The line of ``core_call`` once its number and state fields are known."""
        assert self._rec is not None
        rank = extra.get("rank")
        self._rec.record_core(event, i=i, now=now, **st, out=out, **extra)
        if self.timeline is not None:
            self._observe(
                event,
                i,
                now,
                before,
                after,
                out,
                extra.get("msg"),
                rank if type(rank) is int else None,
            )

    # ------------------------------------------------------------------ rank

    def read(self, *, now: float, entries: Sequence[tuple[str, str, object]]) -> None:
        assert self._rec is not None
        self._rec.record_core(
            "read",
            i=next(self._counter),
            now=now,
            entries=[{"stream": s, "id": e, "msg": m} for s, e, m in entries],
        )

    def take(self, *, stream: str | None, entry_id: str | None, msg: object, why: str) -> None:
        assert self._rec is not None
        self._rec.record_core(
            "take",
            i=next(self._counter),
            stream=stream,
            id=entry_id,
            msg=msg,
            why=why,
        )

    def plan(
        self,
        *,
        source: str,
        plan: object,
        now: float,
        partition_len: int,
        after: Mapping[str, Any],
    ) -> None:
        assert self._rec is not None
        self._rec.record_core(
            "plan",
            i=next(self._counter),
            source=source,
            plan=plan,
            now=now,
            partition_len=partition_len,
            after=after,
        )

    def step(
        self,
        *,
        args: tuple[float, float, float, float],
        calls: Sequence[object],
        out: Sequence[object],
        after: Mapping[str, Any],
        now: float | None = None,
    ) -> None:
        assert self._rec is not None
        # Every value is fresh or frozen (``CoreRecorder.stepped``): the line may be
        # encoded off this thread, the training thread.
        self._rec.record_settled(
            "step",
            i=next(self._counter),
            args=args,
            calls=calls,
            out=out,
            after=after,
            now=now,
        )

    def closed(self, *, out: object, after: Mapping[str, Any]) -> None:
        assert self._rec is not None
        self._rec.record_core("closed", i=next(self._counter), out=out, after=after)

    def _next(self) -> int:
        return next(self._counter)

    # ------------------------------------------------------------------ file

    def flush(self) -> None:
        if self._remote is not None:
            self._remote.flush()
            return
        assert self._rec is not None
        self._rec.flush()

    def close(self) -> None:
        if self._remote is not None:
            self._remote.close()
            return
        assert self._rec is not None
        self._rec.close()
        if self._events is not None:
            self._events.close()
            self._events = None
